"""The attention layer of the zoo (:class:`Attention`), the dispatch to a backend, and attention over a cache."""

from __future__ import annotations

import equinox as eqx
import jax

from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Linear

from ..remat import tag
from ..rotary import RotaryConfig, apply_rotary
from ._mask import AttentionMask
from .backends import ATTENTION_BACKENDS, AttentionCall, auto_backend, check_backend_name, resolve_backend
from .kv_cache import CACHE_POSITION, KvCache, cached_attention
from .reference import KEY_POSITION, dot_product_attention
from .ring import ATTENTION_CONTEXT_PARALLEL, context_axis, context_parallel_attention

__all__ = [
    "ATTENTION_BACKENDS",
    "KEY_POSITION",
    "Attention",
    "AttentionMask",
    "attention",
    "decode_attention",
    "dot_product_attention",
]


def _check_backend(backend: str) -> None:
    check_backend_name(backend, "attention")


def attention(
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    scaling_factor: float | None = None,
    backend: str = "auto",
    block_size: int = 128,
    logit_soft_cap: float | None = None,
    sinks: NamedArray | None = None,
    context_parallel: str = "allgather",
) -> NamedArray:
    """Attention over the shared position axis ``Pos``, computed by the chosen backend.

    Every backend has the contract of :func:`dot_product_attention` (named axes, grouped-query
    attention by broadcasting extra query axes, batch axes anywhere). The backends, what each supports
    and where it runs are listed in :mod:`ponente.models.attention.backends`; ``"auto"`` picks, from the
    device and the call's static facts (dtype, shapes, mask features, soft cap), the fastest backend that
    supports the call.

    Args:
        Pos: the position axis of query, key and value.
        HeadSize: the contracted per-head axis.
        query: ``(..., Pos, heads..., HeadSize)``.
        key: ``(..., Pos, kv heads..., HeadSize)``.
        value: like ``key``.
        mask: an :class:`AttentionMask`, an explicit boolean mask (``"reference"`` and ``"xla"`` only), or None.
        scaling_factor: multiplies the scores (None: ``1/sqrt(HeadSize.size)``).
        backend: ``"auto"``, ``"reference"`` (:func:`dot_product_attention`, materializes the scores),
            ``"flash"`` (:func:`~ponente.models.attention.flash.flash_attention`, blockwise, O(seq * block)
            memory), ``"xla"`` or ``"cudnn"`` (``jax.nn.dot_product_attention``) or ``"pallas"`` (JAX's
            Pallas kernels on GPU/TPU).
        block_size: the tile size over positions of ``"flash"`` (and of ``"pallas"`` on GPU).
        logit_soft_cap: caps the scaled logits with ``cap * tanh(logits / cap)`` before masking (Gemma 2);
            None: no cap.
        sinks: per-head sink logits over the query's head axes, added to the softmax's denominator (gpt-oss;
            ``"reference"`` and ``"flash"`` compute them, and ``"auto"`` picks one of them); None: none.
        context_parallel: when the current mesh splits ``Pos`` (context parallelism) and ``mask`` is an
            :class:`AttentionMask`, ``"allgather"`` or ``"ring"``: each device attends its own query rows inside
            ``shard_map`` (:func:`~ponente.models.attention.ring.context_parallel_attention`); with
            ``"allgather"``, blockwise when the backend (``"auto"`` resolved for the call) is not ``"reference"``.
            Calls with an explicit mask are left to the compiler's partitioning.

    Returns:
        The attended values with the query's axes.

    Raises:
        ValueError: for an unknown ``backend`` (the message lists the choices), a backend that does not
            support the call (the message names the feature or device), or as the backend raises.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> Pos, Hd = hax.Axis("position", 6), hax.Axis("head_size", 4)
        >>> x = hax.random.normal(jax.random.key(0), (Pos, Hd))
        >>> ref = attention(Pos, Hd, x, x, x, AttentionMask.causal())
        >>> fla = attention(Pos, Hd, x, x, x, AttentionMask.causal(), backend="flash", block_size=4)
        >>> bool(hax.all(hax.abs(ref - fla) < 1e-5).scalar())
        True
    """
    call = AttentionCall.of(Pos, HeadSize, query, key, value, mask, logit_soft_cap, sinks=sinks is not None)
    query, key, value = tag((query, key, value), "attn_qkv")
    if isinstance(mask, AttentionMask) and context_axis(Pos)[1] > 1:
        _check_backend(backend)
        chosen = auto_backend(call) if backend == "auto" else backend
        out = context_parallel_attention(
            Pos,
            HeadSize,
            query,
            key,
            value,
            mask,
            mode=context_parallel,
            blockwise=chosen != "reference",
            block_size=block_size,
            scaling_factor=scaling_factor,
            logit_soft_cap=logit_soft_cap,
            sinks=sinks,
        )
        return tag(out, "attn_context")
    out = resolve_backend(backend, call).fn(
        Pos,
        HeadSize,
        query,
        key,
        value,
        mask,
        scaling_factor=scaling_factor,
        block_size=block_size,
        logit_soft_cap=logit_soft_cap,
        sinks=sinks,
    )
    return tag(out, "attn_context")


class Attention(eqx.Module):
    """Multi-head attention with grouped key/value heads (MHA, GQA, MQA) and optional rotary embeddings.

    Query heads are laid out as ``(kv_heads, q_heads_per_group)``, so flattened weights match Hugging
    Face's ``(num_heads * head_dim, hidden)`` layout where query head ``h`` uses key head ``h // group``.

    Attributes:
        q_proj: ``Embed -> (KVHeads, QHeadsPerGroup, HeadSize)``.
        k_proj: ``Embed -> (KVHeads, HeadSize)``.
        v_proj: ``Embed -> (KVHeads, HeadSize)``.
        o_proj: ``(KVHeads, QHeadsPerGroup, HeadSize) -> Embed``.
        rotary: rotary settings (None: no rotary embedding).
        backend: the attention backend, ``"auto"`` or a name in ``ATTENTION_BACKENDS`` (see :func:`attention`).
        block_size: the flash-attention tile size over positions.
        context_parallel: ``"allgather"`` or ``"ring"``: the attention under context parallelism (see :meth:`init`).
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    rotary: RotaryConfig | None = eqx.field(static=True)
    backend: str = eqx.field(static=True, default="auto")
    block_size: int = eqx.field(static=True, default=128)
    context_parallel: str = eqx.field(static=True, default="allgather")

    @staticmethod
    def init(
        Embed: Axis,
        KVHeads: Axis,
        QHeadsPerGroup: Axis,
        HeadSize: Axis,
        *,
        use_bias: bool,
        rotary: RotaryConfig | None,
        key: jax.Array,
        backend: str = "auto",
        block_size: int = 128,
        context_parallel: str = "allgather",
    ) -> Attention:
        """Create the projections.

        Args:
            Embed: the model-width axis.
            KVHeads: the key/value heads axis.
            QHeadsPerGroup: query heads per key/value head.
            HeadSize: the per-head axis.
            use_bias: whether the Q/K/V/O projections have biases.
            rotary: rotary settings, or None.
            key: the PRNG key.
            backend: the attention backend (``"auto"`` or a name in ``ATTENTION_BACKENDS``; see :func:`attention`).
            block_size: the flash-attention tile size over positions.
            context_parallel: with ``position`` split over a mesh axis, ``"allgather"`` (keys and values gathered,
                then ``backend``) or ``"ring"`` (:func:`~ponente.models.attention.ring.context_parallel_attention`).

        Returns:
            The layer.

        Raises:
            ValueError: for an unknown ``backend`` or ``context_parallel``, or a ``block_size`` below 1.
        """
        _check_backend(backend)
        if block_size < 1:
            raise ValueError(f"Attention.init: block_size must be >= 1, got {block_size}")
        if context_parallel not in ATTENTION_CONTEXT_PARALLEL:
            raise ValueError(
                f"Attention.init: context_parallel must be one of {ATTENTION_CONTEXT_PARALLEL}, "
                f"got {context_parallel!r}"
            )
        kq, kk, kv, ko = jax.random.split(key, 4)
        QHeads = (KVHeads, QHeadsPerGroup, HeadSize)
        return Attention(
            q_proj=Linear.init(Embed, QHeads, key=kq, use_bias=use_bias),
            k_proj=Linear.init(Embed, (KVHeads, HeadSize), key=kk, use_bias=use_bias),
            v_proj=Linear.init(Embed, (KVHeads, HeadSize), key=kv, use_bias=use_bias),
            o_proj=Linear.init(QHeads, Embed, key=ko, use_bias=use_bias),
            rotary=rotary,
            backend=backend,
            block_size=block_size,
            context_parallel=context_parallel,
        )

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Attend over the ``position`` axis of ``x``.

        Args:
            x: ``(..., position, embed)``.
            mask: the attention mask (or None).
            key: unused (no dropout).
            pos_ids: integer positions of the tokens for the rotary embedding, over ``position`` (and some batch
                axes); None: ``0 .. n - 1``. See :func:`~ponente.models.apply_rotary`.

        Returns:
            ``(..., position, embed)``.
        """
        del key
        Pos = x.resolve_axis("position")
        HeadSize = self.o_proj.weight.resolve_axis("head_size")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.rotary is not None:
            q = apply_rotary(q, Pos, HeadSize, self.rotary, pos_ids)
            k = apply_rotary(k, Pos, HeadSize, self.rotary, pos_ids)
        out = attention(
            Pos,
            HeadSize,
            q,
            k,
            v,
            mask,
            backend=self.backend,
            block_size=self.block_size,
            context_parallel=self.context_parallel,
        )
        return tag(self.o_proj(out), "attn_out")


def decode_attention(
    HeadSize: Axis,
    query: NamedArray,
    cache: KvCache,
    pos_ids: NamedArray,
    *,
    window: int | None = None,
    scaling_factor: float | None = None,
    logit_soft_cap: float | None = None,
    backend: str = "auto",
    block_size: int = 128,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """The attention of a layer's ``decode``: queries over the cache (already updated with their keys and values).

    One-token steps (and an unmarked cache) attend over the slots
    (:func:`~ponente.models.attention.kv_cache.cached_attention`). On a prefill (a cache marked by
    :meth:`~ponente.models.attention.kv_cache.KvCache.for_prefill`) the ``n`` queries attend causally (within
    ``window``) over the first ``n`` slots alone, the keys they have just written, through :func:`attention` with the
    forward pass's ``backend`` (``"auto"``: the fastest for the call, e.g. the blockwise ``flash`` kernel on long
    prompts); ``pos_ids`` must then be ``0 .. n - 1`` on every row.

    Args:
        HeadSize: the contracted per-head axis.
        query: ``(batch..., position, heads..., head_size)``.
        cache: this layer's cache (or a view of it, :meth:`~ponente.models.attention.kv_cache.KvCache.at_layer`).
        pos_ids: the queries' positions over ``(batch..., position)``.
        window: how many keys (the query's own included) each query sees; None: all earlier ones.
        scaling_factor: multiplies the scores (None: ``1/sqrt(HeadSize.size)``).
        logit_soft_cap: caps the scaled scores with ``cap * tanh(scores / cap)`` (Gemma 2).
        backend: the attention backend of a prefill (the layer's forward backend, see :func:`attention`).
        block_size: the ``flash`` tile size of a prefill.
        sinks: per-head sink logits over the query's head axes (see :func:`attention`), or None.

    Returns:
        The attended values with the query's axes.

    Raises:
        ValueError: on a prefill with more queries than cache slots, or as the backend raises.
    """
    if not cache.prefill:
        return cached_attention(
            HeadSize,
            query,
            cache,
            pos_ids,
            window=window,
            scaling_factor=scaling_factor,
            logit_soft_cap=logit_soft_cap,
            sinks=sinks,
        )
    Pos = query.resolve_axis("position")
    if Pos.size > cache.max_len:
        raise ValueError(f"decode_attention: a prefill of {Pos.size} tokens does not fit {cache.max_len} cache slots")

    def written(cached: NamedArray) -> NamedArray:
        return cached[CACHE_POSITION, 0 : Pos.size].rename({CACHE_POSITION: Pos.name})

    keys, values = written(cache.layer_keys), written(cache.layer_values)
    out = attention(
        Pos,
        HeadSize,
        query,
        keys,
        values,
        AttentionMask.causal(window),
        scaling_factor=scaling_factor,
        backend=backend,
        block_size=block_size,
        logit_soft_cap=logit_soft_cap,
        sinks=sinks,
    )
    return out.astype(values.dtype).rearrange(query.axes)
