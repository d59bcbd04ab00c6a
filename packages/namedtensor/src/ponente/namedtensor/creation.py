"""Creating named arrays: filled arrays, ranges, and combining arrays (``stack``, ``concatenate``, ...)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .axis import Axis, AxisSelector, AxisSpec, axis_name, axis_spec_to_tuple
from .core import NamedArray, _aligned, _fmt_axes

__all__ = [
    "arange",
    "concatenate",
    "full",
    "full_like",
    "geomspace",
    "linspace",
    "logspace",
    "ones",
    "ones_like",
    "repeat",
    "stack",
    "tile",
    "zeros",
    "zeros_like",
]


def _axes(shape: AxisSpec, where: str) -> tuple[Axis, ...]:
    axes = tuple(axis_spec_to_tuple(shape))
    for ax in axes:
        if not isinstance(ax, Axis):
            raise TypeError(f"{where} needs axes with sizes (Axis or a shape dict), got only the name {ax!r}")
    return axes  # type: ignore[return-value]


def full(shape: AxisSpec, fill_value: Any, dtype: Any = None) -> NamedArray:
    """An array of the given axes filled with ``fill_value``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> hax.full({"a": 2}, 7).array.tolist()
        [7, 7]
    """
    axes = _axes(shape, "full")
    return NamedArray(jnp.full(tuple(ax.size for ax in axes), fill_value, dtype=dtype), axes)


def zeros(shape: AxisSpec, dtype: Any = None) -> NamedArray:
    """An array of zeros with the given axes (``float32`` by default).

    Example:
        >>> import ponente.namedtensor as hax
        >>> hax.zeros((hax.Axis("batch", 2), hax.Axis("embed", 3))).shape
        {'batch': 2, 'embed': 3}
    """
    axes = _axes(shape, "zeros")
    return NamedArray(jnp.zeros(tuple(ax.size for ax in axes), dtype=dtype), axes)


def ones(shape: AxisSpec, dtype: Any = None) -> NamedArray:
    """An array of ones with the given axes (``float32`` by default)."""
    axes = _axes(shape, "ones")
    return NamedArray(jnp.ones(tuple(ax.size for ax in axes), dtype=dtype), axes)


def zeros_like(a: NamedArray, dtype: Any = None) -> NamedArray:
    """Zeros with the axes (and by default the dtype) of ``a``."""
    return NamedArray(jnp.zeros_like(a.array, dtype=dtype), a.axes)


def ones_like(a: NamedArray, dtype: Any = None) -> NamedArray:
    """Ones with the axes (and by default the dtype) of ``a``."""
    return NamedArray(jnp.ones_like(a.array, dtype=dtype), a.axes)


def full_like(a: NamedArray, fill_value: Any, dtype: Any = None) -> NamedArray:
    """``fill_value`` with the axes (and by default the dtype) of ``a``."""
    return NamedArray(jnp.full_like(a.array, fill_value, dtype=dtype), a.axes)


def arange(axis: AxisSpec, *, start: Any = 0, step: Any = 1, dtype: Any = None) -> NamedArray:
    """``start, start + step, ...`` along ``axis``; ``start`` and ``step`` may be traced.

    For several axes, the values run row-major over all of them.

    Args:
        axis: one axis or several (sizes give the length).
        start: first value (Python number or traced scalar).
        step: increment.
        dtype: result dtype (inferred from ``start``/``step`` by default).

    Returns:
        The named range.

    Example:
        >>> import ponente.namedtensor as hax
        >>> hax.arange(hax.Axis("a", 4), start=2).array.tolist()
        [2, 3, 4, 5]
    """
    axes = _axes(axis, "arange")
    size = int(np.prod([ax.size for ax in axes], dtype=np.int64))
    if dtype is None:
        dtype = jnp.result_type(start, step)
    values = jnp.arange(size, dtype=dtype) * jnp.asarray(step, dtype) + jnp.asarray(start, dtype)
    return NamedArray(values.reshape(tuple(ax.size for ax in axes)), axes)


def _single(axis: AxisSelector, where: str) -> Axis:
    if not isinstance(axis, Axis):
        raise TypeError(f"{where} needs an Axis with a size, got {axis!r}")
    return axis


def linspace(axis: AxisSelector, *, start: float, stop: float, endpoint: bool = True, dtype: Any = None) -> NamedArray:
    """``axis.size`` evenly spaced values from ``start`` to ``stop``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> hax.linspace(hax.Axis("a", 3), start=0, stop=1).array.tolist()
        [0.0, 0.5, 1.0]
    """
    ax = _single(axis, "linspace")
    return NamedArray(jnp.linspace(start, stop, ax.size, endpoint=endpoint, dtype=dtype), (ax,))


def logspace(
    axis: AxisSelector,
    *,
    start: float,
    stop: float,
    endpoint: bool = True,
    base: float = 10.0,
    dtype: Any = None,
) -> NamedArray:
    """``axis.size`` values evenly spaced on a log scale, from ``base ** start`` to ``base ** stop``."""
    ax = _single(axis, "logspace")
    return NamedArray(jnp.logspace(start, stop, ax.size, endpoint=endpoint, base=base, dtype=dtype), (ax,))


def geomspace(
    axis: AxisSelector, *, start: float, stop: float, endpoint: bool = True, dtype: Any = None
) -> NamedArray:
    """``axis.size`` values in geometric progression from ``start`` to ``stop``."""
    ax = _single(axis, "geomspace")
    return NamedArray(jnp.geomspace(start, stop, ax.size, endpoint=endpoint, dtype=dtype), (ax,))


def _same_axes(arrays: Sequence[NamedArray], where: str, except_axis: str | None = None) -> None:
    if not arrays:
        raise ValueError(f"{where} needs at least one array")
    first = {ax.name: ax.size for ax in arrays[0].axes if ax.name != except_axis}
    for i, a in enumerate(arrays[1:], 1):
        other = {ax.name: ax.size for ax in a.axes if ax.name != except_axis}
        if other != first:
            raise ValueError(
                f"{where}: array {i} has axes {_fmt_axes(a.axes)} but array 0 has {_fmt_axes(arrays[0].axes)}"
            )


def stack(axis: AxisSelector, arrays: Sequence[NamedArray]) -> NamedArray:
    """Stacks arrays with the same axes (in any order) along a new first axis.

    Args:
        axis: the new axis (its size must be ``len(arrays)``), or its name.
        arrays: named arrays with the same axes; they take the first array's order.

    Returns:
        A named array with ``axis`` first.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> x = hax.named(jnp.arange(3), "b")
        >>> hax.stack("a", [x, x]).shape
        {'a': 2, 'b': 3}
    """
    arrays = list(arrays)
    _same_axes(arrays, "stack")
    new = axis if isinstance(axis, Axis) else Axis(axis, len(arrays))
    if new.size != len(arrays):
        raise ValueError(f"stack: axis {new} must have size {len(arrays)} (the number of arrays)")
    if new.name in arrays[0].axis_names:
        raise ValueError(f"stack: axis {new.name!r} is already an axis of the arrays")
    axes = arrays[0].axes
    return NamedArray(jnp.stack([_aligned(a, axes) for a in arrays]), (new, *axes))


def concatenate(axis: AxisSelector, arrays: Sequence[NamedArray]) -> NamedArray:
    """Concatenates arrays along an existing axis (sizes may differ along it; other axes must agree).

    Args:
        axis: the axis name (or an :class:`Axis` whose size is the total).
        arrays: named arrays; they take the first array's axis order.

    Returns:
        The concatenated array.

    Raises:
        ValueError: if an array lacks the axis or the other axes differ.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> x = hax.named(jnp.arange(2), "a")
        >>> hax.concatenate("a", [x, x]).array.tolist()
        [0, 1, 0, 1]
    """
    arrays = list(arrays)
    name = axis_name(axis)
    for i, a in enumerate(arrays):
        if name not in a.axis_names:
            raise ValueError(f"concatenate: array {i} has no axis {name!r} (its axes are {_fmt_axes(a.axes)})")
    _same_axes(arrays, "concatenate", except_axis=name)
    total = sum(a.axis_size(name) for a in arrays)
    if isinstance(axis, Axis) and axis.size != total:
        raise ValueError(f"concatenate: axis {axis} must have size {total} (the total along {name!r})")
    first = arrays[0]
    pos = first.axis_names.index(name)
    parts = []
    for a in arrays:
        target = tuple(ax if ax.name != name else Axis(name, a.axis_size(name)) for ax in first.axes)
        parts.append(_aligned(a, target))
    axes = (*first.axes[:pos], Axis(name, total), *first.axes[pos + 1 :])
    return NamedArray(jnp.concatenate(parts, axis=pos), axes)


def repeat(a: NamedArray, repeats: Any, axis: AxisSelector, total_repeat_length: int | None = None) -> NamedArray:
    """Repeats each element along ``axis`` ``repeats`` times (``jnp.repeat``); the axis grows.

    Args:
        a: the named array.
        repeats: an int, or a positional array with one count per element along ``axis``.
        axis: the axis.
        total_repeat_length: the static resulting length (needed under ``jit`` with array ``repeats``).

    Returns:
        The array with ``axis`` grown.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.repeat(hax.named(jnp.arange(2), "a"), 2, "a").array.tolist()
        [0, 0, 1, 1]
    """
    pos = a._index_of(axis)
    arr = jnp.repeat(a.array, repeats, axis=pos, total_repeat_length=total_repeat_length)
    return NamedArray(arr, (*a.axes[:pos], a.axes[pos].resize(arr.shape[pos]), *a.axes[pos + 1 :]))


def tile(a: NamedArray, reps: Mapping[AxisSelector, int]) -> NamedArray:
    """Tiles the array: axis ``k`` is repeated whole ``reps[k]`` times.

    Keys that are not axes of ``a`` create new axes (in front, in the order given) of size ``reps[k]``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.tile(hax.named(jnp.arange(2), "a"), {"a": 2}).array.tolist()
        [0, 1, 0, 1]
    """
    new_axes = []
    per_axis = {ax.name: 1 for ax in a.axes}
    for k, r in reps.items():
        name = axis_name(k)
        if name in per_axis:
            per_axis[name] = r
        else:
            new_axes.append(Axis(name, r))
    arr = jnp.tile(a.array, tuple([ax.size for ax in new_axes] + [per_axis[ax.name] for ax in a.axes]))
    axes = tuple(new_axes) + tuple(ax.resize(ax.size * per_axis[ax.name]) for ax in a.axes)
    return NamedArray(arr, axes)
