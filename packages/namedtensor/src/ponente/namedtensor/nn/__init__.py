"""Neural-network layers and functions for named arrays (Haliax's ``hax.nn``)."""

from . import activations, attention, functional, loss, mup
from .activations import (
    celu,
    elu,
    gelu,
    glu,
    hard_sigmoid,
    hard_silu,
    hard_swish,
    hard_tanh,
    leaky_relu,
    log_sigmoid,
    quick_gelu,
    relu,
    relu6,
    relu_squared,
    selu,
    sigmoid,
    silu,
    soft_sign,
    softplus,
    swish,
)
from .conv import Conv, ConvTranspose
from .dropout import Dropout, dropout
from .embedding import Embedding
from .functional import log_softmax, logsumexp, one_hot, softmax, standardize
from .linear import Linear
from .loss import binary_cross_entropy_loss, cross_entropy_loss, cross_entropy_loss_and_log_normalizers, reduce_loss
from .mlp import MLP
from .moe_linear import MoELinear
from .normalization import LayerNorm, RmsNorm
from .pool import max_pool, mean_pool, min_pool

__all__ = [
    "MLP",
    "Conv",
    "ConvTranspose",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MoELinear",
    "RmsNorm",
    "activations",
    "attention",
    "binary_cross_entropy_loss",
    "celu",
    "cross_entropy_loss",
    "cross_entropy_loss_and_log_normalizers",
    "dropout",
    "elu",
    "functional",
    "gelu",
    "glu",
    "hard_sigmoid",
    "hard_silu",
    "hard_swish",
    "hard_tanh",
    "leaky_relu",
    "log_sigmoid",
    "log_softmax",
    "logsumexp",
    "loss",
    "max_pool",
    "mean_pool",
    "min_pool",
    "mup",
    "one_hot",
    "quick_gelu",
    "reduce_loss",
    "relu",
    "relu6",
    "relu_squared",
    "selu",
    "sigmoid",
    "silu",
    "soft_sign",
    "softmax",
    "softplus",
    "standardize",
    "swish",
]

# --- exports of nn.scan (maintained by NNB) ---
from . import scan
from .scan import BlockFoldable, BlockSeq, ScanCheckpointPolicy, ScanCheckpointSpec, Stacked, tree_checkpoint_name

__all__ += [
    "BlockFoldable",
    "BlockSeq",
    "ScanCheckpointPolicy",
    "ScanCheckpointSpec",
    "Stacked",
    "scan",
    "tree_checkpoint_name",
]
