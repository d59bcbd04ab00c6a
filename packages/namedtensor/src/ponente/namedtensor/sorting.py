"""Sorting along a named axis: ``sort``, ``argsort``, ``top_k``, ``searchsorted``.

As in ``jax.numpy``, ``sort``/``argsort`` with ``axis=None`` work on the flattened array and return a plain
one-dimensional array.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .axis import Axis, AxisSelector, axis_name
from .core import NamedArray
from .wrap import wrap_axiswise_call

__all__ = ["argsort", "searchsorted", "sort", "top_k"]


def sort(a: NamedArray, axis: AxisSelector | None) -> NamedArray:
    """Sorts along ``axis`` (ascending); keeps the axes.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.sort(hax.named(jnp.array([3, 1, 2]), "a"), "a").array.tolist()
        [1, 2, 3]
    """
    return wrap_axiswise_call(jnp.sort, a, axis)


def argsort(a: NamedArray, axis: AxisSelector | None, *, stable: bool = True) -> NamedArray:
    """Indices that sort ``a`` along ``axis`` (ascending, stable by default); keeps the axes."""
    return wrap_axiswise_call(jnp.argsort, a, axis, stable=stable)


def top_k(
    arr: NamedArray, axis: AxisSelector, k: int, new_axis: AxisSelector | None = None
) -> tuple[NamedArray, NamedArray]:
    """The ``k`` largest values along ``axis`` (descending) and their indices.

    Args:
        arr: the named array.
        axis: the axis to select along.
        k: how many values.
        new_axis: the name (or :class:`Axis` of size ``k``) of the result axis; by default ``axis``'s name.

    Returns:
        ``(values, indices)``, both with ``axis`` replaced in place by ``new_axis`` of size ``k``.

    Raises:
        ValueError: if ``k`` exceeds the axis size.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> v, i = hax.top_k(hax.named(jnp.array([1, 5, 3]), "a"), "a", 2)
        >>> v.array.tolist(), i.array.tolist()
        ([5, 3], [1, 2])
    """
    old = arr.resolve_axis(axis)
    if k > old.size:
        raise ValueError(f"top_k: k={k} exceeds the size {old.size} of axis {old.name!r}")
    name = axis_name(new_axis) if new_axis is not None else old.name
    if isinstance(new_axis, Axis) and new_axis.size != k:
        raise ValueError(f"top_k: new axis {new_axis} must have size k={k}")
    pos = arr.axis_names.index(old.name)
    values, indices = jax.lax.top_k(jnp.moveaxis(arr.array, pos, -1), k)
    axes = (*arr.axes[:pos], Axis(name, k), *arr.axes[pos + 1 :])
    return NamedArray(jnp.moveaxis(values, -1, pos), axes), NamedArray(jnp.moveaxis(indices, -1, pos), axes)


def searchsorted(a: NamedArray, v: Any, side: str = "left", sorter: NamedArray | None = None, **kwargs: Any) -> Any:
    """Where to insert ``v`` into the sorted one-axis array ``a`` to keep it sorted.

    Args:
        a: a sorted named array with exactly one axis.
        v: the values (a named array of any axes, or a scalar).
        side: ``"left"`` or ``"right"`` (see ``jnp.searchsorted``).
        sorter: optional indices that sort ``a``.
        **kwargs: further ``jnp.searchsorted`` options (``method``).

    Returns:
        Indices with the axes of ``v`` (a scalar array for a scalar ``v``).

    Raises:
        ValueError: if ``a`` has more than one axis.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> a = hax.named(jnp.array([1, 3, 5]), "a")
        >>> hax.searchsorted(a, hax.named(jnp.array([0, 4]), "q")).array.tolist()
        [0, 2]
    """
    if a.ndim != 1:
        raise ValueError(f"searchsorted needs a one-axis sorted array, got axes {a.axis_names}")
    srt = sorter.array if isinstance(sorter, NamedArray) else sorter
    if isinstance(v, NamedArray):
        return NamedArray(jnp.searchsorted(a.array, v.array, side=side, sorter=srt, **kwargs), v.axes)
    return jnp.searchsorted(a.array, v, side=side, sorter=srt, **kwargs)
