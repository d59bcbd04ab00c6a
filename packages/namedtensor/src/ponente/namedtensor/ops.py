"""Named versions of ``where``, ``clip``, comparisons of whole arrays, triangles, ``trace`` and ``pad``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .axis import Axis, AxisSelector
from .core import NamedArray, _aligned, _check_positional_operand, _result_axes

__all__ = [
    "allclose",
    "array_equal",
    "array_equiv",
    "clip",
    "isclose",
    "packbits",
    "pad",
    "pad_left",
    "trace",
    "tril",
    "triu",
    "unpackbits",
    "where",
]


def _broadcast_raw(*operands: Any, what: str) -> tuple[tuple[Axis, ...], list[Any]]:
    """Aligns named operands to their common axes (subset rule); scalars pass through."""
    named_ops = [o for o in operands if isinstance(o, NamedArray)]
    for o in operands:
        if o is not None and not isinstance(o, NamedArray):
            _check_positional_operand(o, what)
    axes = _result_axes(named_ops)
    return axes, [_aligned(o, axes) if isinstance(o, NamedArray) else o for o in operands]


def where(condition: Any, x: Any = None, y: Any = None, *, fill_value: Any = None, new_axis: Any = None) -> Any:
    """Chooses ``x`` where ``condition`` is true and ``y`` elsewhere, broadcasting the three by name.

    The largest operand must contain the others' axes; the result takes its order. With only
    ``condition``, returns the indices of true elements like :func:`ponente.namedtensor.nonzero`, which needs
    ``new_axis`` (the static size, an :class:`Axis`) and optionally ``fill_value``.

    Args:
        condition: a boolean named array (or scalar).
        x: values where true.
        y: values where false.
        fill_value: one-argument form only: the index used for padding.
        new_axis: one-argument form only: the axis of the result (its size is the static count).

    Returns:
        A named array, or (one-argument form) a tuple of index arrays, one per axis of ``condition``.

    Raises:
        ValueError: if the operands' axes violate the subset rule.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> x = hax.named(jnp.arange(4), "a")
        >>> hax.where(x > 1, x, 0).array.tolist()
        [0, 0, 2, 3]
    """
    if x is None and y is None:
        if new_axis is None:
            raise ValueError("where(condition) needs new_axis=Axis(name, size) to give the result a static size")
        from .counting import nonzero

        return nonzero(condition, size=new_axis, fill_value=fill_value)
    if x is None or y is None:
        raise ValueError("where needs both x and y (or neither)")
    axes, (c, a, b) = _broadcast_raw(condition, x, y, what="where")
    if not any(isinstance(o, NamedArray) for o in (condition, x, y)):
        return jnp.where(c, a, b)
    return NamedArray(jnp.where(c, a, b), axes)


def clip(array: Any, a_min: Any = None, a_max: Any = None) -> NamedArray:
    """Clips values to ``[a_min, a_max]``; bounds may be named arrays (broadcast by name) or scalars.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.clip(hax.named(jnp.arange(5), "a"), 1, 3).array.tolist()
        [1, 1, 2, 3, 3]
    """
    axes, (a, lo, hi) = _broadcast_raw(array, a_min, a_max, what="clip")
    return NamedArray(jnp.clip(a, lo, hi), axes)


def isclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> NamedArray:
    """Element-wise ``|a - b| <= atol + rtol * |b|``, broadcast by name."""
    axes, (x, y) = _broadcast_raw(a, b, what="isclose")
    return NamedArray(jnp.isclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan), axes)


def allclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> jax.Array:
    """Whether all elements are close (see :func:`isclose`), after aligning axes by name.

    Returns:
        A boolean scalar JAX array.
    """
    _axes, (x, y) = _broadcast_raw(a, b, what="allclose")
    return jnp.allclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan)


def array_equal(a1: NamedArray, a2: NamedArray) -> jax.Array | bool:
    """Whether two named arrays have the same axes (in any order, same sizes) and equal elements.

    Returns:
        ``False`` (a Python bool) if the axes differ, otherwise a boolean scalar JAX array.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> x = hax.named(jnp.arange(6).reshape(2, 3), ("a", "b"))
        >>> bool(hax.array_equal(x, x.rearrange(("b", "a"))))
        True
    """
    if set(a1.axes) != set(a2.axes):
        return False
    return jnp.array_equal(a1.array, _aligned(a2, a1.axes))


def array_equiv(a1: NamedArray, a2: NamedArray) -> bool:
    """Whether two named arrays are equal after broadcasting one to the other by name.

    Unlike :func:`array_equal`, the axes may differ as long as one array's axes are a subset of the other's
    (same sizes); a scalar is equivalent to an array filled with it.

    Example:
        >>> import ponente.namedtensor as hax
        >>> x = hax.ones({"a": 2, "b": 3})
        >>> hax.array_equiv(x, hax.ones({"b": 3})), hax.array_equiv(x, hax.ones({"c": 4}))
        (True, False)
    """
    try:
        axes, (x, y) = _broadcast_raw(a1, a2, what="array_equiv")
    except ValueError:
        return False
    return bool(jnp.array_equal(jnp.broadcast_to(x, _shape(axes)), jnp.broadcast_to(y, _shape(axes))))


def _shape(axes: tuple[Axis, ...]) -> tuple[int, ...]:
    return tuple(ax.size for ax in axes)


def _triangle(fn: Any, array: NamedArray, axis1: AxisSelector, axis2: AxisSelector, k: int) -> NamedArray:
    i, j = array._index_of(axis1), array._index_of(axis2)
    axes = (*(ax for n, ax in enumerate(array.axes) if n not in (i, j)), array.axes[i], array.axes[j])
    return NamedArray(fn(jnp.moveaxis(array.array, (i, j), (-2, -1)), k), axes)


def tril(array: NamedArray, axis1: AxisSelector, axis2: AxisSelector, k: int = 0) -> NamedArray:
    """Zeroes the elements above the ``k``-th diagonal of the (``axis1``, ``axis2``) matrices.

    ``axis1`` indexes rows and ``axis2`` columns, wherever they are in ``array``. As in Haliax, the result has
    the other axes first (in their order), then ``axis1``, then ``axis2``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.tril(hax.named(jnp.ones((2, 2)), ("r", "c")), "r", "c").array.tolist()
        [[1.0, 0.0], [1.0, 1.0]]
    """
    return _triangle(jnp.tril, array, axis1, axis2, k)


def triu(array: NamedArray, axis1: AxisSelector, axis2: AxisSelector, k: int = 0) -> NamedArray:
    """Zeroes the elements below the ``k``-th diagonal of the (``axis1`` rows, ``axis2`` columns) matrices.

    The result's axes are ordered as in :func:`tril`.
    """
    return _triangle(jnp.triu, array, axis1, axis2, k)


def trace(
    array: NamedArray, axis1: AxisSelector, axis2: AxisSelector, offset: int = 0, dtype: Any = None
) -> NamedArray:
    """Sum along the diagonal of the (``axis1``, ``axis2``) matrices; both axes disappear.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.trace(hax.named(jnp.eye(3), ("r", "c")), "r", "c").item()
        3.0
    """
    i, j = array._index_of(axis1), array._index_of(axis2)
    kept = tuple(ax for n, ax in enumerate(array.axes) if n not in (i, j))
    return NamedArray(jnp.trace(array.array, offset=offset, axis1=i, axis2=j, dtype=dtype), kept)


def pad(
    array: NamedArray,
    pad_width: Mapping[AxisSelector, tuple[int, int] | int],
    *,
    mode: str = "constant",
    constant_values: Any = 0,
    **kwargs: Any,
) -> NamedArray:
    """Pads along named axes (``jax.numpy.pad``); padded axes grow, others are untouched.

    Args:
        array: the named array.
        pad_width: ``{axis: (before, after)}`` or ``{axis: n}`` for ``(n, n)``.
        mode: a ``jnp.pad`` mode (``"constant"``, ``"edge"``, ``"reflect"``, ...).
        constant_values: the fill value for ``mode="constant"``.
        **kwargs: further ``jnp.pad`` options.

    Returns:
        The padded array.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.pad(hax.named(jnp.ones(2), "a"), {"a": (1, 2)}).array.tolist()
        [0.0, 1.0, 1.0, 0.0, 0.0]
    """
    widths = [(0, 0)] * array.ndim
    for ax, w in pad_width.items():
        pair = (w, w) if isinstance(w, int) else (int(w[0]), int(w[1]))
        widths[array._index_of(ax)] = pair
    if mode == "constant":
        kwargs["constant_values"] = constant_values
    arr = jnp.pad(array.array, widths, mode=mode, **kwargs)
    axes = tuple(ax.resize(ax.size + w[0] + w[1]) for ax, w in zip(array.axes, widths))
    return NamedArray(arr, axes)


def pad_left(array: NamedArray, axis: AxisSelector, new_axis: Axis, value: Any = 0) -> NamedArray:
    """Pads ``axis`` at its start with ``value`` so that it becomes ``new_axis`` (which must not be smaller).

    Args:
        array: the named array.
        axis: the axis to pad.
        new_axis: the padded axis (its name and size replace ``axis``'s, in place).
        value: the fill value.

    Returns:
        The padded array.

    Raises:
        ValueError: if ``new_axis`` is smaller than ``axis``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.pad_left(hax.named(jnp.ones(2), "a"), "a", hax.Axis("a", 4)).array.tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    i = array._index_of(axis)
    old = array.axes[i]
    extra = new_axis.size - old.size
    if extra < 0:
        raise ValueError(f"pad_left: cannot pad axis {old} to the smaller {new_axis}")
    widths = [(0, 0)] * array.ndim
    widths[i] = (extra, 0)
    arr = jnp.pad(array.array, widths, constant_values=value)
    return NamedArray(arr, (*array.axes[:i], new_axis, *array.axes[i + 1 :]))


def packbits(a: NamedArray, axis: AxisSelector, *, bitorder: str = "big") -> NamedArray:
    """Packs the (boolean or 0/1) elements along ``axis`` into ``uint8`` bytes, like ``jnp.packbits``.

    The axis keeps its name and shrinks to ``ceil(size / 8)``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> bits = hax.named(jnp.array([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=jnp.uint8), "b")
        >>> hax.packbits(bits, "b").array.tolist()
        [129, 128]
    """
    i = a._index_of(axis)
    old = a.axes[i]
    arr = jnp.packbits(a.array, axis=i, bitorder=bitorder)
    return NamedArray(arr, (*a.axes[:i], old.resize(arr.shape[i]), *a.axes[i + 1 :]))


def unpackbits(a: NamedArray, axis: AxisSelector, *, count: int | None = None, bitorder: str = "big") -> NamedArray:
    """Unpacks the ``uint8`` elements along ``axis`` into bits, like ``jnp.unpackbits``.

    The axis keeps its name and grows to ``8 * size`` (or ``count`` if given).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> packed = hax.named(jnp.array([129], dtype=jnp.uint8), "b")
        >>> hax.unpackbits(packed, "b", count=3).array.tolist()
        [1, 0, 0]
    """
    i = a._index_of(axis)
    old = a.axes[i]
    arr = jnp.unpackbits(a.array, axis=i, count=count, bitorder=bitorder)
    return NamedArray(arr, (*a.axes[:i], old.resize(arr.shape[i]), *a.axes[i + 1 :]))
