"""Blockwise ("flash") attention in pure JAX: online softmax, O(seq * block) memory, recomputing backward.

The forward pass walks the key/value blocks of each query block keeping a running maximum and sum
(the online softmax), so the ``(position, key_position)`` score matrix only ever exists one
``(block, block)`` tile at a time. The backward pass (a :func:`jax.custom_vjp`) stores only the output and
the per-query log-sum-exp and recomputes each tile. Masks are computed per tile from an
:class:`~ponente.models.AttentionMask` description (causal, sliding window, segment ids, token indices); key blocks
that a query block cannot see (above the causal diagonal, outside the sliding window) are not visited. With token
indices (tokens in another order than the position axis, or a device's queries against every key under context
parallelism), the masks compare the indices, and tiles the mask hides entirely are skipped at run time. Scores may be
soft-capped (Gemma 2: ``cap * tanh(score / cap)`` after scaling, before masking); the backward pass applies the
derivative of the cap, ``1 - tanh²``, to each recomputed tile. The backward pass over one block of keys, given the
log-sum-exp and ``rowsum(dout * out)`` from outside, is one function (:func:`_key_block_grads`), which ring attention's
backward pass (:mod:`.ring`) calls once per block with the log-sum-exp over all blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray

from ._mask import AttentionMask

__all__ = ["flash_attention"]


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of one flash-attention call (hashable: a ``nondiff`` argument of the custom VJP)."""

    block: int  # tile size for both query and key blocks
    length: int  # the real (unpadded) number of keys; keys at or beyond it are masked
    causal: bool
    window: int | None
    scale: float
    soft_cap: float | None = None
    # causality and windows compare explicit token indices (``q_idx``/``k_idx``: context parallelism's zig-zag order)
    # instead of the block order; every tile is then visited, and one that the mask hides entirely is skipped at run
    # time (``lax.cond``) rather than by the loop bounds
    indexed: bool = False

    def kv_range(self, i: jax.Array, num_blocks: int) -> tuple[jax.Array, jax.Array]:
        """Key blocks ``[lo, hi)`` that query block ``i`` may see."""
        lo = jnp.zeros((), jnp.int32)
        if self.indexed:
            return lo, jnp.asarray(num_blocks, jnp.int32)
        if self.window is not None:  # keys k > q - window; the first query of block i is i * block
            lo = jnp.maximum(lo, (i * self.block - self.window + 1) // self.block)
        hi = i + 1 if self.causal else jnp.asarray(num_blocks, jnp.int32)
        return lo, hi

    def q_range(self, j: jax.Array, num_blocks: int) -> tuple[jax.Array, jax.Array]:
        """Query blocks ``[lo, hi)`` that may see key block ``j``."""
        hi = jnp.asarray(num_blocks, jnp.int32)
        if self.indexed:
            return jnp.zeros((), jnp.int32), hi
        lo = j if self.causal else jnp.zeros((), jnp.int32)
        if self.window is not None:  # the last key of block j is seen by queries q < key + window
            last_q = j * self.block + self.block - 1 + self.window - 1
            hi = jnp.minimum(hi, last_q // self.block + 1)
        return lo, hi

    def tile_mask(self, i: jax.Array, j: jax.Array, seg: _Ids, idx: _Ids) -> jax.Array:
        """Boolean ``[..., 1, block, block]``: may query ``a`` of block ``i`` attend to key ``c`` of block ``j``."""
        kslot = j * self.block + jnp.arange(self.block)[None, :]
        allowed = jnp.broadcast_to(kslot < self.length, (self.block, self.block))
        if idx is None:
            qpos, kpos = i * self.block + jnp.arange(self.block)[:, None], kslot
        else:
            qpos = lax.dynamic_slice_in_dim(idx[0], i * self.block, self.block)[:, None]
            kpos = lax.dynamic_slice_in_dim(idx[1], j * self.block, self.block)[None, :]
        if self.causal:
            allowed = allowed & (kpos <= qpos)
        if self.window is not None:
            allowed = allowed & (qpos - kpos < self.window)
        if seg is not None:
            qs = lax.dynamic_slice_in_dim(seg[0], i * self.block, self.block, axis=-1)
            ks = lax.dynamic_slice_in_dim(seg[1], j * self.block, self.block, axis=-1)
            allowed = allowed & (qs[..., :, None] == ks[..., None, :])
        return allowed[..., None, :, :]

    def visit_if_seen(self, mask: jax.Array, step: Any, carry: Any) -> Any:
        """``step(carry)``, skipped (``carry`` unchanged) in indexed mode when ``mask`` hides the whole tile."""
        if not self.indexed:
            return step(carry)
        return lax.cond(jnp.any(mask), step, lambda c: c, carry)


_Ids = tuple[jax.Array, jax.Array] | None
"""Per-position ids of the queries and of the keys (segment ids ``[..., L]``, or token indices ``[L]``), or None."""


UNSEEN_LSE = -1e30
"""The log-sum-exp of a query row that sees no key (finite, so merging partial results never computes ``inf - inf``;
its probabilities ``exp(-inf - UNSEEN_LSE)`` are still exactly 0)."""


def _tile(x: jax.Array, index: jax.Array, block: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, index * block, block, axis=axis)


def _scores(spec: _Spec, qi: jax.Array, kj: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Scaled (and soft-capped) scores of one tile, ``-inf`` where masked (so ``exp`` gives exactly 0 there).

    Also returns the derivative of the capped scores with respect to the scaled ones, ``1 - tanh²`` (finite
    everywhere, masked entries included), or None without a cap.
    """
    s = jnp.einsum("...gqd,...kd->...gqk", qi * spec.scale, kj)
    slope = None
    if spec.soft_cap is not None:
        t = jnp.tanh(s / spec.soft_cap)
        s, slope = spec.soft_cap * t, 1.0 - t * t
    return jnp.where(mask, s, -jnp.inf), slope


def _pair(q_ids: jax.Array | None, k_ids: jax.Array | None) -> _Ids:
    return None if q_ids is None or k_ids is None else (q_ids, k_ids)


def _forward(
    spec: _Spec, q: jax.Array, k: jax.Array, v: jax.Array, seg: _Ids, idx: _Ids
) -> tuple[jax.Array, jax.Array]:
    """Output ``[..., g, Lq, Dv]`` and log-sum-exp ``[..., g, Lq]`` (:data:`UNSEEN_LSE` for rows that see no key,
    whose output is 0)."""
    rows = q.shape[:-2]  # (batch..., g)
    length, blk = q.shape[-2], spec.block
    num_kv = k.shape[-2] // blk

    def query_block(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        qi = _tile(q, i, blk, -2)

        def visit(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            mask = spec.tile_mask(i, j, seg, idx)

            def step(carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
                m, total, acc = carry
                s, _ = _scores(spec, qi, _tile(k, j, blk, -2), mask)
                m_new = jnp.maximum(m, s.max(-1))
                # a row that has seen no allowed key yet keeps m = -inf; shift by 0 instead to avoid inf - inf
                shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
                p = jnp.exp(s - shift[..., None])
                rescale = jnp.exp(m - shift)
                total = rescale * total + p.sum(-1)
                acc = rescale[..., None] * acc + jnp.einsum("...gqk,...kd->...gqd", p, _tile(v, j, blk, -2))
                return m_new, total, acc

            return spec.visit_if_seen(mask, step, carry)

        init = (
            jnp.full((*rows, blk), -jnp.inf, q.dtype),
            jnp.zeros((*rows, blk), q.dtype),
            jnp.zeros((*rows, blk, v.shape[-1]), q.dtype),
        )
        lo, hi = spec.kv_range(i, num_kv)
        m, total, acc = lax.fori_loop(lo, hi, visit, init)
        seen = total > 0
        safe_total = jnp.where(seen, total, 1.0)
        return acc / safe_total[..., None], jnp.where(seen, m + jnp.log(safe_total), UNSEEN_LSE)

    out, lse = lax.map(query_block, jnp.arange(length // blk, dtype=jnp.int32))
    return _unblock(out, 1, (*rows, length, v.shape[-1])), _unblock(lse, 0, (*rows, length))


def _unblock(stacked: jax.Array, features: int, shape: tuple[int, ...]) -> jax.Array:
    """Block results ``[n, ..., block, <features dims>]`` (from ``lax.map``) as ``shape`` (``n * block`` positions)."""
    return jnp.moveaxis(stacked, 0, -2 - features).reshape(shape)


def _with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The attention output and log-sum-exp with one more logit per row, ``sinks`` (broadcast to ``lse``'s shape),
    in the softmax's denominator and no value (gpt-oss's attention sinks); unchanged for None."""
    if sinks is None:
        return out, lse
    total = jnp.logaddexp(lse, sinks)
    return out * jnp.exp(lse - total)[..., None], total


def _sink_grad(sinks: jax.Array | None, lse: jax.Array, delta: jax.Array) -> jax.Array | None:
    """The gradient of the sink logits (None for None): a sink is one more column of the softmax whose value is 0,
    so its logit's gradient is ``p_sink * (0 - delta)`` per row, with ``p_sink = exp(sink - lse)`` (``lse`` the
    denominator's, sinks included), summed over the dimensions ``sinks`` is broadcast along."""
    if sinks is None:
        return None
    grad = -jnp.exp(sinks - lse) * delta
    axes = tuple(i for i, (n, m) in enumerate(zip(sinks.shape, grad.shape, strict=True)) if n == 1 and m != 1)
    return jnp.sum(grad, axis=axes, keepdims=True).astype(sinks.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(
    spec: _Spec,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_seg: jax.Array | None,
    k_seg: jax.Array | None,
    q_idx: jax.Array | None,
    k_idx: jax.Array | None,
    sinks: jax.Array | None,
) -> jax.Array:
    return _flash_fwd(spec, q, k, v, q_seg, k_seg, q_idx, k_idx, sinks)[0]


def _flash_fwd(
    spec: _Spec,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_seg: jax.Array | None,
    k_seg: jax.Array | None,
    q_idx: jax.Array | None,
    k_idx: jax.Array | None,
    sinks: jax.Array | None,
) -> tuple[jax.Array, tuple[Any, ...]]:
    out, lse = _forward(spec, q, k, v, _pair(q_seg, k_seg), _pair(q_idx, k_idx))
    out, lse = _with_sinks(out, lse, sinks)
    return out, (q, k, v, q_seg, k_seg, q_idx, k_idx, sinks, out, lse)


def _flash_bwd(spec: _Spec, res: tuple[Any, ...], dout: jax.Array) -> tuple[Any, ...]:
    q, k, v, q_seg, k_seg, q_idx, k_idx, sinks, out, lse = res
    delta = jnp.sum(dout * out, axis=-1)  # [..., g, L]: rowwise sum of dP * P
    dq, dk, dv = _key_block_grads(spec, q, k, v, _pair(q_seg, k_seg), _pair(q_idx, k_idx), dout, lse, delta)
    return dq, dk, dv, None, None, None, None, _sink_grad(sinks, lse, delta)


def _key_block_grads(
    spec: _Spec,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seg: _Ids,
    idx: _Ids,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of the queries ``q`` against one block of keys ``k``/``v``, given from outside the
    log-sum-exp ``lse [..., g, Lq]`` of the attention the gradient flows through (over these keys or more: ring
    attention passes the one over all its key blocks) and ``delta = rowsum(dout * out)`` of its output. ``dq`` is
    these keys' share of the query gradient; ``dk``/``dv`` are complete for this block.

    Probabilities are recomputed tile by tile, ``p = exp(s - lse)``, and the scores' gradient is
    ``ds = p * (dp - delta)`` (times ``1 - tanh²`` under a soft cap).
    """
    blk = spec.block
    num_q, num_kv = q.shape[-2] // blk, k.shape[-2] // blk

    def tile_grads(i: jax.Array, j: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Probabilities ``p`` and scaled-score gradients ``ds`` of tile (i, j), plus the query-side slices."""
        qi, doi = _tile(q, i, blk, -2), _tile(dout, i, blk, -2)
        s, slope = _scores(spec, qi, _tile(k, j, blk, -2), mask)
        p = jnp.exp(s - _tile(lse, i, blk, -1)[..., None])
        dp = jnp.einsum("...gqd,...kd->...gqk", doi, _tile(v, j, blk, -2))
        ds = p * (dp - _tile(delta, i, blk, -1)[..., None])  # wrt the (capped) logits
        if slope is not None:  # chain rule through cap * tanh(s / cap): wrt the scaled scores
            ds = ds * slope
        return p, ds, qi, doi

    def dq_block(i: jax.Array) -> jax.Array:
        def visit(j: jax.Array, dq: jax.Array) -> jax.Array:
            mask = spec.tile_mask(i, j, seg, idx)

            def step(dq: jax.Array) -> jax.Array:
                _, ds, _, _ = tile_grads(i, j, mask)
                return dq + jnp.einsum("...gqk,...kd->...gqd", ds, _tile(k, j, blk, -2))

            return spec.visit_if_seen(mask, step, dq)

        lo, hi = spec.kv_range(i, num_kv)
        init = jnp.zeros((*q.shape[:-2], blk, q.shape[-1]), q.dtype)
        return lax.fori_loop(lo, hi, visit, init) * spec.scale

    def dkv_block(j: jax.Array) -> tuple[jax.Array, jax.Array]:
        def visit(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            mask = spec.tile_mask(i, j, seg, idx)

            def step(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
                dk, dvj = carry
                p, ds, qi, doi = tile_grads(i, j, mask)
                dk = dk + jnp.einsum("...gqk,...gqd->...kd", ds, qi)
                return dk, dvj + jnp.einsum("...gqk,...gqd->...kd", p, doi)

            return spec.visit_if_seen(mask, step, carry)

        lo, hi = spec.q_range(j, num_q)
        kv_rows = k.shape[:-2]
        init = (jnp.zeros((*kv_rows, blk, k.shape[-1]), k.dtype), jnp.zeros((*kv_rows, blk, v.shape[-1]), v.dtype))
        dk, dvj = lax.fori_loop(lo, hi, visit, init)
        return dk * spec.scale, dvj

    dk, dv = lax.map(dkv_block, jnp.arange(num_kv, dtype=jnp.int32))
    dq = _unblock(lax.map(dq_block, jnp.arange(num_q, dtype=jnp.int32)), 1, q.shape)
    return dq, _unblock(dk, 1, k.shape), _unblock(dv, 1, v.shape)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _padded(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_seg: jax.Array | None,
    k_seg: jax.Array | None,
    *,
    block_size: int,
    causal: bool,
    window: int | None,
    scale: float,
    soft_cap: float | None,
    q_idx: jax.Array | None,
    k_idx: jax.Array | None,
) -> tuple[_Spec, tuple[Any, ...]]:
    """The :class:`_Spec` of a :func:`_flash_arrays` call and its inputs ``(q, k, v, q_seg, k_seg, q_idx, k_idx)``
    padded to a multiple of the block (segment ids and token indices None where the mask does not use them)."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    indexed = q_idx is not None and k_idx is not None and (causal or window is not None)
    if not indexed and q_len != k_len and (causal or window is not None):
        raise ValueError(f"flash attention: a causal mask over {q_len} queries and {k_len} keys needs token indices")
    blk = min(block_size, q_len, k_len)

    def pad_positions(x: jax.Array, axis: int) -> jax.Array:
        pad = -(-x.shape[axis] // blk) * blk - x.shape[axis]
        if not pad:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        return jnp.pad(x, widths, constant_values=-1 if jnp.issubdtype(x.dtype, jnp.integer) else 0)

    q, k, v = (pad_positions(x, x.ndim - 2) for x in (q, k, v))
    if q_seg is not None and k_seg is not None:
        q_seg, k_seg = pad_positions(q_seg, q_seg.ndim - 1), pad_positions(k_seg, k_seg.ndim - 1)
    else:
        q_seg = k_seg = None
    if indexed and q_idx is not None and k_idx is not None:
        q_idx, k_idx = pad_positions(q_idx.astype(jnp.int32), 0), pad_positions(k_idx.astype(jnp.int32), 0)
    else:
        q_idx = k_idx = None
    spec = _Spec(
        block=blk, length=k_len, causal=causal, window=window, scale=scale, soft_cap=soft_cap, indexed=indexed
    )
    return spec, (q, k, v, q_seg, k_seg, q_idx, k_idx)


def _flash_arrays(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_seg: jax.Array | None,
    k_seg: jax.Array | None,
    *,
    block_size: int,
    causal: bool,
    window: int | None,
    scale: float,
    soft_cap: float | None = None,
    q_idx: jax.Array | None = None,
    k_idx: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Flash attention on positional arrays: ``q [..., g, Lq, D]``, ``k [..., Lk, D]``, ``v [..., Lk, Dv]``.

    The leading ``...`` batch dimensions are kept as they are (no reshape, so their sharding is untouched);
    segment ids are ``[..., Lq]`` and ``[..., Lk]``. Without token indices a causal mask or window takes the queries
    and keys as the same positions (``Lq == Lk``) in order; with them (``q_idx [Lq]``, ``k_idx [Lk]``: the original
    index of each query and key, e.g. a device's queries against all keys under context parallelism), causality and
    windows compare the indices. Pads both lengths up to a multiple of the block (padded keys are masked, padded
    queries dropped). ``soft_cap`` (None: none) caps the scaled scores with ``soft_cap * tanh(s / soft_cap)``.
    ``sinks`` (None: none), ``[..., g, 1]`` (or broadcast dimensions of size 1), are per-head logits added to each
    softmax's denominator (gpt-oss's attention sinks).
    """
    q_len = q.shape[-2]
    spec, (q, k, v, q_seg, k_seg, q_idx, k_idx) = _padded(
        q,
        k,
        v,
        q_seg,
        k_seg,
        block_size=block_size,
        causal=causal,
        window=window,
        scale=scale,
        soft_cap=soft_cap,
        q_idx=q_idx,
        k_idx=k_idx,
    )
    return _flash(spec, q, k, v, q_seg, k_seg, q_idx, k_idx, sinks)[..., :q_len, :]


def _check_axes(Pos: Axis, HeadSize: Axis, query: NamedArray, key: NamedArray, value: NamedArray) -> None:
    for role, x in (("query", query), ("key", key), ("value", value)):
        if not x.has_axis(Pos.name):
            raise ValueError(f"flash_attention: the {role} has no position axis {Pos.name!r}; its axes: {x.axes}")
        if x.axis_size(Pos.name) != Pos.size:
            raise ValueError(
                f"flash_attention: the {role}'s axis {Pos.name!r} has size {x.axis_size(Pos.name)}, "
                f"expected {Pos.size}"
            )
    for role, x in (("query", query), ("key", key)):
        if not x.has_axis(HeadSize.name):
            raise ValueError(f"flash_attention: the {role} has no head axis {HeadSize.name!r}; its axes: {x.axes}")


def flash_attention(
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    scaling_factor: float | None = None,
    block_size: int = 128,
    dtype: Any = None,
    logit_soft_cap: float | None = None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """Blockwise attention with the contract of :func:`~ponente.models.dot_product_attention`.

    Query, key and value share the position axis ``Pos``. Axes of the query that the key lacks (e.g.
    ``q_heads_per_group``) broadcast (grouped-query / multi-query attention); the key's other axes
    (batch, kv heads) must also be on the query. Memory is O(seq * block): the ``(Pos, key_position)``
    scores are computed one ``block x block`` tile at a time, in forward and backward.

    A query that may attend to no key at all gets an output of 0 (the reference, which uses a large
    negative mask value instead of ``-inf``, averages all values there instead).

    Args:
        Pos: the position axis of query, key and value.
        HeadSize: the contracted per-head axis of query and key.
        query: ``(..., Pos, heads..., HeadSize)``.
        key: ``(..., Pos, kv heads..., HeadSize)``.
        value: the key's axes, except that ``HeadSize`` may be replaced by other feature axes.
        mask: an :class:`~ponente.models.AttentionMask` or None (no masking); with a ``token_index`` (over
            ``Pos`` alone), causality and windows follow it. Explicit boolean NamedArray masks are not supported by
            this backend.
        scaling_factor: multiplies the scores (None: ``1/sqrt(HeadSize.size)``).
        block_size: the tile size over positions (clipped to the sequence length; the sequence is padded
            to a multiple of it).
        dtype: the dtype of scores, softmax statistics and accumulators (None: at least float32).
        logit_soft_cap: caps the scaled scores with ``cap * tanh(scores / cap)`` before masking (Gemma 2); the
            gradients go through the cap. None: no cap.
        sinks: per-head sink logits over the query's head axes (gpt-oss), added to each softmax's denominator; the
            gradient reaches them. None: none.

    Returns:
        The attended values: the query's axes (with the value's feature axes in place of ``HeadSize``),
        in the dtype of ``query`` and ``value`` combined.

    Raises:
        ValueError: for sinks over an axis the query's heads lack, an explicit NamedArray mask, a block size or
            sliding window below 1, a soft cap that is not positive, or axes that do not line up (the message names
            the axis).

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> from ponente.models import AttentionMask
        >>> Pos, Heads, Hd = hax.make_axes(position=10, heads=2, head_size=4)
        >>> q = hax.random.normal(jax.random.key(0), (Pos, Heads, Hd))
        >>> flash_attention(Pos, Hd, q, q, q, AttentionMask.causal(), block_size=4).shape
        {'position': 10, 'heads': 2, 'head_size': 4}
        >>> flash_attention(Pos, Hd, q, q, q, AttentionMask.causal(), block_size=4, logit_soft_cap=50.0).shape
        {'position': 10, 'heads': 2, 'head_size': 4}
    """
    if isinstance(mask, NamedArray):
        raise ValueError(
            "flash_attention: the 'flash' attention backend computes masks per block and does not support an "
            "explicit NamedArray mask; pass an AttentionMask (causal, sliding_window, segment_ids) or use "
            "backend='reference'"
        )
    if block_size < 1:
        raise ValueError(f"flash_attention: block_size must be >= 1, got {block_size}")
    if mask is not None and mask.sliding_window is not None and mask.sliding_window < 1:
        raise ValueError(f"flash_attention: sliding_window must be >= 1, got {mask.sliding_window}")
    if logit_soft_cap is not None and not logit_soft_cap > 0:
        raise ValueError(f"flash_attention: logit_soft_cap must be positive (or None), got {logit_soft_cap}")
    _check_axes(Pos, HeadSize, query, key, value)
    skip = {Pos.name, HeadSize.name}
    kv_batch = tuple(ax for ax in key.axes if ax.name not in skip)
    for ax in kv_batch:
        if not query.has_axis(ax.name) or query.axis_size(ax.name) != ax.size:
            raise ValueError(
                f"flash_attention: the key's axis {ax} must also be on the query with the same size; query axes: "
                f"{query.axes}"
            )
        if not value.has_axis(ax.name) or value.axis_size(ax.name) != ax.size:
            raise ValueError(f"flash_attention: the key's axis {ax} is not on the value, whose axes are {value.axes}")
    batch_names = {ax.name for ax in kv_batch}
    q_extra = tuple(ax for ax in query.axes if ax.name not in skip and ax.name not in batch_names)
    v_feat = tuple(ax for ax in value.axes if ax.name != Pos.name and ax.name not in batch_names)
    clash = [ax.name for ax in v_feat if query.has_axis(ax.name) and ax.name != HeadSize.name]
    if clash:
        raise ValueError(f"flash_attention: the value's axes {clash} are on the query but not on the key")

    b = tuple(ax.size for ax in kv_batch)  # kept as separate dimensions: no reshape of (possibly sharded) batch axes
    g = math.prod(ax.size for ax in q_extra)
    dv = math.prod(ax.size for ax in v_feat)
    out_dtype = jnp.result_type(query.dtype, value.dtype)
    acc = jnp.dtype(dtype) if dtype is not None else jnp.promote_types(query.dtype, jnp.float32)
    q_raw = query.rearrange((*kv_batch, *q_extra, Pos, HeadSize)).array.reshape(*b, g, Pos.size, HeadSize.size)
    k_raw = key.rearrange((*kv_batch, Pos, HeadSize)).array.reshape(*b, Pos.size, HeadSize.size)
    v_raw = value.rearrange((*kv_batch, Pos, *v_feat)).array.reshape(*b, Pos.size, dv)

    seg: jax.Array | None = None
    if mask is not None and mask.segment_ids is not None:
        ids = mask.segment_ids
        if not ids.has_axis(Pos.name):
            raise ValueError(f"flash_attention: segment_ids need the position axis {Pos.name!r}; got {ids.axes}")
        extra = [ax.name for ax in ids.axes if ax.name != Pos.name and ax.name not in batch_names]
        if extra:
            raise ValueError(
                f"flash_attention: segment_ids axes {extra} are not batch axes of the key ({list(batch_names)})"
            )
        seg = hax.broadcast_to(ids, (*kv_batch, Pos)).array
    index: jax.Array | None = None
    if mask is not None and mask.token_index is not None:
        if mask.token_index.axes != (Pos,):
            raise ValueError(
                f"flash_attention: token_index must be over {Pos.name!r} alone, got {mask.token_index.axes}"
            )
        index = mask.token_index.array

    sink_rows: jax.Array | None = None
    if sinks is not None:
        heads = (*kv_batch, *q_extra)
        outside = [ax.name for ax in sinks.axes if ax.name not in {h.name for h in heads}]
        if outside:
            raise ValueError(f"flash_attention: sinks axes {outside} are not head axes of the query ({heads})")
        sink_rows = hax.broadcast_to(sinks, heads).array.reshape(*b, g, 1).astype(acc)
    out = _flash_arrays(
        q_raw.astype(acc),
        k_raw.astype(acc),
        v_raw.astype(acc),
        seg,
        seg,
        block_size=block_size,
        # a sliding window is causal too (``q - window < k <= q``), as in the reference mask
        causal=mask is not None and (mask.is_causal or mask.sliding_window is not None),
        window=None if mask is None else mask.sliding_window,
        scale=1.0 / math.sqrt(HeadSize.size) if scaling_factor is None else float(scaling_factor),
        soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
        q_idx=index,
        k_idx=index,
        sinks=sink_rows,
    )
    axes = (*kv_batch, *q_extra, Pos, *v_feat)
    named = NamedArray(out.reshape(tuple(ax.size for ax in axes)).astype(out_dtype), axes)
    if tuple(ax.name for ax in v_feat) == (HeadSize.name,):
        return named.rearrange(tuple(ax.name for ax in query.axes))
    return named.rearrange((*(ax.name for ax in query.axes if ax.name != HeadSize.name), *(ax.name for ax in v_feat)))
