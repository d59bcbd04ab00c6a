"""Mixtral: Mistral attention (optional sliding window) with a sparse mixture-of-experts MLP in every block."""

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
from .llama import LlamaConfig, LlamaLMHeadModel
from .moe import MoeMlp, check_moe_fields, sparse_flops_per_token

__all__ = ["MixtralConfig", "MixtralLMHeadModel"]


@register_config("mixtral")
@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """Mixtral (Hugging Face ``MixtralForCausalLM``): Llama-style blocks whose MLP is a sparse mixture of experts.

    Inherits every :class:`LlamaConfig` field (``qk_norm`` must stay False: Hugging Face Mixtral has none).

    Attributes:
        num_experts: experts per block (``num_local_experts``).
        num_experts_per_tok: experts each token is routed to (``k``).
        router_aux_loss_coef: the weight of the load-balancing loss added to the training objective.
        sliding_window: if set, each query attends to at most this many keys (itself included), as Mistral.
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
        >>> cfg = MixtralConfig(
        ...     seq_len=8,
        ...     hidden_dim=16,
        ...     intermediate_dim=24,
        ...     num_layers=2,
        ...     num_heads=4,
        ...     num_kv_heads=2,
        ...     num_experts=4,
        ...     num_experts_per_tok=2,
        ... )
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    sliding_window: int | None = None
    moe_dispatch: str = "auto"
    moe_capacity_factor: float | None = None
    router_bias_update_rate: float = 0.0
    router_metrics_groups: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_moe_fields("MixtralConfig", self)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"MixtralConfig: sliding_window must be positive or None, got {self.sliding_window}")
        if self.qk_norm:
            raise ValueError("MixtralConfig: qk_norm=True is not supported (Hugging Face Mixtral has no QK-norm)")

    @property
    def Experts(self) -> Axis:
        """The experts axis ``experts`` (map it to a mesh axis for expert parallelism)."""
        return Axis("experts", self.num_experts)

    def attention_windows(self) -> tuple[int | None, ...]:
        """Every layer attends over ``sliding_window`` (see :meth:`LmConfig.attention_windows`)."""
        return (self.sliding_window,) * self.num_layers

    def build(self, Vocab: Axis, *, key: jax.Array) -> MixtralLMHeadModel:
        """Build a randomly initialized Mixtral (see :meth:`LmConfig.build`)."""
        return MixtralLMHeadModel.init(self, Vocab, key=key)

    feed_forward_keys: ClassVar[int] = 1

    def init_feed_forward(self, keys: jax.Array) -> GatedMlp | MoeMlp:
        """The mixture of experts of one block (state-dict key ``block_sparse_moe``)."""
        return MoeMlp.init(
            self.Embed,
            self.Mlp,
            self.Experts,
            self.num_experts_per_tok,
            key=keys[0],
            dispatch=self.moe_dispatch,
            capacity_factor=self.moe_capacity_factor,
            balance_bias=self.router_bias_update_rate > 0,
        )

    def flops_per_token(self, vocab_size: int) -> float:
        """Forward FLOPs per token *of the sparse model*: ``k`` active experts per token, plus the router.

        This is the usual MoE convention for MFU (:func:`~ponente.models.moe.sparse_flops_per_token`). The default
        ``"dense"`` dispatch executes ``num_experts / num_experts_per_tok`` times the expert FLOPs counted here;
        ``"sorted"`` executes them.
        """
        return sparse_flops_per_token(self, vocab_size, self.intermediate_dim)

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``MixtralConfig`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`)."""
        out = super().to_hf_config(vocab_size)
        for key in ("attention_bias", "mlp_bias"):
            del out[key]
        out.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            router_aux_loss_coef=self.router_aux_loss_coef,
            router_jitter_noise=0.0,
            sliding_window=self.sliding_window,
        )
        return out

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> MixtralConfig:
        """Read a Hugging Face ``MixtralConfig`` dict, transformers-4 or -5 spelling.

        Raises:
            KeyError: if a required key is missing.
            ValueError: for options this implementation does not support (e.g. router jitter noise).
        """
        jitter = float(hf_config.get("router_jitter_noise") or 0.0)
        if jitter:
            raise ValueError(
                f"MixtralConfig.from_hf_config: router_jitter_noise={jitter} is not supported (expected 0.0)"
            )
        base = LlamaConfig.from_hf_config(hf_config)
        window = hf_config.get("sliding_window")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
        return cls(
            **fields,
            num_experts=int(hf_config.get("num_local_experts", hf_config.get("num_experts", 8))),
            num_experts_per_tok=int(hf_config.get("num_experts_per_tok", 2)),
            router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
            sliding_window=int(window) if window is not None else None,
        )


# Hugging Face expert layouts: per expert (checkpoint files of transformers 4 and 5), fused (transformers 5 in memory)
_PER_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_FUSED = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_FUSED_ROUTER = re.compile(r"^(.*)\.mlp\.gate\.weight$")
_STACKED = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(w[123])$")


def _to_stacked_experts(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face Mixtral state dict (any layout) with each block's experts stacked: ``...experts.wN``."""
    out: dict[str, Any] = {}
    per_expert: dict[str, dict[int, Any]] = {}
    for key, value in state_dict.items():
        if m := _PER_EXPERT.match(key):
            per_expert.setdefault(f"{m[1]}.block_sparse_moe.experts.{m[3]}", {})[int(m[2])] = value
        elif m := _FUSED.match(key):
            array = np.asarray(value)
            if m[2] == "down_proj":
                out[f"{m[1]}.block_sparse_moe.experts.w2"] = array
            else:  # gate_up_proj: (experts, 2 * mlp, embed), gate (w1) first
                half = array.shape[1] // 2
                out[f"{m[1]}.block_sparse_moe.experts.w1"] = array[:, :half]
                out[f"{m[1]}.block_sparse_moe.experts.w3"] = array[:, half:]
        elif m := _FUSED_ROUTER.match(key):
            out[f"{m[1]}.block_sparse_moe.gate.weight"] = value
        else:
            out[key] = value
    for key, experts in per_expert.items():
        missing = [e for e in range(max(experts) + 1) if e not in experts]
        if missing:
            raise KeyError(
                f"Mixtral state dict: {key.replace('experts.', f'experts.{missing[0]}.')}.weight is missing"
            )
        out[key] = np.stack([np.asarray(experts[e]) for e in range(len(experts))])
    return out


class MixtralLMHeadModel(LlamaLMHeadModel):
    """Mixtral: Llama whose blocks' feed-forward is a sparse mixture of experts (``block_sparse_moe``).

    Besides the logits, a forward pass yields one auxiliary loss, ``router_aux_loss``: the
    load-balancing loss (:func:`~ponente.models.moe.load_balancing_loss` over the routing of all layers)
    times ``config.router_aux_loss_coef``; see :meth:`logits_and_aux`.

    Hugging Face state dicts are read in every layout transformers uses (per-expert
    ``block_sparse_moe.experts.{e}.w1/w2/w3`` as written to files, or the fused in-memory
    ``mlp.experts.gate_up_proj/down_proj`` of transformers 5) and written per expert (both versions load it).

    Attributes:
        transformer: embeddings, layers and final norm (state-dict key ``model``).
        lm_head: ``Embed -> Vocab`` without bias, or None when tied.
        config: the config (static).
        vocab_size: the real vocabulary size when the vocabulary axis is padded (static).
    """

    def to_hf_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under their Hugging Face names, experts one by one (``block_sparse_moe.experts.{e}.wN``).

        Returns:
            The state dict that ``transformers`` (4 or 5) loads from a checkpoint file.
        """
        out: dict[str, np.ndarray] = {}
        for key, value in super().to_hf_state_dict().items():
            if m := _STACKED.match(key):
                for e in range(value.shape[0]):
                    out[f"{m[1]}.block_sparse_moe.experts.{e}.{m[2]}.weight"] = value[e]
            else:
                out[key] = value
        return out

    def from_hf_state_dict(self, state_dict: Mapping[str, Any]) -> Self:
        """A copy of this (template) model with parameters read from a Hugging Face Mixtral state dict.

        Args:
            state_dict: per-expert (``block_sparse_moe.experts.{e}.w1/w2/w3.weight``) or fused transformers-5
                (``mlp.experts.gate_up_proj/down_proj``, ``mlp.gate.weight``) layout; extra keys are ignored.

        Returns:
            The loaded model.

        Raises:
            KeyError: if a parameter (or one expert of a block) is missing.
            ValueError: if a parameter has the wrong shape.
        """
        return super().from_hf_state_dict(_to_stacked_experts(state_dict))
