"""Normalizing functions over named axes: softmax, log-softmax, logsumexp, standardize, one-hot."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..axis import Axis, AxisSelection
from ..core import NamedArray, broadcast_to
from ..util import ensure_tuple
from ..wrap import wrap_reduction_call

__all__ = ["log_softmax", "logsumexp", "one_hot", "softmax", "standardize"]


def _positions(x: NamedArray, axis: AxisSelection, what: str) -> tuple[int, ...]:
    if not isinstance(x, NamedArray):
        raise TypeError(f"{what}: expected a NamedArray, got {type(x).__name__}")
    sel: tuple[Any, ...] = tuple(axis) if isinstance(axis, dict) else tuple(ensure_tuple(axis))
    out = []
    for a in sel:
        if not x.has_axis(a):
            name = a.name if isinstance(a, Axis) else a
            raise ValueError(f"{what}: axis {name!r} is not in the array, whose axes are {x.axis_names}")
        out.append(x._index_of(a))
    return tuple(out)


def _where(x: NamedArray, where: NamedArray | None) -> Any:
    return None if where is None else broadcast_to(where, x.axes).array


def softmax(a: NamedArray, axis: AxisSelection, *, where: NamedArray | None = None) -> NamedArray:
    """Softmax over one axis or several axes jointly (``exp(x) / sum(exp(x))``).

    Args:
        a: the logits.
        axis: the axis or axes to normalize over.
        where: optional boolean mask (axes a subset of ``a``'s); masked-out elements get probability 0.

    Returns:
        Probabilities with ``a``'s axes, summing to 1 over ``axis``.

    Raises:
        ValueError: if an axis is not in ``a``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> p = softmax(hax.zeros({"b": 2, "vocab": 4}), "vocab")
        >>> p.array[0].tolist()
        [0.25, 0.25, 0.25, 0.25]
    """
    pos = _positions(a, axis, "softmax")
    return NamedArray(jax.nn.softmax(a.array, axis=pos, where=_where(a, where)), a.axes)


def log_softmax(a: NamedArray, axis: AxisSelection, *, where: NamedArray | None = None) -> NamedArray:
    """Log of the softmax over one axis or several axes jointly: ``x - logsumexp(x)``.

    Args:
        a: the logits.
        axis: the axis or axes to normalize over.
        where: optional boolean mask (axes a subset of ``a``'s) of the elements to include.

    Returns:
        Log-probabilities with ``a``'s axes.

    Raises:
        ValueError: if an axis is not in ``a``.
    """
    pos = _positions(a, axis, "log_softmax")
    return NamedArray(jax.nn.log_softmax(a.array, axis=pos, where=_where(a, where)), a.axes)


def logsumexp(a: NamedArray, axis: AxisSelection | None = None) -> NamedArray:
    """``log(sum(exp(x)))`` over the given axes, computed stably.

    Args:
        a: the input.
        axis: the axis or axes to reduce; ``None`` reduces all of them.

    Returns:
        The reduced array (the other axes keep their order).

    Raises:
        ValueError: if an axis is not in ``a``.
    """
    if axis is not None:
        _positions(a, axis, "logsumexp")
    return wrap_reduction_call(jax.nn.logsumexp, a, axis, supports_where=False)


def standardize(
    x: NamedArray,
    axis: AxisSelection,
    *,
    mean: NamedArray | None = None,
    variance: NamedArray | None = None,
    epsilon: float = 1e-5,
    where: NamedArray | None = None,
) -> NamedArray:
    """Normalizes ``x`` to zero mean and unit variance over ``axis``: ``(x - mean) / sqrt(variance + epsilon)``.

    Args:
        x: the input.
        axis: the axis or axes to standardize over.
        mean: a precomputed mean (axes of ``x`` minus ``axis``); computed when None.
        variance: a precomputed variance; computed when None.
        epsilon: added to the variance for numerical stability.
        where: optional boolean mask of the elements used to compute the statistics.

    Returns:
        The standardized array with ``x``'s axes.

    Raises:
        ValueError: if an axis is not in ``x``.
    """
    pos = _positions(x, axis, "standardize")
    w = _where(x, where)
    if mean is None:
        m = jnp.mean(x.array, axis=pos, keepdims=True, where=w)
    else:
        m = jnp.expand_dims(broadcast_to(mean, _kept(x, pos)).array, pos)
    if variance is None:
        v = jnp.mean(jnp.square(x.array - m), axis=pos, keepdims=True, where=w)
    else:
        v = jnp.expand_dims(broadcast_to(variance, _kept(x, pos)).array, pos)
    return NamedArray((x.array - m) * jax.lax.rsqrt(v + epsilon), x.axes)


def _kept(x: NamedArray, pos: tuple[int, ...]) -> tuple[Axis, ...]:
    return tuple(ax for i, ax in enumerate(x.axes) if i not in pos)


def one_hot(x: NamedArray | int, class_axis: Axis, *, dtype: Any = None) -> NamedArray:
    """One-hot encoding of integer labels along a new class axis.

    Args:
        x: integer labels: a NamedArray, or a single label (a Python int or a 0-d integer array).
        class_axis: the class axis (its size is the number of classes); appended after ``x``'s axes.
        dtype: the result dtype (default float32).

    Out-of-range labels in a NamedArray give all-zero rows. A single label is an index into the classes,
    so a negative one counts from the end as in Python (``-1`` is the last class).

    Returns:
        A NamedArray with axes ``x.axes + (class_axis,)``.

    Raises:
        ValueError: if ``x`` already has an axis named like ``class_axis``, or a Python int is out of range.
        TypeError: if a single label is not a scalar of integer (or bool) dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> import ponente.namedtensor as hax
        >>> one_hot(hax.named(jnp.array([0, 2]), "b"), hax.Axis("cls", 3)).array.tolist()
        [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    """
    dtype = jnp.float32 if dtype is None else dtype
    if isinstance(x, NamedArray):
        if x.has_axis(class_axis.name):
            raise ValueError(f"one_hot: the labels already have an axis named {class_axis.name!r}")
        return NamedArray(jax.nn.one_hot(x.array, class_axis.size, dtype=dtype), (*x.axes, class_axis))
    n = class_axis.size
    label = jnp.asarray(x)
    if label.ndim != 0 or not (jnp.issubdtype(label.dtype, jnp.integer) or label.dtype == jnp.bool_):
        raise TypeError(
            f"one_hot: a label that is not a NamedArray must be an integer scalar, got dtype {label.dtype} and "
            f"shape {label.shape} (name the axes of an array of labels with hax.named)"
        )
    if isinstance(x, int) and not -n <= x < n:
        raise ValueError(f"one_hot: label {x} is out of range for class axis {class_axis.name!r} of size {n}")
    label = jnp.where(label < 0, label + n, label)
    return NamedArray(jax.nn.one_hot(label, n, dtype=dtype), (class_axis,))
