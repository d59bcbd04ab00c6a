"""gpt-oss: attention with sinks and biases, alternating sliding and full layers, YaRN rotary, and a mixture of
clamped-SwiGLU experts with biases in every block."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import jax
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import Axis

from ._layer_types import FULL, SLIDING, check_layer_types
from .attention import Attention
from .attention.backends import check_sinks_backend
from .config import register_config
from .decoder import GatedMlp, QkNormAttention, grouped_attention
from .llama import LlamaConfig, LlamaLMHeadModel
from .moe import ClampedSwiGlu, MoeMlp, check_moe_fields, sparse_flops_per_token
from .rotary import RotaryConfig

__all__ = ["GptOssConfig", "GptOssLMHeadModel"]

_HF_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""transformers' default ``rope_parameters`` of gpt-oss (those of the released checkpoints)."""

_HF_DEFAULTS = {
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
}
"""transformers' defaults of the ``GptOssConfig`` keys that Llama's reader requires (a null ``head_dim`` is
``hidden_size / num_attention_heads``, as there)."""


def _default_rope() -> RotaryConfig:
    return RotaryConfig.from_hf({"rope_parameters": _HF_ROPE})


def _alternating(num_layers: int) -> tuple[str, ...]:
    """transformers' default ``layer_types`` of gpt-oss: even layers slide, odd layers attend to everything."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))


@register_config("gpt_oss")
@dataclasses.dataclass(frozen=True)
class GptOssConfig(LlamaConfig):
    """gpt-oss (Hugging Face ``GptOssForCausalLM``, e.g. gpt-oss-20b): pre-RMSNorm blocks whose attention has
    learned sinks and biases, alternating sliding-window and full layers, and a sparse mixture of experts.

    Every :class:`~ponente.models.LlamaConfig` field applies (``qk_norm`` must stay False); ``intermediate_dim`` is
    the hidden size of one expert (Hugging Face ``intermediate_size``). What is new:

    - **attention sinks**: one learned logit per query head joins each softmax's denominator (state-dict key
      ``self_attn.sinks``; see :class:`~ponente.models.QkNormAttention`). The ``reference`` and ``flash``
      attention backends compute them (``auto`` picks one of them; the KV cache's attention has them too), under
      context parallelism too.
    - **experts**: ``down(act(gate(x) + b_gate, up(x) + b_up)) + b_down`` with the clamped SwiGLU
      :class:`~ponente.models.moe.ClampedSwiGlu`; the router has a bias and softmaxes over the ``k`` chosen logits
      (:func:`~ponente.models.moe.route_top_k_softmax`).
    - **rotary**: YaRN by default (``rope``), as in the released checkpoints.

    Attributes:
        sliding_window: how many keys (the query's own included) a sliding layer sees.
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"`` (Hugging Face ``layer_types``);
            None: transformers' default, even layers sliding and odd layers full.
        attention_bias: biases on the query, key, value and output projections (true in every checkpoint).
        num_experts: experts per block (``num_local_experts``).
        num_experts_per_tok: experts each token is routed to (``k``).
        swiglu_alpha: the experts' sigmoid gain (``swiglu_alpha``).
        swiglu_limit: the experts' clamp (``swiglu_limit``).
        router_aux_loss_coef: the weight of the load-balancing loss added to the training objective.
        moe_dispatch: ``"auto"`` (default: ``"expert_parallel"`` when ``trainer.expert_axis_size`` > 1 splits the
            experts, else ``"dense"``), ``"dense"``, ``"sorted"`` or ``"expert_parallel"`` (see
            :class:`~ponente.models.moe.MoeMlp`).
        moe_capacity_factor: ``"expert_parallel"`` only: None (dropless) or the per-destination buffer size relative
            to an even split (see the Mixtral page).
        router_bias_update_rate: DeepSeek-V3's auxiliary-loss-free balancing: each MoE layer gets a router bias, added
            to the router logits for the top-k choice only (the weights stay the softmax of the chosen logits), that
            the trainer moves by ``rate * sign(mean load - load)`` after every step (0: off, no bias).
        router_metrics_groups: the MoE layers, in order, split into this many groups of consecutive layers (fewer
            when there are fewer layers; see :func:`~ponente.models.moe.layer_groups`) whose router metrics are logged
            per group (``router/group_<g>/<metric>``) besides the overall ones; 0: none.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = GptOssConfig(
        ...     seq_len=8,
        ...     hidden_dim=16,
        ...     intermediate_dim=12,
        ...     num_layers=2,
        ...     num_heads=4,
        ...     num_kv_heads=2,
        ...     head_dim=8,
        ...     sliding_window=4,
        ...     num_experts=4,
        ...     num_experts_per_tok=2,
        ... )
        >>> state = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0)).to_hf_state_dict()
        >>> state["model.layers.0.self_attn.sinks"].shape, state["model.layers.1.mlp.experts.gate_up_proj"].shape
        ((4,), (4, 16, 24))
    """

    rope: RotaryConfig = dataclasses.field(default_factory=_default_rope)
    layer_norm_epsilon: float = 1e-5
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] | None = None
    attention_bias: bool = True
    num_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001
    moe_dispatch: str = "auto"
    moe_capacity_factor: float | None = None
    router_bias_update_rate: float = 0.0
    router_metrics_groups: int = 4

    feed_forward_keys: ClassVar[int] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        check_moe_fields(name, self)
        check_sinks_backend(self.attn_backend, f"{name}: attn_backend")
        if self.qk_norm:
            raise ValueError(f"{name}: qk_norm=True is not supported (Hugging Face gpt-oss has no QK-norm)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{name}: sliding_window must be positive or None, got {self.sliding_window}")
        if not self.swiglu_limit > 0:
            raise ValueError(f"{name}: swiglu_limit must be positive, got {self.swiglu_limit}")
        if self.layer_types is not None:
            check_layer_types(self.layer_types, self.num_layers, name)
        sliding = [i for i, t in enumerate(self.resolved_layer_types()) if t == SLIDING]
        if sliding and self.sliding_window is None:
            raise ValueError(
                f"{name}: layer_types makes layers {sliding} {SLIDING!r} but sliding_window is None; set a window or "
                f"mark them {FULL!r}"
            )

    @property
    def Experts(self) -> Axis:
        """The experts axis ``experts`` (map it to a mesh axis for expert parallelism)."""
        return Axis("experts", self.num_experts)

    def resolved_layer_types(self) -> tuple[str, ...]:
        """``layer_types``, or transformers' default alternation (layer 0 slides).

        Returns:
            One entry per layer.
        """
        return self.layer_types if self.layer_types is not None else _alternating(self.num_layers)

    def attention_windows(self) -> tuple[int | None, ...]:
        """``sliding_window`` for the sliding layers, None for the others (see :meth:`LmConfig.attention_windows`)."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.resolved_layer_types())

    def build(self, Vocab: Axis, *, key: jax.Array) -> GptOssLMHeadModel:
        """Build a randomly initialized gpt-oss (see :meth:`LmConfig.build`)."""
        return GptOssLMHeadModel.init(self, Vocab, key=key)

    def init_attention(self, *, key: jax.Array) -> Attention | QkNormAttention:
        """Grouped-query attention with (zero) biases if ``attention_bias``, and zero sinks (one per query head)."""
        attn = grouped_attention(self, self.rope, key=key, use_bias=self.attention_bias)
        return QkNormAttention(attn=attn, q_norm=None, k_norm=None, sinks=hax.zeros(self.Heads))

    def init_feed_forward(self, keys: jax.Array) -> GatedMlp | MoeMlp:
        """The mixture of clamped-SwiGLU experts of one block (Hugging Face ``mlp``: ``router`` and ``experts``)."""
        return MoeMlp.init(
            self.Embed,
            self.Mlp,
            self.Experts,
            self.num_experts_per_tok,
            key=keys[0],
            dispatch=self.moe_dispatch,
            capacity_factor=self.moe_capacity_factor,
            bias=True,
            activation=ClampedSwiGlu(alpha=self.swiglu_alpha, limit=self.swiglu_limit),
            softmax_after_top_k=True,
            balance_bias=self.router_bias_update_rate > 0,
        )

    def flops_per_token(self, vocab_size: int) -> float:
        """Forward FLOPs per token of the sparse model (``k`` active experts, plus the router; see
        :func:`~ponente.models.moe.sparse_flops_per_token`; biases and sinks are not counted)."""
        return sparse_flops_per_token(self, vocab_size, self.intermediate_dim)

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``GptOssConfig`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`)."""
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "vocab_size": vocab_size,
            "max_position_embeddings": self.seq_len,
            "hidden_size": self.hidden_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.HeadSize.size,
            "hidden_act": "silu",
            "rms_norm_eps": self.layer_norm_epsilon,
            "rope_parameters": self.rope.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.resolved_layer_types()),
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "router_aux_loss_coef": self.router_aux_loss_coef,
        }

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> GptOssConfig:
        """Read a Hugging Face ``GptOssConfig`` dict (missing keys take transformers' defaults).

        Raises:
            ValueError: for unsupported options (``attention_dropout``, a ``partial_rotary_factor`` other than 1, a
                ``rope_type`` other than default, linear, llama3 or yarn, a bad ``layer_types``), naming the key.
        """
        where = f"{cls.__name__}.from_hf_config"
        dropout = float(hf_config.get("attention_dropout") or 0.0)
        if dropout:
            raise ValueError(f"{where}: attention_dropout={dropout} is not supported (expected 0.0)")
        hf = dict(hf_config)
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or _HF_ROPE)
        rope.setdefault("rope_theta", hf.get("rope_theta", _HF_ROPE["rope_theta"]))
        partial = float(rope.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"{where}: rope_parameters.partial_rotary_factor={partial} is not supported (expected 1)")
        hf = {**_HF_DEFAULTS, **hf, "rope_parameters": rope, "attention_bias": False, "hidden_act": "silu"}
        base = LlamaConfig.from_hf_config(hf)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
        num_layers = base.num_layers
        raw_types = hf_config.get("layer_types")
        types = tuple(str(t) for t in raw_types) if raw_types is not None else None
        if types is not None:
            check_layer_types(types, num_layers, where)
        window = hf_config.get("sliding_window", 128)
        fields.update(layer_norm_epsilon=float(hf_config.get("rms_norm_eps", 1e-5)))
        return cls(
            **fields,
            sliding_window=int(window) if window is not None else None,
            layer_types=None if types == _alternating(num_layers) else types,
            attention_bias=bool(hf_config.get("attention_bias", True)),
            num_experts=int(hf_config.get("num_local_experts", hf_config.get("num_experts", 128))),
            num_experts_per_tok=int(hf_config.get("num_experts_per_tok", 4)),
            swiglu_alpha=float(hf_config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf_config.get("swiglu_limit", 7.0)),
            router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
        )


# Hugging Face's layout (in memory and in files): the router ``mlp.router``; per block, the experts fused over an
# ``experts`` axis, gate and up interleaved along the output (``gate_up_proj[..., 0::2]`` is the gate) and weights
# stored ``(in, out)``. Ours: ``block_sparse_moe.gate``; ``experts.w1/w3`` ``(experts, mlp, embed)``, ``experts.w2``
# ``(experts, embed, mlp)``, biases ``experts.b1/b3/b2``.
_OURS = re.compile(r"^(.*)\.block_sparse_moe\.(gate\.(weight|bias)|experts\.([wb][123]))$")
_HF_ROUTER = re.compile(r"^(.*)\.mlp\.router\.(weight|bias)$")
_HF_EXPERTS = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
_QUANTIZED = re.compile(r"^.*\.mlp\.experts\.\w+_(blocks|scales)$")


def _to_hf_experts(prefix: str, ours: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One block's experts in Hugging Face's fused, interleaved ``(in, out)`` layout."""
    out = f"{prefix}.mlp.experts"
    gate_up = np.stack([ours["w1"].transpose(0, 2, 1), ours["w3"].transpose(0, 2, 1)], axis=-1)
    gate_up_bias = np.stack([ours["b1"], ours["b3"]], axis=-1)
    return {
        f"{out}.gate_up_proj": gate_up.reshape(*gate_up.shape[:2], -1),
        f"{out}.gate_up_proj_bias": gate_up_bias.reshape(gate_up_bias.shape[0], -1),
        f"{out}.down_proj": ours["w2"].transpose(0, 2, 1),
        f"{out}.down_proj_bias": ours["b2"],
    }


def _from_hf_layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face gpt-oss state dict under our names (see the layouts above).

    Raises:
        ValueError: for MXFP4-quantized experts (``..._blocks``/``..._scales``, as in the released files).
    """
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        if _QUANTIZED.match(key):
            raise ValueError(
                f"gpt-oss state dict: {key} is MXFP4-quantized, which is not supported; dequantize the checkpoint "
                "first (e.g. load it in transformers with Mxfp4Config(dequantize=True) and save it again)"
            )
        if m := _HF_ROUTER.match(key):
            out[f"{m[1]}.block_sparse_moe.gate.{m[2]}"] = value
        elif m := _HF_EXPERTS.match(key):
            ours, array = f"{m[1]}.block_sparse_moe.experts", np.asarray(value)
            if m[2] == "gate_up_proj":
                out[f"{ours}.w1"] = array[..., 0::2].transpose(0, 2, 1)
                out[f"{ours}.w3"] = array[..., 1::2].transpose(0, 2, 1)
            elif m[2] == "gate_up_proj_bias":
                out[f"{ours}.b1"], out[f"{ours}.b3"] = array[..., 0::2], array[..., 1::2]
            elif m[2] == "down_proj":
                out[f"{ours}.w2"] = array.transpose(0, 2, 1)
            else:
                out[f"{ours}.b2"] = array
        else:
            out[key] = value
    return out


class GptOssLMHeadModel(LlamaLMHeadModel):
    """gpt-oss: the shared decoder with sink attention and a mixture of clamped-SwiGLU experts in every block.

    A forward pass also yields ``router_aux_loss`` (the load-balancing loss times ``router_aux_loss_coef``; see
    :meth:`logits_and_aux`). Hugging Face names: Llama's, with ``{q,k,v,o}_proj.bias`` and ``self_attn.sinks``,
    and per block ``mlp.router.{weight,bias}`` and ``mlp.experts.{gate_up_proj,down_proj}`` (fused over the experts,
    ``(in, out)``, gate and up interleaved) with their ``_bias``. MXFP4-quantized checkpoints are refused.
    """

    def to_hf_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under their Hugging Face names and layout (see the class docstring).

        Returns:
            The state dict that ``transformers`` loads.
        """
        out: dict[str, np.ndarray] = {}
        experts: dict[str, dict[str, np.ndarray]] = {}
        for key, value in super().to_hf_state_dict().items():
            m = _OURS.match(key)
            if m is None:
                out[key] = value
            elif m[3] is not None:
                out[f"{m[1]}.mlp.router.{m[3]}"] = value
            else:
                experts.setdefault(m[1], {})[m[4]] = np.asarray(value)
        for prefix, ours in experts.items():
            out.update(_to_hf_experts(prefix, ours))
        return out

    def from_hf_state_dict(self, state_dict: Mapping[str, Any]) -> Self:
        """A copy of this (template) model with parameters read from a Hugging Face gpt-oss state dict.

        Raises:
            KeyError: if a parameter is missing.
            ValueError: if a parameter has the wrong shape, or the experts are MXFP4-quantized.
        """
        return super().from_hf_state_dict(_from_hf_layout(state_dict))
