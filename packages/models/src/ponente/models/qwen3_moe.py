"""Qwen3-MoE: Qwen3's attention (QK-norm) with a sparse mixture of experts as the feed-forward of its blocks (every
block, or those that ``decoder_sparse_step`` and ``mlp_only_layers`` leave sparse; the others have a dense MLP)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import jax
import numpy as np

from ponente.namedtensor import Axis

from .config import register_config
from .decoder import GatedMlp
from .moe import MoeMlp, check_moe_fields, sparse_flops_per_token
from .qwen3 import Qwen3Config, Qwen3LMHeadModel

__all__ = ["Qwen3MoeConfig", "Qwen3MoeLMHeadModel"]


@register_config("qwen3_moe")
@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE (Hugging Face ``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): Qwen3 blocks whose MLP is a sparse
    mixture of experts.

    Every :class:`~ponente.models.Qwen3Config` field applies (QK-norm, ``head_dim``, attention biases).
    ``intermediate_dim`` is the size of the dense MLP of the blocks without experts (if any); the experts have
    ``moe_intermediate_dim``. Routing is Qwen3-MoE's: softmax over the experts (float32), the ``k`` best kept, their
    weights renormalized to sum to 1 only with ``norm_topk_prob``.

    Attributes:
        num_experts: experts per block (``num_experts``).
        num_experts_per_tok: experts each token is routed to (``k``).
        moe_intermediate_dim: the hidden size of one expert (``moe_intermediate_size``).
        norm_topk_prob: renormalize the ``k`` chosen probabilities (transformers' default is false; the
            released Qwen3-MoE checkpoints set it true).
        router_aux_loss_coef: the weight of the load-balancing loss added to the training objective.
        decoder_sparse_step: a block is sparse (has experts) when ``(layer + 1) % decoder_sparse_step == 0`` and it is
            not in ``mlp_only_layers``; the others have a dense SwiGLU MLP of ``intermediate_dim`` (1: every block, as
            in every released checkpoint).
        mlp_only_layers: blocks (0-based) with a dense MLP whatever ``decoder_sparse_step`` says.
        moe_dispatch: how tokens reach their experts (see :class:`~ponente.models.moe.MoeMlp`): ``"auto"`` (default:
            ``"expert_parallel"`` when the ``experts`` axis is split over a mesh axis, e.g. ``trainer.expert_axis_size:
            4``, else ``"dense"``), ``"dense"`` (named ops, ``num_experts / k`` times the expert FLOPs), ``"sorted"``
            (grouped matrix products over the assignments sorted by expert, sparse FLOPs, one device) or
            ``"expert_parallel"`` (tokens sent to the devices holding their experts by all-to-all).
        moe_capacity_factor: ``"expert_parallel"`` only: None (default, dropless) or the size of each device's
            per-destination buffer relative to an even split; assignments beyond it are dropped and logged
            (``router/dropped_fraction``).
        router_bias_update_rate: DeepSeek-V3's auxiliary-loss-free balancing: each MoE layer gets a router bias, added
            to the scores for the top-k choice only, that the trainer moves by ``rate * sign(mean load - load)`` after
            every step (0: off, no bias).
        router_metrics_groups: the MoE layers, in order, split into this many groups of consecutive layers (fewer
            when there are fewer layers; see :func:`~ponente.models.moe.layer_groups`) whose router metrics are logged
            per group (``router/group_<g>/<metric>``) besides the overall ones; 0: none.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = Qwen3MoeConfig(
        ...     seq_len=8,
        ...     hidden_dim=16,
        ...     intermediate_dim=32,
        ...     num_layers=2,
        ...     num_heads=4,
        ...     num_kv_heads=2,
        ...     head_dim=8,
        ...     num_experts=4,
        ...     num_experts_per_tok=2,
        ...     moe_intermediate_dim=12,
        ... )
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model.to_hf_state_dict()["model.layers.0.mlp.experts.3.down_proj.weight"].shape
        (16, 12)
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_dim: int = 768
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    moe_dispatch: str = "auto"
    moe_capacity_factor: float | None = None
    router_bias_update_rate: float = 0.0
    router_metrics_groups: int = 4

    feed_forward_keys: ClassVar[int] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        check_moe_fields(name, self)
        if self.moe_intermediate_dim < 1:
            raise ValueError(f"{name}: moe_intermediate_dim must be positive, got {self.moe_intermediate_dim}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"{name}: decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"{name}: mlp_only_layers must be in 0..num_layers - 1 ({self.num_layers - 1}), got {bad}"
            )
        if all(self.dense_layers()):
            raise ValueError(
                f"{name}: decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                f"{list(self.mlp_only_layers)} leave no block with experts (use a qwen3 config for a dense model)"
            )

    @property
    def Experts(self) -> Axis:
        """The experts axis ``experts`` (map it to a mesh axis for expert parallelism)."""
        return Axis("experts", self.num_experts)

    def dense_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its block has a dense MLP (:meth:`init_dense_feed_forward`) instead of experts, as
        transformers' ``Qwen3MoeDecoderLayer`` decides it (``mlp_only_layers``, ``decoder_sparse_step``)."""
        step, only = self.decoder_sparse_step, set(self.mlp_only_layers)
        return tuple(i in only or (i + 1) % step != 0 for i in range(self.num_layers))

    def build(self, Vocab: Axis, *, key: jax.Array) -> Qwen3MoeLMHeadModel:
        """Build a randomly initialized Qwen3-MoE (see :meth:`LmConfig.build`)."""
        return Qwen3MoeLMHeadModel.init(self, Vocab, key=key)

    def init_feed_forward(self, keys: jax.Array) -> GatedMlp | MoeMlp:
        """The mixture of experts of one block (Hugging Face ``mlp``: ``gate`` and ``experts``)."""
        return MoeMlp.init(
            self.Embed,
            Axis("mlp", self.moe_intermediate_dim),
            self.Experts,
            self.num_experts_per_tok,
            key=keys[0],
            dispatch=self.moe_dispatch,
            norm_topk_prob=self.norm_topk_prob,
            capacity_factor=self.moe_capacity_factor,
            balance_bias=self.router_bias_update_rate > 0,
        )

    def init_dense_feed_forward(self, keys: jax.Array) -> GatedMlp:
        """The dense SwiGLU MLP (``intermediate_dim``) of a block without experts (Hugging Face ``mlp.gate_proj``,
        ...)."""
        return GatedMlp.init(self.Embed, self.Mlp, jax.random.split(keys[0], 3))

    def flops_per_token(self, vocab_size: int) -> float:
        """Forward FLOPs per token of the sparse model (``k`` active experts, plus the router, in MoE blocks; see
        :func:`~ponente.models.moe.sparse_flops_per_token`; the dense MLP in the others)."""
        dense = sum(self.dense_layers())
        d = self.hidden_dim
        moe = 6.0 * d * self.moe_intermediate_dim * self.num_experts_per_tok + 2.0 * d * self.num_experts
        return sparse_flops_per_token(self, vocab_size, self.moe_intermediate_dim) + dense * (
            6.0 * d * self.intermediate_dim - moe
        )

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``Qwen3MoeConfig`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`).

        Raises:
            ValueError: if only some layers slide (Qwen3-MoE's window applies to every layer).
        """
        if self.layer_types is not None and len(set(self.layer_types)) > 1:
            raise ValueError(f"{type(self).__name__}.to_hf_config: Qwen3-MoE slides on every layer or on none")
        hf = super().to_hf_config(vocab_size)
        for key in ("layer_types", "max_window_layers"):
            hf.pop(key, None)
        hf.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            use_sliding_window=self.sliding_window is not None,
            sliding_window=self.sliding_window,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_dim,
            norm_topk_prob=self.norm_topk_prob,
            router_aux_loss_coef=self.router_aux_loss_coef,
            decoder_sparse_step=self.decoder_sparse_step,
            mlp_only_layers=list(self.mlp_only_layers),
        )
        return hf

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Qwen3MoeConfig:
        """Read a Hugging Face ``Qwen3MoeConfig`` dict (missing keys take transformers' defaults).

        Raises:
            KeyError: if a required key is missing.
            ValueError: for invalid options (see the class).
        """
        window = hf_config.get("sliding_window", 4096) if hf_config.get("use_sliding_window") else None
        plain = {k: v for k, v in hf_config.items() if k not in ("use_sliding_window", "layer_types")}
        base = Qwen3Config.from_hf_config(plain)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Qwen3Config)}
        fields.update(sliding_window=int(window) if window is not None else None, layer_types=None)
        return cls(
            **fields,
            num_experts=int(hf_config.get("num_experts", hf_config.get("num_local_experts", 128))),
            num_experts_per_tok=int(hf_config.get("num_experts_per_tok", 8)),
            moe_intermediate_dim=int(hf_config.get("moe_intermediate_size", 768)),
            norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
            decoder_sparse_step=int(hf_config.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in hf_config.get("mlp_only_layers") or ()),
        )


# Hugging Face expert layouts: per expert (checkpoint files), fused (transformers 5 in memory); ours: stacked
_HF_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PER_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(.*)\.mlp\.gate\.weight$")
_STACKED = re.compile(r"^(.*)\.block_sparse_moe\.(experts\.(w[123])|gate\.weight)$")


def _from_hf_layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face Qwen3-MoE state dict (either layout) under our names: ``...block_sparse_moe.experts.wN``
    stacked over the experts, ``...block_sparse_moe.gate.weight``."""
    out: dict[str, Any] = {}
    per_expert: dict[str, dict[int, Any]] = {}
    for key, value in state_dict.items():
        if m := _PER_EXPERT.match(key):
            per_expert.setdefault(f"{m[1]}.block_sparse_moe.experts.{_HF_PROJ[m[3]]}", {})[int(m[2])] = value
        elif m := _FUSED.match(key):
            array = np.asarray(value)
            if m[2] == "down_proj":
                out[f"{m[1]}.block_sparse_moe.experts.w2"] = array
            else:  # gate_up_proj: (experts, 2 * mlp, embed), gate first
                half = array.shape[1] // 2
                out[f"{m[1]}.block_sparse_moe.experts.w1"] = array[:, :half]
                out[f"{m[1]}.block_sparse_moe.experts.w3"] = array[:, half:]
        elif m := _ROUTER.match(key):
            out[f"{m[1]}.block_sparse_moe.gate.weight"] = value
        else:
            out[key] = value
    names = {v: k for k, v in _HF_PROJ.items()}
    for key, experts in per_expert.items():
        missing = [e for e in range(max(experts) + 1) if e not in experts]
        if missing:
            layer, proj = key.split(".block_sparse_moe.experts.")
            raise KeyError(f"Qwen3-MoE state dict: {layer}.mlp.experts.{missing[0]}.{names[proj]}.weight is missing")
        out[key] = np.stack([np.asarray(experts[e]) for e in range(len(experts))])
    return out


class Qwen3MoeLMHeadModel(Qwen3LMHeadModel):
    """Qwen3-MoE: Qwen3 whose blocks' feed-forward is a sparse mixture of experts.

    A forward pass also yields ``router_aux_loss`` (the load-balancing loss times ``router_aux_loss_coef``; see
    :meth:`logits_and_aux`). Hugging Face state dicts are read in both layouts transformers uses (per expert,
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, as in checkpoint files, or the fused in-memory
    ``mlp.experts.gate_up_proj/down_proj`` of transformers 5) and written per expert.
    """

    def to_hf_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under their Hugging Face names, experts one by one (``mlp.experts.{e}.gate_proj``, ...).

        Returns:
            The state dict that ``transformers`` loads from a checkpoint file.
        """
        names = {v: k for k, v in _HF_PROJ.items()}
        out: dict[str, np.ndarray] = {}
        for key, value in super().to_hf_state_dict().items():
            m = _STACKED.match(key)
            if m is None:
                out[key] = value
            elif m[3] is None:
                out[f"{m[1]}.mlp.gate.weight"] = value
            else:
                for e in range(value.shape[0]):
                    out[f"{m[1]}.mlp.experts.{e}.{names[m[3]]}.weight"] = value[e]
        return out

    def from_hf_state_dict(self, state_dict: Mapping[str, Any]) -> Self:
        """A copy of this (template) model with parameters read from a Hugging Face Qwen3-MoE state dict.

        Raises:
            KeyError: if a parameter (or one expert of a block) is missing.
            ValueError: if a parameter has the wrong shape.
        """
        return super().from_hf_state_dict(_from_hf_layout(state_dict))
