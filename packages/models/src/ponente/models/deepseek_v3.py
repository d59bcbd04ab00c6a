"""DeepSeek-V3: multi-head latent attention (MLA) with a latent KV cache, and a mixture of experts with shared experts
and a sigmoid, group-limited router after ``first_k_dense_replace`` dense blocks."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Linear, RmsNorm
from ponente.namedtensor.quantization import DefaultDotGeneralOp
from ponente.namedtensor.state_dict import ModuleWithStateDictSerialization

from .attention import AttentionMask, attention
from .attention.kv_cache import CACHE_POSITION, KvCache
from .config import lm_flops_per_token, padded_vocab_size, register_config
from .decoder import DecoderStack, GatedMlp
from .llama import LlamaConfig, LlamaLMHeadModel
from .moe import TOP_K, MoeMlp, RouterOutput, check_moe_fields
from .remat import tag
from .rotary import RotaryConfig, apply_rotary

__all__ = ["DeepseekV3Config", "DeepseekV3LMHeadModel", "LatentAttention", "SharedExpertsMoe", "route_grouped_sigmoid"]

_LATENT_NORM_EPS = 1e-6
"""transformers' ``DeepseekV3RMSNorm`` default epsilon, which the latent norms keep (not ``rms_norm_eps``)."""


MLA_ABSORB = ("auto", "always", "never")
"""The values of ``DeepseekV3Config.mla_absorb``."""


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@register_config("deepseek_v3")
@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(LlamaConfig):
    """DeepSeek-V3 (Hugging Face ``DeepseekV3ForCausalLM``): pre-RMSNorm blocks with multi-head latent attention, the
    first ``first_k_dense_replace`` with a dense SwiGLU MLP and the others with a mixture of experts.

    ``intermediate_dim`` is the dense MLP's size; ``num_kv_heads`` must equal ``num_heads`` (MLA expands the latent
    into every head) and ``head_dim`` is ``qk_rope_head_dim`` (as transformers sets it; MLA's heads have their own
    sizes). What is new:

    - **MLA** (:class:`LatentAttention`): queries through a low-rank bottleneck (``q_lora_rank``, or one projection
      when None); keys and values from one shared latent of ``kv_lora_rank`` plus one rotary key of
      ``qk_rope_head_dim`` shared by the heads; per head a ``qk_nope_head_dim`` key part without rotary and a
      ``v_head_dim`` value. The KV cache holds the latent and the rotary key, not the heads' keys and values.
    - **routing** (:func:`route_grouped_sigmoid`): sigmoid scores, plus ``e_score_correction_bias`` for the choice
      only, within the ``topk_group`` best of ``n_group`` groups; weights times ``routed_scaling_factor``.
    - **shared experts**: a SwiGLU of ``n_shared_experts * moe_intermediate_dim`` that every token goes through.

    Attributes:
        num_experts: routed experts per block (``n_routed_experts``).
        num_experts_per_tok: experts each token is routed to (``k``).
        moe_intermediate_dim: one expert's hidden size (``moe_intermediate_size``).
        n_shared_experts: how many experts' worth of shared MLP (at least 1).
        routed_scaling_factor: multiplies the routed experts' weights.
        n_group: expert groups (``num_experts`` divisible by it, at least 2 experts per group).
        topk_group: groups a token's experts are chosen from.
        norm_topk_prob: renormalize the ``k`` chosen scores to sum to 1.
        first_k_dense_replace: how many first blocks have a dense MLP (below ``num_layers``).
        q_lora_rank: the query bottleneck (None: one ``Embed -> heads`` projection).
        kv_lora_rank: the key/value latent.
        qk_rope_head_dim: the rotary part of a query/key head.
        qk_nope_head_dim: the part without rotary.
        v_head_dim: a value head.
        rope_interleave: the rotary dimensions pair up as ``(0, 1), (2, 3), ...`` (the checkpoints' layout).
        attention_bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.
        mla_absorb: how a step with a KV cache attends: ``"auto"`` (in the latent space, ``kv_b_proj`` absorbed into
            the query and the output, when that costs fewer multiply-adds than expanding the cached latents per head:
            decoding steps; a long prefill expands), ``"always"`` or ``"never"``. A ``kv_b_proj`` with a bias, an
            adapter or a quantized product always expands. Training (no cache) is not affected.
        moe_dispatch: ``"dense"`` or ``"sorted"`` (see :class:`~ponente.models.moe.MoeMlp`).
        router_bias_update_rate: DeepSeek-V3's auxiliary-loss-free balancing: after each training step, every MoE
            block's ``e_score_correction_bias`` moves by ``rate * sign(mean load - load_e)`` (the paper's bias update
            speed, 0.001 in its pre-training); 0 (the default): the bias stays as loaded.
        router_metrics_groups: the MoE layers, in order, split into this many groups of consecutive layers whose
            router metrics are logged apart (``router/group_<g>/*``); 0: only the overall ones.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = DeepseekV3Config(
        ...     seq_len=8,
        ...     hidden_dim=16,
        ...     intermediate_dim=32,
        ...     num_layers=2,
        ...     num_heads=2,
        ...     num_kv_heads=2,
        ...     num_experts=4,
        ...     num_experts_per_tok=2,
        ...     moe_intermediate_dim=8,
        ...     n_group=2,
        ...     topk_group=1,
        ...     first_k_dense_replace=1,
        ...     q_lora_rank=8,
        ...     kv_lora_rank=8,
        ...     qk_rope_head_dim=4,
        ...     qk_nope_head_dim=4,
        ...     v_head_dim=4,
        ... )
        >>> state = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0)).to_hf_state_dict()
        >>> state["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape
        (12, 16)
    """

    layer_norm_epsilon: float = 1e-6
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_dim: int = 2048
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_interleave: bool = True
    attention_bias: bool = False
    mla_absorb: str = "auto"
    moe_dispatch: str = "dense"
    router_bias_update_rate: float = 0.0
    router_metrics_groups: int = 4

    feed_forward_keys: ClassVar[int] = 3

    def __post_init__(self) -> None:
        if self.head_dim is None:  # as transformers: the rotary part (the heads' sizes are MLA's own fields)
            object.__setattr__(self, "head_dim", self.qk_rope_head_dim)
        super().__post_init__()
        name = type(self).__name__
        check_moe_fields(name, self)
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"{name}: num_kv_heads ({self.num_kv_heads}) must equal num_heads ({self.num_heads}): MLA expands "
                "its latent into every head"
            )
        positive = ("moe_intermediate_dim", "n_shared_experts", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{name}: {key} must be positive, got {getattr(self, key)}")
        if self.mla_absorb not in MLA_ABSORB:
            raise ValueError(f"{name}: mla_absorb must be one of {MLA_ABSORB}, got {self.mla_absorb!r}")
        if self.v_head_dim > self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(
                f"{name}: v_head_dim ({self.v_head_dim}) must not exceed qk_nope_head_dim + qk_rope_head_dim "
                f"({self.qk_nope_head_dim + self.qk_rope_head_dim}): the attention backends take one head size, and "
                "the values are padded to the keys' size"
            )
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"{name}: qk_rope_head_dim must be even and positive, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"{name}: q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if not 0 <= self.first_k_dense_replace < self.num_layers:
            raise ValueError(
                f"{name}: first_k_dense_replace must be in 0..num_layers - 1 ({self.num_layers - 1}), got "
                f"{self.first_k_dense_replace}"
            )
        if self.n_group < 1 or self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError(
                f"{name}: n_group ({self.n_group}) must divide num_experts ({self.num_experts}) into groups of at "
                "least 2 experts"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{name}: topk_group must be in 1..n_group ({self.n_group}), got {self.topk_group}")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"{name}: num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of topk_group "
                f"({self.topk_group}) groups"
            )

    @property
    def Experts(self) -> Axis:
        """The experts axis ``experts``."""
        return Axis("experts", self.num_experts)

    def softmax_scale(self) -> float:
        """The attention logits' scale: ``1/sqrt(nope + rope)``, times YaRN's ``mscale(factor, mscale_all_dim)²``."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            scale *= _yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    def build(self, Vocab: Axis, *, key: jax.Array) -> DeepseekV3LMHeadModel:
        """Build a randomly initialized DeepSeek-V3 (see :meth:`LmConfig.build`)."""
        return DeepseekV3LMHeadModel.init(self, Vocab, key=key)

    def init_attention(self, *, key: jax.Array) -> LatentAttention:  # type: ignore[override]
        """One block's multi-head latent attention."""
        return LatentAttention.init(self, key=key)

    def init_feed_forward(self, keys: jax.Array) -> GatedMlp | MoeMlp:
        """A mixture of experts with shared experts (the dense blocks' MLP is :meth:`init_dense_feed_forward`)."""
        return SharedExpertsMoe.init(self, keys)

    def init_dense_feed_forward(self, keys: jax.Array) -> GatedMlp:
        """The SwiGLU MLP of the first ``first_k_dense_replace`` blocks."""
        return GatedMlp.init(self.Embed, self.Mlp, keys)

    def dense_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its block has the dense MLP (:meth:`init_dense_feed_forward`): the first
        ``first_k_dense_replace``."""
        return tuple(i < self.first_k_dense_replace for i in range(self.num_layers))

    def flops_per_token(self, vocab_size: int) -> float:
        """Forward FLOPs per token of the sparse model: MLA's projections and attention, ``k`` routed experts, the
        shared experts and the router in MoE blocks, dense MLPs in the first blocks, and the output projection."""
        d, h, n = self.hidden_dim, self.num_heads, self.num_layers
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = d * h * qk if self.q_lora_rank is None else self.q_lora_rank * (d + h * qk)
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (
            self.qk_nope_head_dim + self.v_head_dim
        )
        attn = 2.0 * (q + kv + h * self.v_head_dim * d) + 2.0 * self.seq_len * h * (qk + self.v_head_dim)
        k = self.first_k_dense_replace
        moe_hidden = self.moe_intermediate_dim * (self.num_experts_per_tok + self.n_shared_experts)
        mlp = k * 6.0 * d * self.intermediate_dim + (n - k) * (6.0 * d * moe_hidden + 2.0 * d * self.num_experts)
        head = lm_flops_per_token(
            hidden_dim=d,
            intermediate_dim=0,
            num_layers=0,
            num_heads=h,
            num_kv_heads=h,
            head_size=qk,
            seq_len=self.seq_len,
            vocab_size=padded_vocab_size(vocab_size, self.vocab_padding_multiple),
            glu=True,
        )
        return n * attn + mlp + head

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``DeepseekV3Config`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`)."""
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": vocab_size,
            "max_position_embeddings": self.seq_len,
            "hidden_size": self.hidden_dim,
            "intermediate_size": self.intermediate_dim,
            "moe_intermediate_size": self.moe_intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "n_shared_experts": self.n_shared_experts,
            "n_routed_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": self.routed_scaling_factor,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_interleave": self.rope_interleave,
            "hidden_act": "silu",
            "rms_norm_eps": self.layer_norm_epsilon,
            "rope_parameters": self.rope.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "num_nextn_predict_layers": 0,
        }

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> DeepseekV3Config:
        """Read a Hugging Face ``DeepseekV3Config`` dict (missing keys take transformers' defaults).

        Multi-token-prediction modules (``num_nextn_predict_layers``) are not part of the model; their weights are
        ignored.

        Raises:
            ValueError: for unsupported options (``hidden_act`` other than silu, ``attention_dropout``), naming the
                key, or a config that fails the checks of the class.
        """
        where = f"{cls.__name__}.from_hf_config"
        hf = dict(hf_config)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (expected 'silu')")
        dropout = float(hf.get("attention_dropout") or 0.0)
        if dropout:
            raise ValueError(f"{where}: attention_dropout={dropout} is not supported (expected 0.0)")
        defaults = {"hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61}
        defaults.update(num_attention_heads=128, max_position_embeddings=4096)
        hf = {**defaults, **hf}
        heads = int(hf["num_attention_heads"])
        rope = RotaryConfig.from_hf(hf)
        q_lora = hf.get("q_lora_rank", 1536)

        def get(key: str, default: Any) -> Any:
            value = hf.get(key)
            return default if value is None else value

        return cls(
            seq_len=int(hf["max_position_embeddings"]),
            hidden_dim=int(hf["hidden_size"]),
            intermediate_dim=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", heads)),
            rope=rope,
            layer_norm_epsilon=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            initializer_range=float(get("initializer_range", 0.02)),
            num_experts=int(get("n_routed_experts", get("num_local_experts", 256))),
            num_experts_per_tok=int(get("num_experts_per_tok", 8)),
            moe_intermediate_dim=int(get("moe_intermediate_size", 2048)),
            n_shared_experts=int(get("n_shared_experts", 1)),
            routed_scaling_factor=float(get("routed_scaling_factor", 2.5)),
            n_group=int(get("n_group", 8)),
            topk_group=int(get("topk_group", 4)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            first_k_dense_replace=int(get("first_k_dense_replace", 3)),
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(get("kv_lora_rank", 512)),
            qk_rope_head_dim=int(get("qk_rope_head_dim", 64)),
            qk_nope_head_dim=int(get("qk_nope_head_dim", 128)),
            v_head_dim=int(get("v_head_dim", 128)),
            rope_interleave=bool(get("rope_interleave", True)),
            attention_bias=bool(get("attention_bias", False)),
        )


def _split(x: NamedArray, axis: str, sizes: tuple[int, int], names: tuple[str, str]) -> tuple[NamedArray, NamedArray]:
    """``x`` cut along ``axis`` into its first ``sizes[0]`` and next ``sizes[1]`` entries, renamed ``names``."""
    a, b = sizes
    return x[axis, 0:a].rename({axis: names[0]}), x[axis, a : a + b].rename({axis: names[1]})


def _absorb_pays(queries: int, dims: tuple[int, int, int, int]) -> bool:
    """Whether attending in the latent space costs fewer multiply-adds than expanding the cached latents.

    Per cached token, expanding costs ``r * (nope + v)`` (``kv_b_proj``) plus ``queries * (nope + rope + v)``
    (scores and weighted sum per head); the latent form costs ``queries * (2 r + rope)``. So decoding (one query)
    absorbs, and a long prefill expands, as DeepSeek's own inference does."""
    nope, rope, v, r = dims
    return queries * (2 * r + rope) < r * (nope + v) + queries * (nope + rope + v)


def _deinterleave(x: NamedArray, axis: str) -> NamedArray:
    """``x`` with the entries of ``axis`` reordered as the even ones then the odd ones (DeepSeek's rotary pairs
    ``(0, 1), (2, 3), ...`` become the rotate-half pairs ``(i, i + n/2)``)."""
    i = x.axis_indices(axis)
    arr = x.array
    n = arr.shape[i]
    order = jnp.concatenate([jnp.arange(0, n, 2), jnp.arange(1, n, 2)])
    return NamedArray(jnp.take(arr, order, axis=i), x.axes)


class LatentAttention(ModuleWithStateDictSerialization):
    """DeepSeek's multi-head latent attention (Hugging Face ``DeepseekV3Attention``), with a latent KV cache.

    Queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` without a query rank), per head a part
    without rotary (``qk_nope``) and a rotary part (``qk_rope``). Keys and values: ``kv_a_proj_with_mqa(x)`` gives
    the latent (normalized by ``kv_a_layernorm``) and one rotary key shared by the heads; ``kv_b_proj(latent)`` gives
    each head's key part without rotary and its value. A score is ``q_nope · k_nope + q_rope · k_rope``.

    With a cache (:meth:`init_cache`) only the latent and the rotated shared key are stored (``kv_lora_rank +
    qk_rope_head_dim`` numbers per token and layer, instead of ``heads * (qk_nope + qk_rope + v)``): the
    :class:`~ponente.models.attention.KvCache` holds the latents as its ``keys`` (``(..., cache_position,
    latent)``) and the rotary keys as its ``values`` (``(..., cache_position, rope_head_size)``). A step attends in
    the latent space (``kv_b_proj`` absorbed into the query and the output) when that costs less than expanding the
    cached latents per head (decoding), and expands them otherwise (a long prefill; see :func:`_absorb_pays`).
    Without a cache the heads' keys ``[k_nope, k_rope]`` and values go through
    :func:`~ponente.models.attention.attention` (every backend, context parallelism), the values zero-padded to the
    keys' head size.

    Attributes:
        q_proj: ``Embed -> (heads, qk_head_size)`` without a query rank, else None.
        q_a_proj: ``Embed -> q_latent``, or None.
        q_a_layernorm: RMSNorm over ``q_latent``, or None.
        q_b_proj: ``q_latent -> (heads, qk_head_size)``, or None.
        kv_a_proj_with_mqa: ``Embed -> kv_a`` (the latent then the shared rotary key).
        kv_a_layernorm: RMSNorm over ``latent``.
        kv_b_proj: ``latent -> (heads, kv_b)`` (per head the key part without rotary then the value).
        o_proj: ``(heads, v_head_size) -> Embed``.
        rotary: the rotary settings of the ``qk_rope`` part (static).
        dims: ``(q/k without rotary, rotary, value, latent)`` sizes (static).
        rope_interleave: the rotary pairs are interleaved (static).
        scaling: the logits' scale (static).
    """

    q_proj: Linear | None
    q_a_proj: Linear | None
    q_a_layernorm: RmsNorm | None
    q_b_proj: Linear | None
    kv_a_proj_with_mqa: Linear
    kv_a_layernorm: RmsNorm
    kv_b_proj: Linear
    o_proj: Linear
    rotary: RotaryConfig = eqx.field(static=True)
    dims: tuple[int, int, int, int] = eqx.field(static=True)
    rope_interleave: bool = eqx.field(static=True, default=True)
    scaling: float = eqx.field(static=True, default=1.0)
    backend: str = eqx.field(static=True, default="auto")
    block_size: int = eqx.field(static=True, default=128)
    context_parallel: str = eqx.field(static=True, default="allgather")
    absorb: str = eqx.field(static=True, default="auto")

    @staticmethod
    def init(config: DeepseekV3Config, *, key: jax.Array) -> LatentAttention:
        """The layer of ``config`` (biases, if any, start at zero)."""
        kq, kqb, ka, kb, ko = jax.random.split(key, 5)
        Embed, Heads = config.Embed, config.Heads
        nope, rope, v, r = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
        QHead = (Heads, Axis("qk_head_size", nope + rope))
        bias = config.attention_bias
        q_proj = q_a = q_norm = q_b = None
        if config.q_lora_rank is None:
            q_proj = Linear.init(Embed, QHead, key=kq, use_bias=False)
        else:
            QLatent = Axis("q_latent", config.q_lora_rank)
            q_a = Linear.init(Embed, QLatent, key=kq, use_bias=bias)
            q_norm = RmsNorm.init(QLatent, eps=_LATENT_NORM_EPS, use_bias=False)
            q_b = Linear.init(QLatent, QHead, key=kqb, use_bias=False)
        Latent = Axis("latent", r)
        return LatentAttention(
            q_proj=q_proj,
            q_a_proj=q_a,
            q_a_layernorm=q_norm,
            q_b_proj=q_b,
            kv_a_proj_with_mqa=Linear.init(Embed, Axis("kv_a", r + rope), key=ka, use_bias=bias),
            kv_a_layernorm=RmsNorm.init(Latent, eps=_LATENT_NORM_EPS, use_bias=False),
            kv_b_proj=Linear.init(Latent, (Heads, Axis("kv_b", nope + v)), key=kb, use_bias=False),
            o_proj=Linear.init((Heads, Axis("v_head_size", v)), Embed, key=ko, use_bias=bias),
            rotary=config.rope,
            dims=(nope, rope, v, r),
            rope_interleave=config.rope_interleave,
            scaling=config.softmax_scale(),
            backend=config.attn_backend,
            block_size=config.flash_attention_block_size,
            context_parallel=config.attention_context_parallel,
            absorb=config.mla_absorb,
        )

    def _rotate(self, x: NamedArray, Pos: Axis, pos_ids: NamedArray | None) -> NamedArray:
        if self.rope_interleave:
            x = _deinterleave(x, "rope_head_size")
        return apply_rotary(x, Pos, x.resolve_axis("rope_head_size"), self.rotary, pos_ids)

    def self_attend(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        *,
        pos_ids: NamedArray | None,
        cache: KvCache | None,
    ) -> tuple[NamedArray, KvCache | None]:
        """Attention of ``x`` (``(..., position, embed)``) over its positions, or over ``cache`` after writing the
        tokens' latents and rotary keys at the slots ``pos_ids`` (see the class docstring)."""
        nope, rope, v, r = self.dims
        Pos = x.resolve_axis("position")
        if self.q_proj is not None:
            q = self.q_proj(x)
        elif self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            raise ValueError("LatentAttention: needs q_proj, or q_a_proj, q_a_layernorm and q_b_proj")
        q_nope, q_rope = _split(q, "qk_head_size", (nope, rope), ("nope_head_size", "rope_head_size"))
        latent, k_rope = _split(self.kv_a_proj_with_mqa(x), "kv_a", (r, rope), ("latent", "rope_head_size"))
        latent = self.kv_a_layernorm(latent)
        q_rope = self._rotate(q_rope, Pos, pos_ids)
        k_rope = self._rotate(k_rope, Pos, pos_ids)
        if cache is None:
            out = self._expanded_attention(Pos, q_nope, q_rope, latent, k_rope, mask)
            return tag(self.o_proj(out), "attn_out"), cache
        if pos_ids is None:
            raise ValueError("LatentAttention: decoding with a cache needs pos_ids (the tokens' cache slots)")
        cache = cache.update(latent, k_rope, pos_ids)
        KPos = cache.CachePos
        latent, k_rope = cache.layer_keys, cache.layer_values
        allowed = cache.attention_mask(pos_ids)
        w_kv = self._absorbable_kv_b()
        absorb = self.absorb == "always" or (self.absorb == "auto" and _absorb_pays(Pos.size, self.dims))
        if w_kv is not None and absorb:
            # attention in the latent space: kv_b_proj's key part goes into the query, its value part after the
            # weighted sum, so the cached latents are never expanded per head
            w_k, w_v = _split(w_kv, "kv_b", (nope, v), ("nope_head_size", "v_head_size"))
            q_latent = hax.dot(q_nope, w_k, axis="nope_head_size")
            scores = hax.dot(q_latent, latent, axis="latent") + hax.dot(q_rope, k_rope, axis="rope_head_size")
            weights = self._softmax(scores, allowed, KPos).astype(latent.dtype)
            out = hax.dot(hax.dot(weights, latent, axis=KPos.name), w_v, axis="latent")
        else:
            k_nope, values = _split(self.kv_b_proj(latent), "kv_b", (nope, v), ("nope_head_size", "v_head_size"))
            scores = hax.dot(q_nope, k_nope, axis="nope_head_size") + hax.dot(q_rope, k_rope, axis="rope_head_size")
            weights = self._softmax(scores, allowed, KPos).astype(values.dtype)
            out = hax.dot(weights, values, axis=KPos.name)
        return tag(self.o_proj(out), "attn_out"), cache

    def _softmax(self, scores: NamedArray, allowed: NamedArray | None, KPos: Axis) -> NamedArray:
        scores = scores.astype(jnp.float32) * self.scaling
        if allowed is not None:
            scores = hax.where(allowed, scores, jnp.finfo(jnp.float32).min)
        return hax.nn.softmax(scores, KPos.name)

    def _expanded_attention(
        self,
        Pos: Axis,
        q_nope: NamedArray,
        q_rope: NamedArray,
        latent: NamedArray,
        k_rope: NamedArray,
        mask: AttentionMask | NamedArray | None,
    ) -> NamedArray:
        """Attention without a cache: per head, the key is ``[kv_b_proj's key part, the shared rotary key]`` and
        the query ``[q_nope, q_rope]``, through :func:`~ponente.models.attention.attention` (so every backend, the
        blockwise kernel and context parallelism apply); values narrower than the keys are padded with zeros to the
        key's size (the backends take one head size) and cut back after."""
        nope, rope, v, _ = self.dims
        k_nope, values = _split(self.kv_b_proj(latent), "kv_b", (nope, v), ("nope_head_size", "v_head_size"))
        QK = Axis("qk_head_size", nope + rope)
        query = hax.concatenate(
            QK.name, [q_nope.rename({"nope_head_size": QK.name}), q_rope.rename({"rope_head_size": QK.name})]
        )
        per_head = tuple(ax for ax in k_nope.axes if ax.name != "nope_head_size")
        k_rope = hax.broadcast_to(k_rope, (*per_head, k_rope.resolve_axis("rope_head_size")))
        key = hax.concatenate(
            QK.name, [k_nope.rename({"nope_head_size": QK.name}), k_rope.rename({"rope_head_size": QK.name})]
        )
        value = values.rename({"v_head_size": QK.name})
        if v < nope + rope:  # the config checks that v is not larger
            value = hax.pad(value, {QK.name: (0, nope + rope - v)})
        out = attention(
            Pos,
            QK,
            query,
            key,
            value,
            mask,
            scaling_factor=self.scaling,
            backend=self.backend,
            block_size=self.block_size,
            context_parallel=self.context_parallel,
        )
        return out[QK.name, 0:v].rename({QK.name: "v_head_size"})

    def _absorbable_kv_b(self) -> NamedArray | None:
        """``kv_b_proj``'s weight (axes ``latent``, heads, ``kv_b``) when the layer is a plain product that can be
        absorbed into the query and the output (no bias, no quantized or adapted product); else None."""
        layer = self.kv_b_proj
        if type(layer) is not Linear or layer.bias is not None or type(layer.dot_general) is not DefaultDotGeneralOp:
            return None
        scale = layer.reparam.active_scale
        return layer.weight if scale == 1 else layer.weight * scale

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Attend over the ``position`` axis of ``x`` (``(..., position, embed)``)."""
        del key
        return self.self_attend(x, mask, pos_ids=pos_ids, cache=None)[0]


def route_grouped_sigmoid(
    router_logits: NamedArray,
    correction_bias: NamedArray | None,
    Experts: Axis,
    k: int,
    *,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> RouterOutput:
    """DeepSeek-V3's routing: sigmoid scores; the experts chosen by ``score + correction_bias`` among the
    ``topk_group`` groups (of ``n_group`` equal groups) whose two best biased scores sum highest; weights the chosen
    experts' scores (renormalized if ``normalize``) times ``scaling``. Computed in float32.

    Args:
        router_logits: ``(..., Experts)``.
        correction_bias: ``(Experts,)`` added for the choice only (``e_score_correction_bias``), or None.
        Experts: the experts axis.
        k: experts per token.
        n_group: the groups.
        topk_group: groups a token may choose from.
        normalize: renormalize the chosen scores to sum to 1 (``norm_topk_prob``).
        scaling: multiplies the weights (``routed_scaling_factor``).

    Returns:
        ``probs`` (the sigmoid scores), the chosen experts and their weights (axis ``top_k``).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> E = hax.Axis("experts", 4)
        >>> logits = hax.named(jnp.array([2.0, 1.0, 3.0, -1.0]), "experts")
        >>> r = route_grouped_sigmoid(logits, None, E, 1, n_group=2, topk_group=1, normalize=True, scaling=2.0)
        >>> r.indices.array.tolist(), r.weights.array.tolist()
        ([0], [2.0])
    """
    others = tuple(ax for ax in router_logits.axes if ax.name != Experts.name)
    scores = jax.nn.sigmoid(router_logits.rearrange((*others, Experts)).array.astype(jnp.float32))
    choice = scores if correction_bias is None else scores + correction_bias.array.astype(jnp.float32)
    grouped = choice.reshape(*choice.shape[:-1], n_group, Experts.size // n_group)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
    best_groups = jax.lax.top_k(group_scores, topk_group)[1]
    keep = jax.nn.one_hot(best_groups, n_group, dtype=jnp.bool_).any(-2)
    keep = jnp.broadcast_to(keep[..., None], grouped.shape).reshape(choice.shape)
    indices = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), k)[1]
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    TopK = Axis(TOP_K, k)
    return RouterOutput(
        probs=NamedArray(scores, (*others, Experts)),
        weights=NamedArray(weights * scaling, (*others, TopK)),
        indices=NamedArray(indices, (*others, TopK)),
    )


class SharedExpertsMoe(MoeMlp):
    """DeepSeek-V3's MoE block (Hugging Face ``DeepseekV3MoE``): :class:`~ponente.models.moe.MoeMlp`'s experts and
    dispatch, routed by :func:`route_grouped_sigmoid`, plus shared experts every token goes through.

    Attributes:
        e_score_correction_bias: ``(experts,)``, added to the scores when choosing (key
            ``gate.e_score_correction_bias``; a buffer in transformers, not trained by gradient; with the config's
            ``router_bias_update_rate`` the trainer moves it against the experts' loads after each step).
        shared_experts: the shared SwiGLU (``n_shared_experts * moe_intermediate_size``).
        n_group: expert groups (static).
        topk_group: groups a token chooses from (static).
        routed_scaling_factor: multiplies the routed weights (static).
    """

    e_score_correction_bias: NamedArray | None = None
    shared_experts: GatedMlp | None = None
    n_group: int = eqx.field(static=True, default=1)
    topk_group: int = eqx.field(static=True, default=1)
    routed_scaling_factor: float = eqx.field(static=True, default=1.0)

    balance_bias_field: ClassVar[str] = "e_score_correction_bias"
    """The correction bias is the balancing bias that ``router_bias_update_rate`` moves."""

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {**super()._state_dict_key_map(), "e_score_correction_bias": "gate.e_score_correction_bias"}

    @staticmethod
    def init(config: DeepseekV3Config, keys: jax.Array) -> SharedExpertsMoe:  # type: ignore[override]
        """The block of ``config`` from three PRNG keys (zero correction bias)."""
        base = MoeMlp.init(
            config.Embed,
            Axis("mlp", config.moe_intermediate_dim),
            config.Experts,
            config.num_experts_per_tok,
            key=keys[0],
            dispatch=config.moe_dispatch,
            norm_topk_prob=config.norm_topk_prob,
        )
        Shared = Axis("mlp", config.moe_intermediate_dim * config.n_shared_experts)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(MoeMlp)}
        return SharedExpertsMoe(
            **fields,
            e_score_correction_bias=hax.zeros(config.Experts),
            shared_experts=GatedMlp.init(config.Embed, Shared, jax.random.split(keys[1], 3)),
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
        )

    def route(self, x: NamedArray) -> RouterOutput:
        """The routing decision for ``x`` ``(..., embed)`` (:func:`route_grouped_sigmoid`; router in float32)."""
        logits = hax.dot(x.astype(jnp.float32), self.router.weight.astype(jnp.float32), axis="embed")
        return route_grouped_sigmoid(
            logits,
            self.e_score_correction_bias,
            self.Experts,
            self.num_experts_per_tok,
            n_group=self.n_group,
            topk_group=self.topk_group,
            normalize=self.norm_topk_prob,
            scaling=self.routed_scaling_factor,
        )

    def __call__(self, x: NamedArray) -> tuple[NamedArray, RouterOutput]:
        """The routed experts' output plus the shared experts', and the routing."""
        out, routing = super().__call__(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, routing


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_OURS_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(w[123])$")
_HF_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")


class DeepseekV3LMHeadModel(LlamaLMHeadModel):
    """DeepSeek-V3: the shared decoder's blocks with :class:`LatentAttention`; the first ``first_k_dense_replace``
    blocks with a dense SwiGLU, the others with :class:`SharedExpertsMoe`: the shared decoder's two stacks
    (``config.dense_layers()``), run one after the other, both reading and writing one KV cache over every layer.

    Hugging Face names: ``model.layers.L.{input_layernorm, post_attention_layernorm}``, ``self_attn.{q_proj |
    q_a_proj, q_a_layernorm, q_b_proj}``, ``self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``;
    dense blocks ``mlp.{gate,up,down}_proj``; MoE blocks ``mlp.gate.{weight, e_score_correction_bias}``,
    ``mlp.shared_experts.{gate,up,down}_proj`` and the experts per expert (``mlp.experts.{e}.gate_proj.weight``,
    as in checkpoint files; transformers 5's fused in-memory ``mlp.experts.gate_up_proj`` is read too). No
    load-balancing loss: DeepSeek-V3 balances with the correction bias (``router_bias_update_rate``); the forward
    pass yields the ``router/*`` diagnostics and the expert loads the trainer's bias update reads.
    """

    transformer: DecoderStack

    def _router_aux(self, routing: RouterOutput) -> dict[str, NamedArray]:
        """No load-balancing loss (DeepSeek-V3 balances with the correction bias); the ``router/*`` diagnostics, with
        ``load_balancing_loss`` computed on the sigmoid scores normalized to sum to 1 per token (the paper's
        sequence-wise balance formula, over the whole batch, unweighted) and no z-loss (the router has no softmax)."""
        normalized = hax.sum(routing.probs, self.config.Experts)
        return super()._router_aux(dataclasses.replace(routing, probs=routing.probs / normalized))

    def init_cache(self, Batch: Axis, max_len: int, *, dtype: Any = None) -> KvCache:
        """An empty latent cache: ``keys`` ``(layers, batch, cache_position, latent)`` (the normalized latents),
        ``values`` ``(layers, batch, cache_position, rope_head_size)`` (the rotated shared keys).

        Raises:
            ValueError: if ``max_len`` is below 1.
        """
        if max_len < 1:
            raise ValueError(f"DeepseekV3LMHeadModel.init_cache: max_len must be >= 1, got {max_len}")
        config = self.config
        dtype = self.transformer.embed_tokens.weight.dtype if dtype is None else dtype
        lead = (config.Layers, Batch, Axis(CACHE_POSITION, max_len))
        latent = hax.zeros((*lead, Axis("latent", config.kv_lora_rank)), dtype=dtype)
        rope = hax.zeros((*lead, Axis("rope_head_size", config.qk_rope_head_dim)), dtype=dtype)
        return KvCache(latent, rope)

    def to_hf_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under their Hugging Face names (see the class docstring), experts one by one.

        Returns:
            The state dict that ``transformers`` loads from a checkpoint file.
        """
        names = {v: n for n, v in _HF_PROJ.items()}
        out: dict[str, np.ndarray] = {}
        for key, value in super().to_hf_state_dict().items():
            key = key.replace(".block_sparse_moe.", ".mlp.")
            if (e := _OURS_EXPERTS.match(key)) is not None:
                for i in range(value.shape[0]):
                    out[f"{e[1]}.mlp.experts.{i}.{names[e[2]]}.weight"] = value[i]
            else:
                out[key] = value
        return out

    def from_hf_state_dict(self, state_dict: Mapping[str, Any]) -> Self:
        """A copy of this (template) model with parameters read from a Hugging Face DeepSeek-V3 state dict (either
        expert layout; layers beyond ``num_hidden_layers``, the multi-token-prediction modules, are ignored).

        Raises:
            KeyError: if a parameter (or one expert of a block) is missing.
            ValueError: if a parameter has the wrong shape.
        """
        k, n = self.config.first_k_dense_replace, self.config.num_layers
        out: dict[str, Any] = {}
        per_expert: dict[str, dict[int, Any]] = {}
        for key, value in state_dict.items():
            m = _HF_LAYER.match(key)
            if m is not None and int(m[1]) >= n:
                continue
            if m is None or int(m[1]) < k or not m[2].startswith("mlp."):
                out[key] = value  # the decoder sends model.layers.L to the stack of its kind
                continue
            moe, rest = f"model.layers.{m[1]}.block_sparse_moe", m[2]
            if e := _PER_EXPERT.match(rest):
                per_expert.setdefault(f"{moe}.experts.{_HF_PROJ[e[2]]}", {})[int(e[1])] = value
            elif f := _FUSED.match(rest):
                array = np.asarray(value)
                if f[1] == "down_proj":
                    out[f"{moe}.experts.w2"] = array
                else:
                    half = array.shape[1] // 2
                    out[f"{moe}.experts.w1"], out[f"{moe}.experts.w3"] = array[:, :half], array[:, half:]
            else:
                out[f"{moe}.{rest[len('mlp.') :]}"] = value
        names = {v: n for n, v in _HF_PROJ.items()}
        for key, experts in per_expert.items():
            missing = [e for e in range(self.config.num_experts) if e not in experts]
            if missing:
                layer, proj = key.split(".block_sparse_moe.experts.")
                raise KeyError(
                    f"DeepSeek-V3 state dict: {layer}.mlp.experts.{missing[0]}.{names[proj]}.weight is missing"
                )
            out[key] = np.stack([np.asarray(experts[e]) for e in range(len(experts))])
        return super().from_hf_state_dict(out)
