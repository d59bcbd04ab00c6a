"""The reference attention backend: scores materialized over ``(position, key_position)``, then a softmax.

It is the readable definition every other backend is tested against, and the one that supports everything:
any :class:`~ponente.models.AttentionMask`, explicit boolean masks, logit soft-capping (Gemma 2) and attention sinks
(gpt-oss).
"""

from __future__ import annotations

import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import attention as hattn

from ._mask import AttentionMask
from ._sinks import softmax_with_sinks

__all__ = ["KEY_POSITION", "dot_product_attention", "reference_attention", "soft_capped_attention"]

KEY_POSITION = "key_position"


def dot_product_attention(
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    scaling_factor: float | None = None,
) -> NamedArray:
    """Reference attention where query, key and value share the position axis ``Pos``.

    The key and value position axis is renamed to ``key_position``. Heads may be grouped: axes of
    the query that the key lacks (e.g. ``q_heads_per_group``) broadcast, which is grouped-query attention.

    Args:
        Pos: the position axis of query, key and value.
        HeadSize: the contracted per-head axis.
        query: ``(..., Pos, heads..., HeadSize)``.
        key: ``(..., Pos, kv heads..., HeadSize)``.
        value: like ``key``.
        mask: an :class:`AttentionMask`, an explicit boolean mask over ``(Pos, key_position)``, or None.
        scaling_factor: multiplies the scores (None: ``1/sqrt(HeadSize.size)``).

    Returns:
        The attended values with the query's axes.
    """
    KPos = Pos.alias(KEY_POSITION)
    key = key.rename({Pos.name: KPos.name})
    value = value.rename({Pos.name: KPos.name})
    explicit = mask.materialize(Pos, KPos) if isinstance(mask, AttentionMask) else mask
    scale = 1.0 / (HeadSize.size**0.5) if scaling_factor is None else scaling_factor
    # The scores and weights take the query's axis order. Putting the axes shared with the key (batch, kv
    # heads) first makes that order the one ``dot_general`` produces, ``(batch..., Pos, group..., KPos)``, so
    # neither the scores nor their gradients are transposed; grouped query heads join ``Pos`` in the rows of
    # one matmul per kv head instead of repeating the keys.
    shared = tuple(ax for ax in query.axes if ax.name not in (Pos.name, HeadSize.name) and key.has_axis(ax.name))
    rest = tuple(ax for ax in query.axes if ax.name != HeadSize.name and not key.has_axis(ax.name))
    q = query.rearrange((*shared, *rest, query.resolve_axis(HeadSize.name)))
    weights = hattn.dot_product_attention_weights(HeadSize, KPos, q, key, explicit, scaling_factor=scale)
    return hax.dot(weights, value, axis=KPos.name).rearrange(query.axes)


def soft_capped_attention(
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    scaling_factor: float | None,
    soft_cap: float | None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """Reference attention whose scaled logits are soft-capped (``cap * tanh(logits / cap)``) before masking, and
    whose softmax may have sinks.

    Same contract as :func:`dot_product_attention`; the softmax runs in float32 and masked logits take
    float32's most negative value (as transformers' eager Gemma 2 and gpt-oss attention).

    Args:
        Pos: the position axis of query, key and value.
        HeadSize: the contracted per-head axis.
        query: ``(..., Pos, heads..., HeadSize)``.
        key: ``(..., Pos, kv heads..., HeadSize)``.
        value: like ``key``.
        mask: an :class:`AttentionMask`, an explicit boolean mask over ``(Pos, key_position)``, or None.
        scaling_factor: multiplies the logits before the cap (None: ``1/sqrt(HeadSize.size)``).
        soft_cap: the cap (positive), or None: no cap.
        sinks: per-head sink logits over the query's head axes (see
            :func:`~ponente.models.attention._sinks.softmax_with_sinks`), or None.

    Returns:
        The attended values with the query's axes (the value's dtype).
    """
    KPos = Pos.alias(KEY_POSITION)
    key = key.rename({Pos.name: KPos.name})
    value = value.rename({Pos.name: KPos.name})
    explicit = mask.materialize(Pos, KPos) if isinstance(mask, AttentionMask) else mask
    scale = 1.0 / (HeadSize.size**0.5) if scaling_factor is None else scaling_factor
    logits = hax.dot(query, key, axis=HeadSize.name).astype(jnp.float32) * scale
    if soft_cap is not None:
        logits = soft_cap * hax.tanh(logits / soft_cap)
    if explicit is not None:
        logits = hax.where(explicit, logits, jnp.finfo(jnp.float32).min)
    weights = softmax_with_sinks(logits, KPos.name, sinks).astype(value.dtype)
    return hax.dot(weights, value, axis=KPos.name).rearrange(query.axes)


def reference_attention(
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    scaling_factor: float | None = None,
    block_size: int = 128,
    logit_soft_cap: float | None = None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """The ``"reference"`` backend: :func:`dot_product_attention`, or :func:`soft_capped_attention` with a cap or
    sinks.

    ``block_size`` is accepted for the common backend signature and ignored.
    """
    del block_size
    if logit_soft_cap is None and sinks is None:
        return dot_product_attention(Pos, HeadSize, query, key, value, mask, scaling_factor=scaling_factor)
    return soft_capped_attention(
        Pos, HeadSize, query, key, value, mask, scaling_factor=scaling_factor, soft_cap=logit_soft_cap, sinks=sinks
    )
