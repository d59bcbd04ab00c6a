"""Dot-product attention over named axes, attention masks and biases.

Masks are boolean NamedArrays (True = may attend) over a query-position axis and a key-position
axis; they combine with :func:`combine_masks_and` / :func:`combine_masks_or` and broadcast by name
into the attention weights. The query and key position axes must have different names (rename the
key side, e.g. ``key.rename({"position": "key_position"})``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from ..axis import Axis, AxisSelection, AxisSelector, axis_name
from ..core import NamedArray, broadcast_to
from ..dot import dot
from ..random import bernoulli
from .functional import softmax

__all__ = [
    "alibi_attention_bias",
    "causal_mask",
    "combine_masks_and",
    "combine_masks_or",
    "dot_product_attention",
    "dot_product_attention_weights",
    "dropout_mask",
    "mask_to_bias",
    "prefix_lm_mask",
    "segment_mask",
    "sliding_window_mask",
]

_MASK_VALUE = -1e9


def _names(sel: AxisSelection) -> tuple[str, ...]:
    n = axis_name(sel)
    return (n,) if isinstance(n, str) else tuple(n)


def dot_product_attention_weights(
    Key: AxisSelector,
    KPos: AxisSelection,
    query: NamedArray,
    key: NamedArray,
    mask: NamedArray | None = None,
    bias: NamedArray | None = None,
    attention_dtype: Any = None,
    precision: Any = None,
) -> NamedArray:
    """Attention probabilities ``softmax(q · k / sqrt(|Key|) + bias, masked)`` over the key positions.

    Args:
        Key: the head-dimension axis contracted between query and key.
        KPos: the key-position axis, or several axes (e.g. ``("block", "key_position")``) normalized jointly.
        query: the queries (with ``Key``, a query-position axis and any batch/head axes).
        key: the keys (with ``Key``, the ``KPos`` axes and batch/head axes shared with the query).
        mask: boolean, True where attending is allowed; its axes must be a subset of the weights' axes.
        bias: added to the logits before masking (e.g. :func:`alibi_attention_bias`).
        attention_dtype: dtype for the logits and softmax (e.g. float32 under bf16 compute).
        precision: passed to the contraction.

    Returns:
        The weights: query's axes minus ``Key`` plus ``KPos``, in the query's dtype.

    Raises:
        ValueError: if the query carries a ``KPos`` axis or axes do not line up.
    """
    kpos = _names(KPos)
    clash = [n for n in kpos if query.has_axis(n)]
    if clash:
        raise ValueError(
            f"attention: the query already has the key-position axes {clash}; rename the key/value position axis "
            "so query and key positions have different names"
        )
    missing = [n for n in kpos if not key.has_axis(n)]
    if missing:
        raise ValueError(f"attention: key-position axes {missing} are not in the key, whose axes are {key.axis_names}")
    orig_dtype = query.dtype
    query = query / math.sqrt(query.axis_size(Key))
    if attention_dtype is not None:
        query = query.astype(attention_dtype)
        key = key.astype(attention_dtype)
    weights = dot(query, key, axis=Key, precision=precision)
    if bias is not None:
        weights = weights + bias
    if mask is not None:
        m = broadcast_to(mask, weights.axes, enforce_no_extra_axes=True)
        weights = NamedArray(jnp.where(m.array, weights.array, jnp.asarray(_MASK_VALUE, weights.dtype)), weights.axes)
    return softmax(weights, kpos).astype(orig_dtype)


def dot_product_attention(
    KPos: AxisSelection,
    Key: AxisSelector,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: NamedArray | None = None,
    bias: NamedArray | None = None,
    attention_dtype: Any = None,
    precision: Any = None,
) -> NamedArray:
    """Scaled dot-product attention: the attention weights applied to ``value`` (summed over ``KPos``).

    Args:
        KPos: the key-position axis or axes.
        Key: the head-dimension axis of query and key.
        query: the queries.
        key: the keys (with the ``KPos`` axes).
        value: the values (with the ``KPos`` axes; may have a head-dimension axis different from ``Key``).
        mask: boolean mask, True where attending is allowed.
        bias: additive logit bias.
        attention_dtype: dtype for the logits and softmax.
        precision: passed to the contractions.

    Returns:
        The query's axes minus ``Key``, plus the value's axes that are not ``KPos`` or shared.

    Raises:
        ValueError: if the query carries a ``KPos`` axis or axes do not line up.

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> Pos, KPos, Head = hax.Axis("pos", 4), hax.Axis("key_pos", 4), hax.Axis("head", 8)
        >>> q = hax.random.normal(jax.random.key(0), (Pos, Head))
        >>> k = hax.random.normal(jax.random.key(1), (KPos, Head))
        >>> dot_product_attention(KPos, Head, q, k, k, mask=causal_mask(Pos, KPos)).shape
        {'pos': 4, 'head': 8}
    """
    weights = dot_product_attention_weights(Key, KPos, query, key, mask, bias, attention_dtype, precision)
    return dot(weights, value, axis=_names(KPos), precision=precision)


def _positions(Ax: Axis, start: Any) -> jax.Array:
    return jnp.arange(Ax.size) + start


def causal_mask(QPos: Axis, KPos: Axis, q_start: int | jax.Array = 0, k_start: int | jax.Array = 0) -> NamedArray:
    """The causal mask: query position ``i`` may attend to key position ``j`` iff ``j <= i``.

    Args:
        QPos: the query-position axis.
        KPos: the key-position axis.
        q_start: absolute position of the first query (e.g. when decoding with a cache).
        k_start: absolute position of the first key.

    Returns:
        A boolean mask with axes ``(QPos, KPos)``.
    """
    q = _positions(QPos, q_start)[:, None]
    k = _positions(KPos, k_start)[None, :]
    return NamedArray(q >= k, (QPos, KPos))


def sliding_window_mask(
    QPos: Axis, KPos: Axis, window: int, q_start: int | jax.Array = 0, k_start: int | jax.Array = 0
) -> NamedArray:
    """Causal attention limited to the last ``window`` positions: ``i - window < j <= i``.

    Args:
        QPos: the query-position axis.
        KPos: the key-position axis.
        window: how many positions (the query's own included) each query sees.
        q_start: absolute position of the first query.
        k_start: absolute position of the first key.

    Returns:
        A boolean mask with axes ``(QPos, KPos)``.

    Raises:
        ValueError: if ``window`` is less than 1.
    """
    if window < 1:
        raise ValueError(f"sliding_window_mask: window must be at least 1, got {window}")
    q = _positions(QPos, q_start)[:, None]
    k = _positions(KPos, k_start)[None, :]
    return NamedArray((k <= q) & (q - k < window), (QPos, KPos))


def prefix_lm_mask(
    QSeqLen: Axis,
    KSeqLen: Axis,
    prefix_len: int | jax.Array,
    q_start: int | jax.Array = 0,
    k_start: int | jax.Array = 0,
) -> NamedArray:
    """Prefix-LM mask: every query sees the first ``prefix_len`` positions bidirectionally, the rest causally.

    Args:
        QSeqLen: the query-position axis.
        KSeqLen: the key-position axis.
        prefix_len: the length of the bidirectional prefix (absolute key positions ``< prefix_len``).
        q_start: absolute position of the first query.
        k_start: absolute position of the first key.

    Returns:
        A boolean mask with axes ``(QSeqLen, KSeqLen)``.
    """
    k = _positions(KSeqLen, k_start)[None, :]
    prefix = NamedArray(jnp.broadcast_to(k < prefix_len, (QSeqLen.size, KSeqLen.size)), (QSeqLen, KSeqLen))
    return causal_mask(QSeqLen, KSeqLen, q_start, k_start) | prefix


def _union(a: NamedArray, b: NamedArray) -> tuple[NamedArray, NamedArray]:
    axes = a.axes + tuple(ax for ax in b.axes if not a.has_axis(ax.name))
    return broadcast_to(a, axes), broadcast_to(b, axes)


def segment_mask(q_segment_ids: NamedArray, kv_segment_ids: NamedArray) -> NamedArray:
    """Block-diagonal mask for packed sequences: attend only within the same segment (document).

    Args:
        q_segment_ids: integer segment ids over the query positions (plus optional batch axes).
        kv_segment_ids: integer segment ids over the key positions; the position axis must have a
            different name from the query's (shared batch axes are matched by name).

    Returns:
        A boolean mask over the union of both inputs' axes, True where the segment ids are equal.

    Example:
        >>> import jax.numpy as jnp
        >>> import ponente.namedtensor as hax
        >>> ids = jnp.array([0, 0, 1])
        >>> m = segment_mask(hax.named(ids, "pos"), hax.named(ids, "key_pos"))
        >>> m.array.astype(int).tolist()
        [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    """
    q, k = _union(q_segment_ids, kv_segment_ids)
    return NamedArray(q.array == k.array, q.axes)


def _combine(op: Any, mask1: NamedArray | None, mask2: NamedArray | None) -> NamedArray | None:
    if mask1 is None:
        return mask2
    if mask2 is None:
        return mask1
    a, b = _union(mask1, mask2)
    return NamedArray(op(a.array, b.array), a.axes)


def combine_masks_and(mask1: NamedArray | None, mask2: NamedArray | None) -> NamedArray | None:
    """Both masks allow (logical and), broadcasting over the union of their axes; None means "no mask".

    Args:
        mask1: a boolean mask or None.
        mask2: a boolean mask or None.

    Returns:
        The combined mask, or None if both are None.
    """
    return _combine(jnp.logical_and, mask1, mask2)


def combine_masks_or(mask1: NamedArray | None, mask2: NamedArray | None) -> NamedArray | None:
    """Either mask allows (logical or), broadcasting over the union of their axes; None means "no mask".

    Args:
        mask1: a boolean mask or None.
        mask2: a boolean mask or None.

    Returns:
        The combined mask, or None if both are None.
    """
    return _combine(jnp.logical_or, mask1, mask2)


def mask_to_bias(mask: NamedArray, mask_value: float = _MASK_VALUE) -> NamedArray:
    """Turns a boolean mask into an additive logit bias: 0 where allowed, ``mask_value`` elsewhere.

    Args:
        mask: the boolean mask.
        mask_value: the bias of masked-out positions.

    Returns:
        A float32 NamedArray with the mask's axes.
    """
    return NamedArray(jnp.where(mask.array, 0.0, mask_value).astype(jnp.float32), mask.axes)


def dropout_mask(axes: Any, dropout_rate: float, *, key: jax.Array) -> NamedArray:
    """A random boolean mask keeping each element with probability ``1 - dropout_rate``.

    Args:
        axes: the mask's axes.
        dropout_rate: probability of masking out an element.
        key: the PRNG key.

    Returns:
        The boolean mask.
    """
    return bernoulli(key, axes, 1.0 - dropout_rate)


def _alibi_slopes(n: int, bias_max: float) -> list[float]:
    def powers(m: int) -> list[float]:
        return [2.0 ** (-bias_max * (i + 1) / m) for i in range(m)]

    if n & (n - 1) == 0:
        return powers(n)
    closest = 2 ** math.floor(math.log2(n))
    return powers(closest) + powers(2 * closest)[0::2][: n - closest]


def alibi_attention_bias(Heads: Axis, KPos: Axis, bias_max: float = 8, dtype: Any = jnp.float32) -> NamedArray:
    """ALiBi bias (Press et al. 2022): head ``h`` adds ``slope_h * j`` to the logit of key position ``j``.

    Slopes are ``2^(-bias_max (h + 1) / n)`` for ``n`` heads a power of two (interleaved from the next
    power of two otherwise). Adding ``slope * j`` rather than ``-slope * (i - j)`` is the same after the
    softmax, which is invariant to a per-query shift.

    Args:
        Heads: the head axis.
        KPos: the key-position axis.
        bias_max: the largest exponent (8 in the paper).
        dtype: the bias dtype.

    Returns:
        The bias with axes ``(Heads, KPos)``.
    """
    slopes = jnp.asarray(_alibi_slopes(Heads.size, bias_max), dtype)
    pos = jnp.arange(KPos.size, dtype=dtype)
    return NamedArray(slopes[:, None] * pos[None, :], (Heads, KPos))
