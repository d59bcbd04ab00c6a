"""Data-dependent results with a static size: ``unique*``, ``bincount``, ``nonzero``.

Under ``jit`` a result's size must be known at trace time, so each of these takes the result axis (with
its size) explicitly, padding with a fill value when there are fewer results.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .axis import Axis, AxisSelector
from .core import NamedArray, broadcast_to

__all__ = ["bincount", "nonzero", "unique", "unique_all", "unique_counts", "unique_inverse", "unique_values"]


def _flat_unique(
    array: NamedArray, Unique: Axis, axis: AxisSelector | None, fill_value: Any, **flags: bool
) -> tuple[Any, ...]:
    if not isinstance(Unique, Axis):
        raise TypeError(f"unique needs the result axis with its static size, e.g. Axis('unique', 8); got {Unique!r}")
    if axis is None:
        out = jnp.unique(array.array.reshape(-1), size=Unique.size, fill_value=fill_value, **flags)
        return out if isinstance(out, tuple) else (out,)
    pos = array._index_of(axis)
    out = jnp.unique(array.array, size=Unique.size, fill_value=fill_value, axis=pos, **flags)
    return out if isinstance(out, tuple) else (out,)


def unique(
    array: NamedArray,
    Unique: Axis,
    *,
    return_index: bool = False,
    return_inverse: bool = False,
    return_counts: bool = False,
    axis: AxisSelector | None = None,
    fill_value: Any = None,
) -> NamedArray | tuple[NamedArray, ...]:
    """The sorted unique values, padded to the static size of ``Unique``.

    Args:
        array: the named array.
        Unique: the result axis; its size is the number of slots (padding with ``fill_value``, by default the
            smallest value).
        return_index: also return the (flattened) index of each unique value's first occurrence.
        return_inverse: also return, for each element of ``array``, the slot of its value (axes of ``array``).
        return_counts: also return how often each unique value occurs.
        axis: if given, unique slices along this axis, which ``Unique`` replaces in place.
        fill_value: the padding value.

    Returns:
        The values, or a tuple ``(values, [index], [inverse], [counts])``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.unique(hax.named(jnp.array([3, 1, 3]), "a"), hax.Axis("u", 2)).array.tolist()
        [1, 3]
    """
    outs = _flat_unique(
        array,
        Unique,
        axis,
        fill_value,
        return_index=return_index,
        return_inverse=return_inverse,
        return_counts=return_counts,
    )
    if axis is None:
        values = NamedArray(outs[0], (Unique,))
    else:
        pos = array._index_of(axis)
        values = NamedArray(outs[0], (*array.axes[:pos], Unique, *array.axes[pos + 1 :]))
    results: list[NamedArray] = [values]
    k = 1
    if return_index:
        results.append(NamedArray(outs[k], (Unique,)))
        k += 1
    if return_inverse:
        inv = outs[k]
        if axis is None:
            results.append(NamedArray(inv.reshape(array.array.shape), array.axes))
        else:
            results.append(NamedArray(inv.reshape(-1), (array.resolve_axis(axis),)))
        k += 1
    if return_counts:
        results.append(NamedArray(outs[k], (Unique,)))
    return results[0] if len(results) == 1 else tuple(results)


def unique_values(
    array: NamedArray, Unique: Axis, *, axis: AxisSelector | None = None, fill_value: Any = None
) -> NamedArray:
    """The sorted unique values (of all elements, or slices along ``axis``), padded to ``Unique.size``."""
    return unique(array, Unique, axis=axis, fill_value=fill_value)  # type: ignore[return-value]


def unique_counts(
    array: NamedArray, Unique: Axis, *, axis: AxisSelector | None = None, fill_value: Any = None
) -> tuple[NamedArray, NamedArray]:
    """``(values, counts)``: the unique values and how often each occurs (padding counts are 0)."""
    return unique(array, Unique, return_counts=True, axis=axis, fill_value=fill_value)  # type: ignore[return-value]


def unique_inverse(
    array: NamedArray, Unique: Axis, *, axis: AxisSelector | None = None, fill_value: Any = None
) -> tuple[NamedArray, NamedArray]:
    """``(values, inverse)``: the unique values, and for each element (or slice along ``axis``) its slot."""
    return unique(array, Unique, return_inverse=True, axis=axis, fill_value=fill_value)  # type: ignore[return-value]


def unique_all(
    array: NamedArray, Unique: Axis, *, axis: AxisSelector | None = None, fill_value: Any = None
) -> tuple[NamedArray, NamedArray, NamedArray, NamedArray]:
    """``(values, indices, inverse_indices, counts)`` as in the array API's ``unique_all``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> rows = hax.named(jnp.array([[1, 2], [3, 4], [1, 2]]), ("row", "col"))
        >>> values, first, inverse, counts = hax.unique_all(rows, hax.Axis("u", 2), axis="row")
        >>> values.array.tolist(), counts.array.tolist(), inverse.array.tolist()
        ([[1, 2], [3, 4]], [2, 1], [0, 1, 0])
    """
    return unique(  # type: ignore[return-value]
        array, Unique, return_index=True, return_inverse=True, return_counts=True, axis=axis, fill_value=fill_value
    )


def bincount(x: NamedArray, Counts: Axis, *, weights: Any = None, minlength: int = 0) -> NamedArray:
    """Counts occurrences of each non-negative integer of ``x`` (all axes flattened) into ``Counts.size`` bins.

    Args:
        x: a named array of non-negative integers (any axes).
        Counts: the result axis; its size is the static number of bins (larger values are dropped).
        weights: optional named array (axes a subset of ``x``'s) or scalar weights.
        minlength: accepted for NumPy compatibility; must not exceed ``Counts.size``.

    Returns:
        A one-axis array along ``Counts``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.bincount(hax.named(jnp.array([0, 2, 2]), "a"), hax.Axis("bin", 4)).array.tolist()
        [1, 0, 2, 0]
    """
    if minlength > Counts.size:
        raise ValueError(f"bincount: minlength={minlength} exceeds the size of {Counts}")
    w = broadcast_to(weights, x.axes).array.reshape(-1) if weights is not None else None
    out = jnp.bincount(x.array.reshape(-1), weights=w, minlength=minlength, length=Counts.size)
    return NamedArray(out, (Counts,))


def nonzero(array: NamedArray, *, size: int | Axis, fill_value: Any = None) -> tuple[NamedArray, ...]:
    """Indices of the non-zero elements, one index array per axis of ``array`` (row-major order).

    Args:
        array: the named array.
        size: the static number of results, or the result :class:`Axis` (default name ``"nonzero"``).
        fill_value: the index used for padding (default 0).

    Returns:
        A tuple with one named index array per axis of ``array``, each along the result axis.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> (i,) = hax.nonzero(hax.named(jnp.array([0, 5, 0, 7]), "a"), size=2)
        >>> i.array.tolist()
        [1, 3]
    """
    out_axis = size if isinstance(size, Axis) else Axis("nonzero", size)
    idx = jnp.nonzero(array.array, size=out_axis.size, fill_value=fill_value)
    return tuple(NamedArray(i, (out_axis,)) for i in idx)
