"""A zoo of foundation models written with ``ponente.namedtensor``, with Hugging Face import/export."""

from .attention import Attention, AttentionMask, dot_product_attention
from .config import LmConfig, config_for_type, lm_flops_per_token, register_config, registered_types
from .gpt2 import Gpt2Config, Gpt2LMHeadModel
from .llama import LlamaConfig, LlamaLMHeadModel
from .lm import LmExample, LmHeadModel, compute_next_token_loss
from .rotary import RotaryConfig, apply_rotary

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionMask",
    "Gpt2Config",
    "Gpt2LMHeadModel",
    "LlamaConfig",
    "LlamaLMHeadModel",
    "LmConfig",
    "LmExample",
    "LmHeadModel",
    "RotaryConfig",
    "apply_rotary",
    "compute_next_token_loss",
    "config_for_type",
    "dot_product_attention",
    "lm_flops_per_token",
    "register_config",
    "registered_types",
]
