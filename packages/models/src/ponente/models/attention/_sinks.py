"""Attention sinks (gpt-oss): a learned logit per head that joins the softmax's denominator but attends to nothing.

With a sink logit ``s`` per head, the weight of key ``k`` is ``exp(l_k) / (exp(s) + sum_j exp(l_j))``: the weights
of a query sum to less than one, so a head can attend to (almost) nothing. Both places that materialize the scores
use it: the ``reference`` backend and attention over a KV cache.
"""

from __future__ import annotations

import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray

__all__ = ["softmax_with_sinks"]


def softmax_with_sinks(logits: NamedArray, axis: str, sinks: NamedArray | None) -> NamedArray:
    """The softmax of ``logits`` over ``axis``, with one more (dropped) logit per head, ``sinks``, in the denominator.

    Computed in float32. Masked logits should hold float32's most negative value (their weight is then 0).

    Args:
        logits: ``(..., heads..., axis)`` attention logits.
        axis: the key axis the weights sum over.
        sinks: per-head sink logits whose axes are among ``logits``' (broadcast by name); None: a plain softmax.

    Returns:
        The weights (float32), ``logits``' axes.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> logits = hax.named(jnp.zeros((2, 3)), ("heads", "key_position"))
        >>> sinks = hax.named(jnp.array([-jnp.inf, jnp.log(3.0)]), "heads")
        >>> [round(float(w), 4) for w in softmax_with_sinks(logits, "key_position", sinks)["key_position", 0].array]
        [0.3333, 0.1667]
    """
    logits = logits.astype(jnp.float32)
    if sinks is None:
        return hax.nn.softmax(logits, axis=axis)
    sinks = sinks.astype(jnp.float32)
    top = hax.maximum(hax.max(logits, axis=axis), sinks)
    exp = hax.exp(logits - top)
    return exp / (hax.sum(exp, axis=axis) + hax.exp(sinks - top))
