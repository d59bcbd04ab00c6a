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
    "forgetful_causal_mask",
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
    scaling_factor: float | None = None,
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
        scaling_factor: multiplies the logits (default ``1 / sqrt(|Key|)``).

    Returns:
        The weights: query's axes minus ``Key`` plus ``KPos``, in the query's dtype.

    Raises:
        ValueError: if the query carries a ``KPos`` axis or axes do not line up.
    """
    kpos = _names(KPos)
    clash = [n for n in kpos if query.has_axis(n)]
    if clash:
        raise ValueError(
            f"attention: query and key positions must be distinct axes, but the query also has the key-position "
            f"axes {clash}; rename the key/value position axis (e.g. key.rename({{'position': 'key_position'}}))"
        )
    missing = [n for n in kpos if not key.has_axis(n)]
    if missing:
        raise ValueError(
            f"attention: key-position axes {missing} not found in the key, whose axes are {key.axis_names}"
        )
    orig_dtype = query.dtype
    scale = 1.0 / math.sqrt(query.axis_size(Key)) if scaling_factor is None else scaling_factor
    query = query * scale
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


Start = int | jax.Array | NamedArray
"""An absolute start position: an int, a traced scalar, or a NamedArray of starts (e.g. one per batch row)."""


def _positions(Ax: Axis, start: Start) -> NamedArray:
    """Absolute positions along ``Ax``; a NamedArray ``start`` adds its axes in front."""
    offsets = jnp.arange(Ax.size)
    if isinstance(start, NamedArray):
        return NamedArray(start.array[..., None] + offsets, (*start.axes, Ax))
    return NamedArray(offsets + start, (Ax,))


def _pairwise(fn: Any, q: NamedArray, k: NamedArray) -> NamedArray:
    """``fn(q_pos, k_pos)`` over the union of both position arrays' axes."""
    a, b = _union(q, k)
    return NamedArray(fn(a.array, b.array), a.axes)


def _union(a: NamedArray, b: NamedArray) -> tuple[NamedArray, NamedArray]:
    axes = a.axes + tuple(ax for ax in b.axes if not a.has_axis(ax.name))
    return broadcast_to(a, axes), broadcast_to(b, axes)


def causal_mask(QPos: Axis, KPos: Axis, q_start: Start = 0, k_start: Start = 0) -> NamedArray:
    """The causal mask: query position ``i`` may attend to key position ``j`` iff ``j <= i``.

    Args:
        QPos: the query-position axis.
        KPos: the key-position axis.
        q_start: absolute position of the first query (e.g. when decoding with a cache); a NamedArray
            gives one start per entry of its axes (which the mask then has too).
        k_start: absolute position of the first key (same rules).

    Returns:
        A boolean mask with axes ``(QPos, KPos)`` (plus the axes of NamedArray starts).
    """
    return _pairwise(jnp.greater_equal, _positions(QPos, q_start), _positions(KPos, k_start))


def sliding_window_mask(QPos: Axis, KPos: Axis, window: int, q_start: Start = 0, k_start: Start = 0) -> NamedArray:
    """Causal attention limited to the last ``window`` positions: ``i - window < j <= i``.

    Args:
        QPos: the query-position axis.
        KPos: the key-position axis.
        window: how many positions (the query's own included) each query sees.
        q_start: absolute position of the first query (an int, a scalar or a NamedArray of starts).
        k_start: absolute position of the first key.

    Returns:
        A boolean mask with axes ``(QPos, KPos)`` (plus the axes of NamedArray starts).

    Raises:
        ValueError: if ``window`` is less than 1.
    """
    if window < 1:
        raise ValueError(f"sliding_window_mask: window must be at least 1, got {window}")
    return _pairwise(lambda q, k: (k <= q) & (q - k < window), _positions(QPos, q_start), _positions(KPos, k_start))


def prefix_lm_mask(
    QSeqLen: Axis, KSeqLen: Axis, prefix_len: int | jax.Array, q_start: Start = 0, k_start: Start = 0
) -> NamedArray:
    """Prefix-LM mask: every query sees the first ``prefix_len`` keys bidirectionally, the rest causally.

    Args:
        QSeqLen: the query-position axis.
        KSeqLen: the key-position axis.
        prefix_len: the length of the bidirectional prefix, counted from the first key.
        q_start: absolute position of the first query.
        k_start: absolute position of the first key.

    Returns:
        A boolean mask with axes ``(QSeqLen, KSeqLen)`` (plus the axes of NamedArray starts).

    Raises:
        ValueError: if ``prefix_len`` is a negative int.
    """
    if isinstance(prefix_len, int) and prefix_len < 0:
        raise ValueError(f"prefix_lm_mask: prefix_len must be >= 0, got {prefix_len}")
    prefix = NamedArray(jnp.arange(KSeqLen.size) < prefix_len, (KSeqLen,))
    causal = causal_mask(QSeqLen, KSeqLen, q_start, k_start)
    return NamedArray(causal.array | broadcast_to(prefix, causal.axes).array, causal.axes)


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


def forgetful_causal_mask(KPos: Axis, mask_prob: float, sample_prob: bool = True, *, key: jax.Array) -> NamedArray:
    """Forgetful causal masking (Liu et al. 2022): drop random key positions, always keeping position 0.

    Args:
        KPos: the key-position axis.
        mask_prob: probability of dropping a position.
        sample_prob: if True, the drop probability is itself drawn uniformly from ``[0, mask_prob]``.
        key: the PRNG key.

    Returns:
        A boolean mask over ``KPos`` (combine it with :func:`causal_mask`).

    Raises:
        ValueError: if ``mask_prob`` is outside ``[0, 1]``.
    """
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"forgetful_causal_mask: mask_prob must be in [0, 1], got {mask_prob}")
    first = jnp.arange(KPos.size) == 0
    prob: Any = mask_prob
    if sample_prob and 0.0 < mask_prob < 1.0:
        key, sub = jax.random.split(key)
        prob = jax.random.uniform(sub, (), minval=0.0, maxval=mask_prob)
    keep = jax.random.bernoulli(key, 1.0 - prob, (KPos.size,))
    return NamedArray(keep | first, (KPos,))


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
