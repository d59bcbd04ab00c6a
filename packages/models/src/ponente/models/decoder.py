"""The decoder shared by the decoder-only families: one stack, one block, one forward with an optional KV cache.

A model is token embedding → ``Stacked`` blocks (scanned) → final norm → output projection. Each block is
self-attention then a feed-forward network, both residual; the family's config chooses the parts:

- **norm** (``config.init_norm``): :class:`~ponente.namedtensor.nn.RmsNorm` (scale ``w``) or :class:`GemmaRmsNorm`
  (scale ``1 + w``, in float32);
- **norm placement** (``config.norm_placement``): ``"pre"`` (Llama: ``x + attn(norm(x))``, ``x + mlp(norm(x))``),
  ``"post"`` (OLMo 2: ``x + norm(attn(x))``, ``x + norm(mlp(x))``) or ``"sandwich"`` (Gemma 2/3:
  ``x + norm(attn(norm(x)))``, ``x + norm(mlp(norm(x)))``);
- **attention** (``config.init_attention``): grouped-query :class:`~ponente.models.attention.Attention`, with biases
  or not, or :class:`QkNormAttention` (RMS-normalized queries and keys, per head or over all heads; optionally its
  own rotary for sliding layers, a logit scale and a logit soft cap), or :class:`FusedQkvAttention` (one fused
  query/key/value projection with biases and no rotary: GPT-2);
- **sliding windows** (``config.sliding_layers()``, ``config.attention_windows()``): per layer whether it slides,
  and the window; a stack mixing both kinds stays one scan and picks the mask (and rotary) per layer
  (:func:`~ponente.models._layer_types.select_by_kind`);
- **feed-forward** (``config.init_feed_forward``): a gated :class:`GatedMlp` (SwiGLU or GeGLU; state-dict key
  ``mlp``), a plain two-layer :class:`Mlp` (GPT-2) or a mixture of experts (:class:`~ponente.models.moe.MoeMlp`,
  key ``block_sparse_moe``), whose routing the stack returns for the load-balancing loss (weighted by
  ``config.router_aux_loss_coef``). A config with a ``dense_layers()`` method (per layer, whether its block has
  the dense MLP of ``config.init_dense_feed_forward`` instead) mixes dense and MoE blocks (Qwen3-MoE's
  ``mlp_only_layers``): each kind is a stack of its own, and the forward pass scans the runs of consecutive blocks of
  one kind in layer order (:mod:`ponente.models._layer_runs`).

A model class may change the embeddings (:meth:`DecoderLM._embed`: Gemma scales them, GPT-2 adds learned position
embeddings) or the logits after the output projection (:meth:`DecoderLM._project_out`, as Gemma does). A family
whose parameters have other names (GPT-2) keeps its own stack and block classes, which expose the decoder's parts
(:class:`DecoderStackParts`) and call the one block forward, :func:`block_forward`.

The training forward and cached decoding are the same code: :meth:`DecoderLM.decode` runs the stack with a
:class:`~ponente.models.kv_cache.KvCache` as part of the scan's carry, and each block's attention writes its keys
and values there and attends over them instead of over the sequence.

A new family whose blocks are made of these parts is its config (a :class:`~ponente.models.LlamaConfig`
subclass overriding the hooks, or any config providing :class:`DecoderConfig`) and its Hugging Face names (see the
docs' "How to add a family").
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Protocol, Self, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Embedding, LayerNorm, Linear, RmsNorm, Stacked
from ponente.namedtensor.state_dict import ModuleWithStateDictSerialization

from ._layer_runs import (
    DENSE_LAYERS,
    concat_routing,
    from_hf_layers,
    layer_runs,
    slice_layers,
    slice_stack,
    to_hf_layers,
)
from ._layer_types import select_by_kind, with_sliding_window
from .attention import Attention, AttentionMask, attention, decode_attention
from .attention.kv_cache import KvCache, take_positions
from .config import _real_vocab_rows, mask_padded_vocab
from .lm import LmHeadModel
from .moe import MoeMlp, RouterOutput, balancing_bias, expert_load, router_group_metrics, router_metrics
from .remat import tag
from .rotary import RotaryConfig, apply_rotary

__all__ = [
    "EXPERT_LOAD",
    "ROUTER_AUX_LOSS",
    "Activation",
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLM",
    "DecoderStack",
    "DecoderStackParts",
    "FusedQkvAttention",
    "GatedMlp",
    "GemmaRmsNorm",
    "Mlp",
    "Norm",
    "NormPlacement",
    "QkNormAttention",
    "SelfAttentionLayer",
    "block_forward",
    "grouped_attention",
    "init_blocks",
    "init_embedding",
]

NormPlacement = Literal["pre", "post", "sandwich"]
"""Where a block's RMSNorms sit: on the sub-layers' inputs (``"pre"``), on their outputs (``"post"``) or both."""

Activation = Literal["silu", "gelu", "gelu_tanh"]
"""The activation of a :class:`GatedMlp`'s gate: SiLU (SwiGLU), exact GELU, or its tanh approximation (GeGLU)."""

ROUTER_AUX_LOSS = "router_aux_loss"
"""The name of a mixture of experts' load-balancing term among the auxiliary losses."""

EXPERT_LOAD = "router/expert_load"
"""The auxiliary entry of the assignments per layer and expert, ``(layers, experts)``, present when the MoE layers have
a balancing bias (``router_bias_update_rate > 0``): what :func:`~ponente.models.moe.update_balance_bias` reads."""


def grouped_attention(config: Any, rotary: Any, *, key: jax.Array, use_bias: bool = False) -> Attention:
    """A block's grouped-query attention: the config's axes (``Embed``, ``KVHeads``, ``QHeadsPerGroup``,
    ``HeadSize``), attention backend, tile size and context-parallel mode, with the rotary embedding ``rotary``, and
    biases on the projections if ``use_bias``. Every family's grouped-query attention is built here, so a config key
    of the attention reaches all of them."""
    return Attention.init(
        config.Embed,
        config.KVHeads,
        config.QHeadsPerGroup,
        config.HeadSize,
        use_bias=use_bias,
        rotary=rotary,
        key=key,
        backend=config.attn_backend,
        block_size=config.flash_attention_block_size,
        context_parallel=config.attention_context_parallel,
    )


class GemmaRmsNorm(eqx.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x²) + eps) * (1 + weight)``, computed in float32, returned in ``x``'s dtype.

    Attributes:
        weight: the learned offset of the scale (zeros: the identity scale).
        axis: the normalized axis.
        eps: added to the mean square.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> norm = GemmaRmsNorm.init(hax.Axis("embed", 2), eps=0.0)
        >>> tuple(round(v, 4) for v in norm(hax.named(jnp.array([3.0, 4.0]), "embed")).array.tolist())
        (0.8485, 1.1314)
    """

    weight: NamedArray
    axis: Axis = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-6)

    @staticmethod
    def init(axis: Axis, *, eps: float) -> GemmaRmsNorm:
        """A norm over ``axis`` with zero weight (unit scale).

        Args:
            axis: the normalized axis.
            eps: added to the mean square.

        Returns:
            The layer.
        """
        return GemmaRmsNorm(hax.zeros(axis), axis, eps)

    def __call__(self, x: NamedArray) -> NamedArray:
        """Normalize ``x`` over ``axis`` (other axes are batch axes)."""
        xf = x.astype(jnp.float32)
        inv_rms = 1.0 / hax.sqrt(hax.mean(xf * xf, axis=self.axis.name) + self.eps)
        return (xf * inv_rms * (1.0 + self.weight.astype(jnp.float32))).astype(x.dtype)


Norm = RmsNorm | GemmaRmsNorm | LayerNorm
"""A block's normalization layer (``config.init_norm`` chooses; GPT-2: LayerNorm with a bias)."""


@runtime_checkable
class SelfAttentionLayer(Protocol):
    """A block's attention that computes itself, cache included (DeepSeek's multi-head latent attention): the block
    calls :meth:`self_attend` instead of the grouped-query path of :func:`self_attention`."""

    def self_attend(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        *,
        pos_ids: NamedArray | None,
        cache: KvCache | None,
    ) -> tuple[NamedArray, KvCache | None]:
        """Attention of ``x`` (``(..., position, embed)``) over its positions, or (writing to it first) over
        ``cache``; returns ``(the output after the output projection, the updated cache or None)``."""
        ...


class DecoderConfig(Protocol):
    """What the decoder reads of a family's config (every :class:`~ponente.models.LlamaConfig` provides it)."""

    norm_placement: ClassVar[NormPlacement]
    feed_forward_keys: ClassVar[int]

    @property
    def layer_norm_epsilon(self) -> float: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def initializer_range(self) -> float: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def Embed(self) -> Axis: ...
    @property
    def Layers(self) -> Axis: ...
    @property
    def KVHeads(self) -> Axis: ...
    @property
    def HeadSize(self) -> Axis: ...
    @property
    def layer_unroll(self) -> bool | None: ...
    @property
    def gradient_checkpointing(self) -> Any: ...

    def padded_vocab(self, Vocab: Axis) -> Axis: ...
    def attention_windows(self) -> tuple[int | None, ...]: ...
    def sliding_layers(self) -> tuple[bool, ...]: ...
    def init_norm(self, axis: Axis) -> Norm: ...
    def init_attention(
        self, *, key: jax.Array
    ) -> Attention | QkNormAttention | FusedQkvAttention | SelfAttentionLayer: ...
    def init_feed_forward(self, keys: jax.Array) -> GatedMlp | Mlp | MoeMlp: ...


def _dropout(x: NamedArray, pdrop: float, key: jax.Array | None) -> NamedArray:
    """Dropout when a key is given and ``pdrop > 0``, else the identity."""
    if key is None or pdrop == 0.0:
        return x
    return hax.nn.dropout(x, pdrop, inference=False, key=key)


class GatedMlp(eqx.Module):
    """A gated MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``; SwiGLU with ``silu``, GeGLU with a GELU.

    Attributes:
        gate_proj: ``Embed -> Mlp``.
        up_proj: ``Embed -> Mlp``.
        down_proj: ``Mlp -> Embed``.
        activation: ``"silu"`` (the default), ``"gelu"`` (exact) or ``"gelu_tanh"`` (tanh approximation) (static).
    """

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    activation: Activation = eqx.field(static=True, default="silu")

    @staticmethod
    def init(Embed: Axis, Mlp: Axis, keys: jax.Array, activation: Activation = "silu") -> GatedMlp:
        """Create the three projections (without biases) from three PRNG keys (gate, up, down)."""
        k_gate, k_up, k_down = keys
        return GatedMlp(
            Linear.init(Embed, Mlp, key=k_gate, use_bias=False),
            Linear.init(Embed, Mlp, key=k_up, use_bias=False),
            Linear.init(Mlp, Embed, key=k_down, use_bias=False),
            activation=activation,
        )

    def __call__(self, x: NamedArray) -> NamedArray:
        """Apply the MLP to ``(..., embed)``."""
        gate, up = tag((self.gate_proj(x), self.up_proj(x)), "mlp_in")
        if self.activation == "silu":
            act = hax.nn.silu(gate)
        else:
            act = hax.nn.gelu(gate, approximate=self.activation == "gelu_tanh")
        return tag(self.down_proj(act * up), "mlp_out")


class Mlp(eqx.Module):
    """A plain two-layer MLP with biases: ``c_proj(act(c_fc(x)))`` (GPT-2's, and its state-dict names).

    Attributes:
        c_fc: ``Embed -> Mlp``, with a bias.
        c_proj: ``Mlp -> Embed``, with a bias.
        activation: ``"gelu_tanh"`` (the default: GPT-2's ``gelu_new``), ``"gelu"`` (exact) or ``"silu"`` (static).
    """

    c_fc: Linear
    c_proj: Linear
    activation: Activation = eqx.field(static=True, default="gelu_tanh")

    @staticmethod
    def init(Embed: Axis, Hidden: Axis, keys: jax.Array, activation: Activation = "gelu_tanh") -> Mlp:
        """Create the two projections (with biases, ``Embed -> Hidden -> Embed``) from two PRNG keys."""
        k_fc, k_proj = keys
        return Mlp(Linear.init(Embed, Hidden, key=k_fc), Linear.init(Hidden, Embed, key=k_proj), activation=activation)

    def __call__(self, x: NamedArray) -> NamedArray:
        """Apply the MLP to ``(..., embed)``."""
        h = tag(self.c_fc(x), "mlp_in")
        act = hax.nn.silu(h) if self.activation == "silu" else hax.nn.gelu(h, approximate=self.activation != "gelu")
        return tag(self.c_proj(act), "mlp_out")


class FusedQkvAttention(eqx.Module):
    """Multi-head attention with one fused query/key/value projection and biases, without rotary (GPT-2's).

    Called through :func:`self_attention`, which also runs it over a KV cache. A family may subclass it to change
    the queries (:meth:`project`), the attention without a cache (:meth:`attend`), the backend of a prefill
    (:meth:`decode_backend`) or the output (:meth:`output`), e.g. for dropout.

    Attributes:
        c_attn: ``Embed -> (qkv, Heads, HeadSize)`` with a bias (``qkv`` of size 3: queries, keys, values).
        c_proj: ``(Heads, HeadSize) -> Embed`` with a bias.
        scaling: multiplies the attention logits (None: ``1 / sqrt(head_size)``) (static).
        backend: the attention backend (see :func:`~ponente.models.attention.attention`) (static).
        block_size: the flash-attention tile size over positions (static).
        context_parallel: the attention under context parallelism, ``"allgather"`` or ``"ring"`` (static).
    """

    c_attn: Linear
    c_proj: Linear
    scaling: float | None = eqx.field(static=True, default=None)
    backend: str = eqx.field(static=True, default="auto")
    block_size: int = eqx.field(static=True, default=128)
    context_parallel: str = eqx.field(static=True, default="allgather")

    @staticmethod
    def init_projections(Embed: Axis, Heads: Axis, HeadSize: Axis, *, key: jax.Array) -> tuple[Linear, Linear]:
        """``(c_attn, c_proj)``, with biases, from one PRNG key (split in two)."""
        k_attn, k_proj = jax.random.split(key)
        Qkv = Axis("qkv", 3)
        return Linear.init(Embed, (Qkv, Heads, HeadSize), key=k_attn), Linear.init(
            (Heads, HeadSize), Embed, key=k_proj
        )

    def project(self, x: NamedArray, layer: NamedArray | None) -> _Qkv:
        """The queries, keys and values of ``x`` (``layer``: this block's index in the stack, or None)."""
        del layer
        qkv = self.c_attn(x)
        return qkv["qkv", 0], qkv["qkv", 1], qkv["qkv", 2]

    def attend(
        self,
        Pos: Axis,
        q: NamedArray,
        k: NamedArray,
        v: NamedArray,
        mask: AttentionMask | NamedArray | None,
        *,
        key: jax.Array | None,
    ) -> NamedArray:
        """Attention over the positions, without a cache (``key``: for dropout in a subclass)."""
        del key
        HeadSize = q.resolve_axis("head_size")
        return attention(
            Pos,
            HeadSize,
            q,
            k,
            v,
            mask,
            scaling_factor=self.scaling,
            backend=self.backend,
            block_size=self.block_size,
            context_parallel=self.context_parallel,
        )

    def decode_backend(self) -> str:
        """The attention backend of a prefill over the cache."""
        return self.backend

    def output(self, out: NamedArray, *, key: jax.Array | None) -> NamedArray:
        """The output projection of the attended values (``key``: for dropout in a subclass)."""
        del key
        return tag(self.c_proj(out), "attn_out")


class QkNormAttention(ModuleWithStateDictSerialization):
    """Grouped-query attention with an optional QK-norm, the attention settings of the Gemma family and optional
    attention sinks (gpt-oss).

    Reuses :class:`~ponente.models.attention.Attention`'s projections, rotary settings and backend. The norms are
    the QK-norm of Qwen3 (one learned scale over ``head_size`` shared by all heads), of OLMo 2 (a scale over all
    head axes) or of Gemma 3 (a ``(1 + w)`` scale over ``head_size``), applied before the rotary embedding; Gemma 1/2
    have none. Its state-dict keys are ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm`` and ``k_norm`` (as
    Hugging Face's), plus ``sinks`` when the layer has them. Called through :func:`self_attention`.

    With ``local_rotary`` (the Gemma family) the layer holds both kinds of layer: it projects (and normalizes) the
    queries, keys and values once and then picks the rotary, mask and window of a sliding or a full layer;
    without it the block picks between two whole calls of the layer. The two orders round differently (by about
    1e-6), and each family keeps the one it was validated with.

    Attributes:
        attn: the projections, rotary settings (of full-attention layers) and backend.
        q_norm: the query norm, or None.
        k_norm: the key norm, or None.
        local_rotary: the rotary settings of sliding layers (Gemma 3: another base), or None: ``attn.rotary``, and
            the choice between sliding and full attention is made around the whole layer (static).
        scaling: multiplies the attention logits (None: ``1 / sqrt(head_size)``) (static).
        soft_cap: caps the attention logits with ``cap * tanh(logits / cap)`` (None: no cap; only the backends that
            support it, see :mod:`ponente.models.attention.backends`) (static).
        sinks: one learned logit per query head (axis ``heads``, Hugging Face's head order), added to the softmax's
            denominator (gpt-oss; the ``reference`` and ``flash`` backends and the KV cache compute it), or None.
    """

    attn: Attention
    q_norm: Norm | None
    k_norm: Norm | None
    sinks: NamedArray | None = None
    local_rotary: RotaryConfig | None = eqx.field(static=True, default=None)
    scaling: float | None = eqx.field(static=True, default=None)
    soft_cap: float | None = eqx.field(static=True, default=None)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"attn": None}

    @staticmethod
    def init(attn: Attention, *, eps: float) -> QkNormAttention:
        """Add a per-head QK-norm (unit scales over ``head_size``) to ``attn``.

        Args:
            attn: the attention layer.
            eps: the norms' epsilon.

        Returns:
            The layer.
        """
        HeadSize = attn.o_proj.weight.resolve_axis("head_size")
        return QkNormAttention(
            attn=attn,
            q_norm=RmsNorm.init(HeadSize, eps=eps, use_bias=False),
            k_norm=RmsNorm.init(HeadSize, eps=eps, use_bias=False),
        )

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Attend over the ``position`` axis of ``x`` (``(..., position, embed)``) as a full-attention layer."""
        del key
        return self_attention(self, x, mask, pos_ids=pos_ids)[0]


_Qkv = tuple[NamedArray, NamedArray, NamedArray]

AttentionLayer = Attention | QkNormAttention | FusedQkvAttention | SelfAttentionLayer
"""A block's attention (``config.init_attention`` chooses)."""


def _project(layer: Attention | QkNormAttention, x: NamedArray) -> _Qkv:
    """The queries, keys and values of ``x`` (QK-normalized if the layer has the norms)."""
    a = layer.attn if isinstance(layer, QkNormAttention) else layer
    q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
    if isinstance(layer, QkNormAttention) and layer.q_norm is not None and layer.k_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    return q, k, v


def _attend(
    layer: Attention | QkNormAttention,
    qkv: _Qkv,
    Pos: Axis,
    rotary: RotaryConfig | None,
    mask: AttentionMask | NamedArray | None,
    window: int | None,
    pos_ids: NamedArray | None,
    cache: KvCache | None,
) -> tuple[NamedArray, KvCache | None]:
    """Rotate ``qkv``'s queries and keys, then attend over the positions or (writing to it first) over ``cache``.

    Returns:
        ``(the attention's output before ``o_proj``, the updated cache or None)``.
    """
    a = layer.attn if isinstance(layer, QkNormAttention) else layer
    scaling, soft_cap = (layer.scaling, layer.soft_cap) if isinstance(layer, QkNormAttention) else (None, None)
    q, k, v = qkv
    HeadSize = a.o_proj.weight.resolve_axis("head_size")
    sinks = _head_sinks(layer, q)
    if rotary is not None:
        q = apply_rotary(q, Pos, HeadSize, rotary, pos_ids)
        k = apply_rotary(k, Pos, HeadSize, rotary, pos_ids)
    if cache is None:
        out = attention(
            Pos,
            HeadSize,
            q,
            k,
            v,
            mask,
            scaling_factor=scaling,
            backend=a.backend,
            block_size=a.block_size,
            logit_soft_cap=soft_cap,
            sinks=sinks,
            context_parallel=a.context_parallel,
        )
        return out, None
    if pos_ids is None:
        raise ValueError("self_attention: decoding with a cache needs pos_ids (the tokens' cache slots)")
    cache = cache.update(k, v, pos_ids)
    out = decode_attention(
        HeadSize,
        q,
        cache,
        pos_ids,
        window=window,
        scaling_factor=scaling,
        logit_soft_cap=soft_cap,
        backend=a.backend,
        block_size=a.block_size,
        sinks=sinks,
    )
    return out, cache


def _head_sinks(layer: Attention | QkNormAttention, q: NamedArray) -> NamedArray | None:
    """The layer's sink logits over the query's head axes (``heads`` unflattened as ``(kv_heads,
    q_heads_per_group)``, so Hugging Face head ``h`` belongs to key head ``h // group``), or None."""
    if not isinstance(layer, QkNormAttention) or layer.sinks is None:
        return None
    head_axes = tuple(ax for ax in q.axes if ax.name in ("kv_heads", "q_heads_per_group"))
    return layer.sinks.unflatten_axis("heads", head_axes)


def _fused_self_attention(
    layer: FusedQkvAttention,
    x: NamedArray,
    mask: AttentionMask | NamedArray | None,
    pos_ids: NamedArray | None,
    cache: KvCache | None,
    layer_idx: NamedArray | None,
    key: jax.Array | None,
) -> tuple[NamedArray, KvCache | None]:
    """:func:`self_attention` of a :class:`FusedQkvAttention` (full attention only, no rotary)."""
    k_attn, k_out = (None, None) if key is None else jax.random.split(key)
    q, k, v = layer.project(x, layer_idx)
    if cache is None:
        out = layer.attend(x.resolve_axis("position"), q, k, v, mask, key=k_attn)
    else:
        if pos_ids is None:
            raise ValueError("self_attention: decoding with a cache needs pos_ids (the tokens' cache slots)")
        cache = cache.update(k, v, pos_ids)
        HeadSize = q.resolve_axis("head_size")
        backend = layer.decode_backend()
        out = decode_attention(
            HeadSize, q, cache, pos_ids, scaling_factor=layer.scaling, backend=backend, block_size=layer.block_size
        )
    return layer.output(out, key=k_out), cache


def self_attention(
    layer: AttentionLayer,
    x: NamedArray,
    mask: AttentionMask | NamedArray | None,
    sliding_mask: AttentionMask | NamedArray | None = None,
    sliding: bool | NamedArray = False,
    *,
    pos_ids: NamedArray | None,
    cache: KvCache | None = None,
    window: int | None = None,
    layer_idx: NamedArray | None = None,
    key: jax.Array | None = None,
) -> tuple[NamedArray, KvCache | None]:
    """Self-attention of ``x`` (``(..., position, embed)``) over its own positions, or over ``cache``.

    Args:
        layer: the projections (and QK-norm, and Gemma's settings).
        x: the block's normalized input.
        mask: the attention mask of a full-attention layer (unused with a cache: the slots' positions decide).
        sliding_mask: the mask of a sliding layer (``mask`` restricted to the window; only read if ``sliding``).
        sliding: whether this layer slides (a bool, or a scalar boolean NamedArray inside a scan over layers of both
            kinds, where ``jax.lax.cond`` runs only the chosen variant).
        pos_ids: the rotary positions (None: ``0 .. n - 1``; required with a cache, where they are also the slots).
        cache: this layer's cache: write the tokens' keys and values there and attend over it; None: no cache.
        window: with a cache, how many keys a query of a sliding layer sees (None: all earlier ones).
        layer_idx: this block's index in the stack (a scalar, traced in the scan), or None; read by a
            :class:`FusedQkvAttention` subclass.
        key: a PRNG key for the dropout of a :class:`FusedQkvAttention` subclass (None: none).

    Returns:
        ``((..., position, embed), the updated cache or None)``.
    """
    if isinstance(layer, FusedQkvAttention):
        return _fused_self_attention(layer, x, mask, pos_ids, cache, layer_idx, key)
    if not isinstance(layer, (Attention, QkNormAttention)):
        # a layer of its own kind (no sliding windows): it projects, rotates, caches and attends itself
        return layer.self_attend(x, mask, pos_ids=pos_ids, cache=cache)
    a = layer.attn if isinstance(layer, QkNormAttention) else layer
    Pos = x.resolve_axis("position")
    local_rotary = layer.local_rotary if isinstance(layer, QkNormAttention) else None
    if local_rotary is None:

        def whole(m: AttentionMask | NamedArray | None, w: int | None) -> tuple[NamedArray, KvCache | None]:
            out, new_cache = _attend(layer, _project(layer, x), Pos, a.rotary, m, w, pos_ids, cache)
            return tag(a.o_proj(out), "attn_out"), new_cache

        return select_by_kind(sliding, lambda: whole(sliding_mask, window), lambda: whole(mask, None))
    qkv = _project(layer, x)
    out, cache = select_by_kind(
        sliding,
        lambda: _attend(layer, qkv, Pos, local_rotary, sliding_mask, window, pos_ids, cache),
        lambda: _attend(layer, qkv, Pos, a.rotary, mask, None, pos_ids, cache),
    )
    return tag(a.o_proj(out), "attn_out"), cache


def block_forward(
    x: NamedArray,
    self_attn: AttentionLayer,
    feed_forward: GatedMlp | Mlp | MoeMlp | None,
    norms: tuple[Norm | None, Norm, Norm | None, Norm | None],
    norm_placement: NormPlacement,
    mask: AttentionMask | NamedArray | None,
    sliding_mask: AttentionMask | NamedArray | None = None,
    sliding: bool | NamedArray = False,
    *,
    window: int | None = None,
    pos_ids: NamedArray | None = None,
    cache: KvCache | None = None,
    layer: NamedArray | None = None,
    key: jax.Array | None = None,
    resid_pdrop: float = 0.0,
) -> tuple[NamedArray, KvCache | None, RouterOutput | None]:
    """The forward of a decoder block (see :class:`DecoderBlock`), from its parts.

    Args:
        x: the input ``(..., position, embed)``.
        self_attn: the attention.
        feed_forward: the MLP or mixture of experts.
        norms: the attention's input norm, the post-attention norm, the feed-forward's input and output norms
            (None where ``norm_placement`` has none).
        norm_placement: ``"pre"``, ``"post"`` or ``"sandwich"``.
        mask: the mask of a full-attention layer.
        sliding_mask: the mask of a sliding layer (``mask`` restricted to ``window``; only read if ``sliding``).
        sliding: whether this layer slides (a bool, or a scalar boolean NamedArray inside the scan).
        window: the window of sliding layers (for a cache; the masks carry it otherwise).
        pos_ids: the positions (None: ``0 .. n - 1``).
        cache: this layer's cache (decoding), or None.
        layer: this block's index in the stack (a scalar), or None.
        key: a PRNG key for dropout (None: none); split between the attention and the feed-forward.
        resid_pdrop: dropout on the feed-forward's output (with a key).

    Returns:
        ``(the output, the updated cache or None, the routing of a mixture of experts or None)``.
    """
    k_attn, k_ff = (None, None) if key is None else jax.random.split(key)
    input_norm, post_attention_norm, pre_feedforward_norm, post_feedforward_norm = norms
    h = x if input_norm is None else input_norm(x)
    out, cache = self_attention(
        self_attn,
        h,
        mask,
        sliding_mask,
        sliding,
        pos_ids=pos_ids,
        cache=cache,
        window=window,
        layer_idx=layer,
        key=k_attn,
    )
    if norm_placement == "pre":
        x = x + out
        h = post_attention_norm(x)
    else:
        x = x + post_attention_norm(out)
        h = x if pre_feedforward_norm is None else pre_feedforward_norm(x)
    routing = None
    if isinstance(feed_forward, MoeMlp):
        y, routing = feed_forward(h)
    elif feed_forward is not None:
        y = feed_forward(h)
    y = _dropout(y, resid_pdrop, k_ff)
    if post_feedforward_norm is not None:
        y = post_feedforward_norm(y)
    return x + y, cache, routing


class DecoderBlock(eqx.Module):
    """Self-attention then a feed-forward network, each residual, with RMSNorms placed as ``norm_placement`` says.

    ``"pre"``: ``x + self_attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))`` (Llama's
    names). ``"post"``: ``x + post_attention_layernorm(self_attn(x))`` then ``x + post_feedforward_layernorm(mlp(x))``
    (OLMo 2's). ``"sandwich"``: ``x + post_attention_layernorm(self_attn(input_layernorm(x)))`` then
    ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` (Gemma 2/3's). Exactly one of ``mlp`` and
    ``block_sparse_moe`` is set.

    Attributes:
        input_layernorm: the attention's input norm (``"pre"``, ``"sandwich"``), else None.
        self_attn: the attention.
        post_attention_layernorm: the feed-forward's input norm (``"pre"``), or the attention's output norm.
        pre_feedforward_layernorm: the feed-forward's input norm (``"sandwich"``), else None.
        mlp: the dense feed-forward network, or None.
        block_sparse_moe: the mixture of experts (Mixtral's name), or None.
        post_feedforward_layernorm: the feed-forward's output norm (``"post"``, ``"sandwich"``), else None.
        norm_placement: ``"pre"``, ``"post"`` or ``"sandwich"`` (static).
    """

    input_layernorm: Norm | None
    self_attn: AttentionLayer
    post_attention_layernorm: Norm
    pre_feedforward_layernorm: Norm | None
    mlp: GatedMlp | Mlp | None
    block_sparse_moe: MoeMlp | None
    post_feedforward_layernorm: Norm | None
    norm_placement: NormPlacement = eqx.field(static=True, default="pre")

    @staticmethod
    def init(config: DecoderConfig, *, key: jax.Array) -> DecoderBlock:
        """Create one block: ``key`` splits into the attention's key and the feed-forward's."""
        keys = jax.random.split(key, 1 + config.feed_forward_keys)
        Embed, placement = config.Embed, config.norm_placement
        ff = config.init_feed_forward(keys[1:])
        return DecoderBlock(
            input_layernorm=config.init_norm(Embed) if placement != "post" else None,
            self_attn=config.init_attention(key=keys[0]),
            post_attention_layernorm=config.init_norm(Embed),
            pre_feedforward_layernorm=config.init_norm(Embed) if placement == "sandwich" else None,
            mlp=ff if isinstance(ff, (GatedMlp, Mlp)) else None,
            block_sparse_moe=ff if isinstance(ff, MoeMlp) else None,
            post_feedforward_layernorm=config.init_norm(Embed) if placement != "pre" else None,
            norm_placement=placement,
        )

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        sliding_mask: AttentionMask | NamedArray | None = None,
        sliding: bool | NamedArray = False,
        *,
        window: int | None = None,
        pos_ids: NamedArray | None = None,
        cache: KvCache | None = None,
        layer: NamedArray | None = None,
        key: jax.Array | None = None,
    ) -> tuple[NamedArray, KvCache | None, RouterOutput | None]:
        """Apply the block to ``(..., position, embed)`` (:func:`block_forward`).

        Args:
            x: the input.
            mask: the mask of a full-attention layer.
            sliding_mask: the mask of a sliding layer (``mask`` restricted to ``window``; only read if ``sliding``).
            sliding: whether this layer slides (a bool, or a scalar boolean NamedArray inside the scan).
            window: the window of sliding layers (for a cache; the masks carry it otherwise).
            pos_ids: the rotary positions (None: ``0 .. n - 1``).
            cache: this layer's cache (decoding), or None.
            layer: this block's index in the stack (a scalar), or None.
            key: a PRNG key for dropout (None: none).

        Returns:
            ``(the output, the updated cache or None, the routing of a mixture of experts or None)``.
        """
        norms = (
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )
        return block_forward(
            x,
            self.self_attn,
            self.block_sparse_moe if self.block_sparse_moe is not None else self.mlp,
            norms,
            self.norm_placement,
            mask,
            sliding_mask,
            sliding,
            window=window,
            pos_ids=pos_ids,
            cache=cache,
            layer=layer,
            key=key,
        )


class DecoderStackParts(Protocol):
    """What :class:`DecoderLM` reads of its stack: a :class:`DecoderStack`, or a family's stack with other names
    (GPT-2's ``wte``, ``h``, ``ln_f``) exposing these."""

    @property
    def embed_tokens(self) -> Embedding: ...
    @property
    def layers(self) -> Stacked[Any]: ...
    @property
    def norm(self) -> Any: ...


class DecoderStack(eqx.Module):
    """Token embedding, stacked decoder blocks and the final norm (Hugging Face ``model``).

    Attributes:
        embed_tokens: the token embedding.
        layers: the blocks (in a model mixing dense and MoE blocks: the MoE ones, in layer order).
        norm: the final norm.
        dense_layers: in a model mixing dense and MoE blocks, the dense ones in layer order; else None.
    """

    embed_tokens: Embedding
    layers: Stacked[DecoderBlock]
    norm: Norm
    dense_layers: Stacked[DecoderBlock] | None = None


class _DenseBlocks:
    """``config`` as :meth:`DecoderBlock.init` sees it for the dense blocks of a model mixing dense and MoE blocks:
    its feed-forward is ``config.init_dense_feed_forward``."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def init_feed_forward(self, keys: jax.Array) -> GatedMlp | Mlp:
        """The dense feed-forward network of one block."""
        return self._config.init_dense_feed_forward(keys)


def _dense_pattern(config: Any) -> tuple[bool, ...] | None:
    """Per layer whether its block is dense, for a config mixing dense and MoE blocks (one with a ``dense_layers()``
    method saying so for some layer); None otherwise."""
    method = getattr(config, "dense_layers", None)
    dense = tuple(bool(d) for d in method()) if method is not None else ()
    return dense if any(dense) else None


def _block_step(
    block: DecoderBlock,
    carry: tuple[NamedArray, KvCache | None],
    layer: NamedArray,
    layer_key: jax.Array | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[tuple[NamedArray, KvCache | None], RouterOutput | None]:
    """One block in the scan over layers: the carry is the hidden states and (decoding) the stacked cache."""
    x, cache = carry
    if cache is not None:
        cache = cache.at_layer(layer.array)
    x, cache, routing = block(x, *args, cache=cache, layer=layer, key=layer_key, **kwargs)
    return (x, cache), routing


def init_embedding(config: DecoderConfig, Vocab: Axis, *, key: jax.Array) -> Embedding:
    """A token (or position) embedding over ``Vocab``, drawn with ``config.initializer_range``."""
    return Embedding.init(Vocab, config.Embed, key=key, initializer_range=config.initializer_range)


def init_blocks(config: DecoderConfig, block: Any, *, key: jax.Array) -> Stacked[Any]:
    """``config.num_layers`` blocks (``block.init(config, key=...)``) stacked for the scan, one key per layer."""
    return Stacked.init(config.Layers, block, gradient_checkpointing=config.gradient_checkpointing)(
        config, key=jax.random.split(key, config.num_layers)
    )


class DecoderLM(LmHeadModel[Any]):
    """A decoder-only language model on :class:`DecoderStack` (Llama, Mistral, Qwen2/3, OLMo 2, Mixtral, Gemma 1/2/3;
    GPT-2 with its own names).

    Attributes:
        transformer: embeddings, layers and final norm (state-dict key ``model``).
        lm_head: ``Embed -> Vocab`` without bias, or None when tied to the token embedding.
        config: the config (static).
        vocab_size: the real vocabulary size when the vocabulary axis is padded (``config.vocab_padding_multiple``);
            logits of the padded entries are masked (static).
    """

    transformer: DecoderStackParts
    lm_head: Linear | None
    config: Any = eqx.field(static=True)
    vocab_size: int | None = eqx.field(static=True, default=None)

    _hf_vocab_keys: ClassVar[tuple[str, ...]] = ("model.embed_tokens.weight", "lm_head.weight")

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"transformer": "model"}

    @classmethod
    def init(cls, config: DecoderConfig, Vocab: Axis, *, key: jax.Array) -> Self:
        """Create a randomly initialized model.

        The key splits into three: the stack's first two (:meth:`_init_stack`) and the untied output projection's.

        Args:
            config: the config (it chooses the blocks' parts).
            Vocab: the (real) vocabulary axis; the model's is padded to ``config.vocab_padding_multiple``.
            key: the PRNG key.

        Returns:
            The model.
        """
        keys = jax.random.split(key, 3)
        PaddedVocab = config.padded_vocab(Vocab)
        transformer = cls._init_stack(config, PaddedVocab, keys)
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = Linear.init(config.Embed, PaddedVocab, key=keys[2], use_bias=False)
        return cls(transformer=transformer, lm_head=lm_head, config=config, vocab_size=Vocab.size)

    @classmethod
    def _init_stack(cls, config: DecoderConfig, Vocab: Axis, keys: jax.Array) -> Any:
        """The embeddings, blocks and final norm over the (padded) ``Vocab``, from ``keys[0]`` (token embedding) and
        ``keys[1]`` (blocks); a family with other parts or names overrides it (GPT-2)."""
        dense = _dense_pattern(config)
        dense_stack = None
        if dense is None:
            layers = init_blocks(config, DecoderBlock, key=keys[1])
        else:  # each block keeps the key of its layer number
            layer_keys = jax.random.split(keys[1], config.num_layers)
            ckpt = config.gradient_checkpointing
            ids = [i for i, d in enumerate(dense) if not d], [i for i, d in enumerate(dense) if d]
            layers = Stacked.init(Axis(config.Layers.name, len(ids[0])), DecoderBlock, gradient_checkpointing=ckpt)(
                config, key=layer_keys[jnp.asarray(ids[0])]
            )
            dense_stack = Stacked.init(
                Axis(config.Layers.name, len(ids[1])), DecoderBlock, gradient_checkpointing=ckpt
            )(_DenseBlocks(config), key=layer_keys[jnp.asarray(ids[1])])
        return DecoderStack(
            embed_tokens=init_embedding(config, Vocab, key=keys[0]),
            layers=layers,
            norm=config.init_norm(config.Embed),
            dense_layers=dense_stack,
        )

    @property
    def Vocab(self) -> Axis:
        """The vocabulary axis of the logits (padded if ``config.vocab_padding_multiple > 1``)."""
        return self.transformer.embed_tokens.Vocab

    def _windows(self) -> tuple[bool | NamedArray, int | None]:
        """Per layer whether it slides (one bool when all agree, else a ``(layers,)`` array) and the window.

        The window is None when no layer has one (sliding layers then see every earlier key, but keep their own
        rotary: Gemma 3).
        """
        sizes = sorted({w for w in self.config.attention_windows() if w is not None})
        if len(sizes) > 1:
            raise ValueError(f"{type(self.config).__name__}: sliding layers need one window size, got {sizes}")
        window = sizes[0] if sizes else None
        flags = self.config.sliding_layers()
        if len(set(flags)) == 1:
            return flags[0], window
        return hax.named(jnp.asarray(flags), self.config.Layers), window

    def _embed(
        self, input_ids: NamedArray, pos_ids: NamedArray | None = None, *, key: jax.Array | None = None
    ) -> NamedArray:
        """The token embeddings of ``input_ids`` (``(..., position, embed)``); a family may scale them (Gemma) or
        add position embeddings of ``pos_ids`` and dropout with ``key`` (GPT-2)."""
        del pos_ids, key
        return self.transformer.embed_tokens.embed(input_ids)

    def _run(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None,
        pos_ids: NamedArray | None,
        cache: KvCache | None = None,
        *,
        key: jax.Array | None = None,
    ) -> tuple[NamedArray, KvCache | None, RouterOutput | None]:
        """Embed ``input_ids``, run the blocks (over ``cache`` if given) and the final norm.

        ``key`` (for dropout) splits into the embeddings' key and one key per layer.

        Returns:
            ``(hidden states after the final norm, the updated cache or None, the stacked routing or None)``.
        """
        sliding, window = self._windows()
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        sliding_mask = mask
        if window is not None:
            sliding_mask = with_sliding_window(attn_mask, window, input_ids.resolve_axis("position"))
        k_embed, k_layers = (None, None) if key is None else jax.random.split(key)
        x = self._embed(input_ids, pos_ids, key=k_embed)
        layer_ids = hax.arange(self.config.Layers, dtype=jnp.int32)
        layer_keys = None if k_layers is None else jax.random.split(k_layers, self.config.num_layers)
        if cache is not None:
            # the stacked cache is the scan's carry and each layer writes its slots in place (no per-layer copies)
            cache = cache.at_layer(0)
        dense_stack = getattr(self.transformer, DENSE_LAYERS, None)
        if dense_stack is None:
            (x, cache), routing = self.transformer.layers.scan_via(_block_step, unroll=self.config.layer_unroll)(
                (x, cache), layer_ids, layer_keys, mask, sliding_mask, sliding, window=window, pos_ids=pos_ids
            )
            return self.transformer.norm(x), cache, routing
        # dense and MoE blocks: scan each run of one kind over its slice of its stack, in layer order
        routings = []
        name = self.config.Layers.name
        for is_dense, first, start, n in layer_runs(_dense_pattern(self.config) or ()):
            stack = slice_stack(dense_stack if is_dense else self.transformer.layers, start, start + n)
            keys = None if layer_keys is None else layer_keys[first : first + n]
            (x, cache), routing = stack.scan_via(_block_step, unroll=self.config.layer_unroll)(
                (x, cache),
                slice_layers(layer_ids, name, first, first + n),
                keys,
                mask,
                sliding_mask,
                slice_layers(sliding, name, first, first + n),
                window=window,
                pos_ids=pos_ids,
            )
            if routing is not None:
                routings.append(routing)
        return self.transformer.norm(x), cache, concat_routing(routings, name) if routings else None

    def activations_and_aux(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> tuple[NamedArray, dict[str, NamedArray]]:
        """The final hidden states ``(..., position, embed)`` and the auxiliary losses.

        Args:
            input_ids: integer ids ``(..., position)``.
            attn_mask: the attention mask (None: causal); sliding layers further restrict it to their window.
            key: a PRNG key for dropout, in a family that has it (GPT-2); None: deterministic.
            pos_ids: the rotary positions ``(..., position)`` (None: ``0 .. n - 1``; see :class:`LmHeadModel`).

        Returns:
            ``(hidden states after the final norm, {})``, or for a mixture of experts
            ``{"router_aux_loss": weight * load-balancing loss}`` and the diagnostics of
            :func:`~ponente.models.moe.router_metrics` over all MoE layers, named ``router/<metric>``, and per group of
            consecutive MoE layers (``config.router_metrics_groups`` groups, when at least two),
            ``router/group_<g>/<metric>`` (logged, not added to the loss).
        """
        x, _, routing = self._run(input_ids, attn_mask, pos_ids, key=key)
        if routing is None:
            return x, {}
        return x, self._router_aux(routing)

    def _router_aux(self, routing: RouterOutput) -> dict[str, NamedArray]:
        """The weighted load-balancing loss (``router_aux_loss``, when the config has ``router_aux_loss_coef``), the
        ``router/*`` diagnostics and, with a balancing bias, the expert loads the trainer's bias update reads."""
        metrics = router_metrics(routing, self.config.Experts)
        aux = {}
        if hasattr(self.config, "router_aux_loss_coef"):
            aux[ROUTER_AUX_LOSS] = metrics["load_balancing_loss"] * self.config.router_aux_loss_coef
        groups = router_group_metrics(routing, self.config.Experts, getattr(self.config, "router_metrics_groups", 0))
        if len(groups) > len(metrics):  # one group would repeat the overall metrics
            metrics.update(groups)
        aux.update({f"router/{name}": jax.lax.stop_gradient(value) for name, value in metrics.items()})
        bias = balancing_bias(self.transformer.layers.stacked.block_sparse_moe)
        if bias is not None:
            # not a scalar: the trainer reads it to update the balancing bias (update_balance_bias), it is not logged
            aux[EXPERT_LOAD] = jax.lax.stop_gradient(expert_load(routing, self.config.Experts))
            aux["router/balance_bias_abs_mean"] = hax.mean(hax.abs(jax.lax.stop_gradient(bias)))
        return aux

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """The final hidden states ``(..., position, embed)``, before the output projection.

        Args:
            input_ids: integer ids ``(..., position)``.
            attn_mask: the attention mask (None: causal); sliding layers further restrict it to their window.
            key: a PRNG key for dropout, in a family that has it (GPT-2); None: deterministic.
            pos_ids: the rotary positions ``(..., position)`` (None: ``0 .. n - 1``; see :class:`LmHeadModel`).

        Returns:
            The hidden states after the final norm.
        """
        return self._run(input_ids, attn_mask, pos_ids, key=key)[0]

    def logits_and_aux(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> tuple[NamedArray, dict[str, NamedArray]]:
        """Logits ``(..., position, vocab)`` and the auxiliary losses (see :meth:`activations_and_aux`)."""
        x, aux = self.activations_and_aux(input_ids, attn_mask, key=key, pos_ids=pos_ids)
        return self._logits(x), aux

    def routing(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        pos_ids: NamedArray | None = None,
    ) -> RouterOutput | None:
        """The routing decision of every layer (arrays with a leading ``layers`` axis), or None without experts."""
        return self._run(input_ids, attn_mask, pos_ids)[2]

    def to_hf_state_dict(self) -> dict[str, Any]:
        """The parameters under their Hugging Face names (see :meth:`LmHeadModel.to_hf_state_dict`); in a model mixing
        dense and MoE blocks, both stacks' blocks numbered as Hugging Face does, ``model.layers.L`` in layer order."""
        state = super().to_hf_state_dict()
        dense = _dense_pattern(self.config)
        return state if dense is None else to_hf_layers(state, dense)

    def from_hf_state_dict(self, state_dict: Any) -> Self:
        """A copy of this (template) model with parameters read from a Hugging Face state dict (see
        :meth:`LmHeadModel.from_hf_state_dict`; ``model.layers.L`` goes to the stack of its block's kind)."""
        dense = _dense_pattern(self.config)
        return super().from_hf_state_dict(state_dict if dense is None else from_hf_layers(state_dict, dense))

    def get_lm_head(self) -> NamedArray:
        """The output projection (``embed``, ``vocab``): ``lm_head``'s, or the token embedding if tied.

        With a padded vocabulary only the real entries are returned, so a loss computed from it (the
        blockwise loss) never sees the padding.
        """
        weight = self.transformer.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return _real_vocab_rows(weight, self.Vocab, self.vocab_size)

    def __call__(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Logits ``(..., position, vocab)`` for ``input_ids`` ``(..., position)`` (see :class:`LmHeadModel`).

        Padded vocabulary entries hold the dtype's most negative value.
        """
        return self._logits(self.activations(input_ids, attn_mask, key=key, pos_ids=pos_ids))

    def _logits(self, x: NamedArray) -> NamedArray:
        """The output projection of final hidden states; padded vocabulary entries get the most negative value."""
        return mask_padded_vocab(self._project_out(x), self.Vocab, self.vocab_size)

    def _project_out(self, x: NamedArray) -> NamedArray:
        """``lm_head(x)``, or the tied unembedding; a family may change these logits (Gemma's soft cap)."""
        return self.transformer.embed_tokens.unembed(x) if self.lm_head is None else self.lm_head(x)

    def init_cache(self, Batch: Axis, max_len: int, *, dtype: Any = None) -> KvCache:
        """An empty cache over ``(layers, batch, kv_heads, cache_position, head_size)`` (see :class:`LmHeadModel`).

        Raises:
            ValueError: if ``max_len`` is below 1.
        """
        config = self.config
        dtype = self.transformer.embed_tokens.weight.dtype if dtype is None else dtype
        return KvCache.init((config.Layers, Batch, config.KVHeads), config.HeadSize, max_len, dtype=dtype)

    def decode(
        self,
        tokens: NamedArray,
        cache: KvCache,
        pos_ids: NamedArray,
        *,
        key: jax.Array | None = None,
        logits_at: NamedArray | None = None,
    ) -> tuple[NamedArray, KvCache]:
        """Logits of ``tokens`` over the cached earlier tokens, and the updated cache (see :class:`LmHeadModel`).

        The same blocks as the forward pass, with the cache in the scan's carry.
        """
        del key
        pos_ids = hax.broadcast_to(pos_ids, tokens.axes)
        x, cache_out, _ = self._run(tokens, None, pos_ids, cache)
        cache = cache if cache_out is None else cache_out.at_layer(None).for_prefill(False)  # never None here
        return self._logits(take_positions(x, logits_at)), cache
