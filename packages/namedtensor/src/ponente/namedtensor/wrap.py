"""Lifting positional ``jax.numpy`` functions to named arrays: element-wise, reductions, along-one-axis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax

from .axis import Axis, AxisSelection, AxisSelector, axis_name
from .core import NamedArray, _binary, broadcast_to
from .util import ensure_tuple

__all__ = [
    "ReductionFunction",
    "SimpleReductionFunction",
    "elemwise_binary",
    "unwrap_namedarrays",
    "wrap_axiswise_call",
    "wrap_elemwise_binary",
    "wrap_elemwise_unary",
    "wrap_reduction_call",
]


class ReductionFunction(Protocol):
    """The signature of a named reduction such as :func:`~ponente.namedtensor.sum`: ``fn(array, axis, where=...)``."""

    def __call__(
        self, array: NamedArray, axis: AxisSelection | None = None, where: NamedArray | None = None, **kwargs: Any
    ) -> NamedArray: ...


class SimpleReductionFunction(Protocol):
    """The signature of a one-axis reduction without ``where`` such as :func:`~ponente.namedtensor.argmax`."""

    def __call__(self, array: NamedArray, axis: AxisSelector | None = None, **kwargs: Any) -> NamedArray: ...


def wrap_elemwise_unary(f: Callable[..., Any], a: Any, *args: Any, **kwargs: Any) -> Any:
    """Applies an element-wise positional function to a named array (or passes other inputs through).

    Args:
        f: the positional function, e.g. ``jnp.exp``.
        a: a named array, or a positional array/scalar.
        *args: extra positional arguments for ``f``.
        **kwargs: extra keyword arguments for ``f``.

    Returns:
        A named array with ``a``'s axes (or ``f(a)`` for unnamed inputs).
    """
    if isinstance(a, NamedArray):
        return NamedArray(f(a.array, *args, **kwargs), a.axes)
    return f(a, *args, **kwargs)


def wrap_elemwise_binary(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Lifts a positional binary function to broadcast by name (subset rule; larger operand's order).

    Args:
        op: the positional function, e.g. ``jnp.add``.

    Returns:
        A function of two operands (named arrays or scalars).
    """

    def binop(x1: Any, x2: Any) -> Any:
        return elemwise_binary(op, x1, x2)

    binop.__name__ = getattr(op, "__name__", "binop")
    binop.__doc__ = f"Named, broadcast-by-name version of ``{binop.__name__}``."
    return binop


def elemwise_binary(op: Callable[[Any, Any], Any], x1: Any, x2: Any) -> Any:
    """Applies a positional binary function, broadcasting named operands by name.

    Args:
        op: the positional function, e.g. ``jnp.add``.
        x1: first operand (named array or scalar).
        x2: second operand (named array or scalar).

    Returns:
        A named array if either operand is named (axes of the larger operand), else ``op(x1, x2)``.

    Raises:
        ValueError: if neither operand's axes are a subset of the other's.
    """
    if isinstance(x1, NamedArray) or isinstance(x2, NamedArray):
        return _binary(op, x1, x2)
    return op(x1, x2)


def _reduced_axes(array: NamedArray, axis: AxisSelection | None) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    if axis is None:
        return tuple(range(array.ndim)), ()
    sel = ensure_tuple(axis) if not isinstance(axis, dict) else tuple(axis)
    names = [axis_name(a) for a in sel]  # type: ignore[arg-type]
    idx = tuple(array._index_of(a) for a in sel)  # type: ignore[arg-type]
    kept = tuple(ax for ax in array.axes if ax.name not in names)
    return idx, kept


def wrap_reduction_call(
    fn: Callable[..., Any],
    array: Any,
    axis: AxisSelection | None,
    where: NamedArray | None = None,
    single_axis_only: bool = False,
    supports_where: bool = True,
    **kwargs: Any,
) -> Any:
    """Applies a positional reduction over named axes.

    ``array`` may also be a plain JAX/NumPy array (``fn`` is then called as is, ``axis`` being positional) or a
    pytree of arrays (each leaf is reduced).

    Args:
        fn: the positional reduction, called as ``fn(array, axis=positions, **kwargs)``.
        array: the named array (or a plain array, or a pytree of either).
        axis: the axis or axes to reduce; ``None`` reduces all.
        where: a boolean named array (its axes a subset of ``array``'s) choosing the elements to include.
        single_axis_only: whether ``fn`` accepts only one axis (``argmax`` and friends).
        supports_where: whether ``fn`` accepts ``where=``.
        **kwargs: extra keyword arguments for ``fn``.

    Returns:
        The reduced named array; the remaining axes keep their order.

    Raises:
        ValueError: if an axis is absent, several axes are given to a single-axis reduction, or ``where`` has
            axes the array lacks.

    Example:
        >>> import jax.numpy as jnp
        >>> from ponente.namedtensor import named
        >>> wrap_reduction_call(jnp.sum, named(jnp.ones((2, 3)), ("a", "b")), "b").array.tolist()
        [3.0, 3.0]
    """
    name = getattr(fn, "__name__", "reduction")
    if where is not None and not supports_where:
        raise ValueError(f"{name} does not support where=")

    def one(leaf: Any) -> Any:
        if not isinstance(leaf, NamedArray):
            extra = dict(kwargs) if where is None else {**kwargs, "where": where}
            return fn(leaf, axis=axis, **extra)
        return _reduce_named(fn, leaf, axis, where, single_axis_only, name, kwargs)

    return jax.tree_util.tree_map(one, array, is_leaf=lambda x: isinstance(x, NamedArray))


def _reduce_named(
    fn: Callable[..., Any],
    array: NamedArray,
    axis: AxisSelection | None,
    where: Any,
    single_axis_only: bool,
    name: str,
    kwargs: dict[str, Any],
) -> NamedArray:
    positions, kept = _reduced_axes(array, axis)
    if single_axis_only:
        if axis is None:
            return NamedArray(fn(array.array.reshape(-1), axis=0, **kwargs), ())
        if not isinstance(axis, Axis | str) and len(positions) != 1:
            raise ValueError(f"{name} reduces exactly one axis, got {axis}")
        pos: Any = positions[0]
    else:
        pos = positions
    if where is not None:
        w = broadcast_to(where, array.axes).array if isinstance(where, NamedArray) else where
        kwargs = {**kwargs, "where": w}
    return NamedArray(fn(array.array, axis=pos, **kwargs), kept)


def wrap_axiswise_call(fn: Callable[..., Any], a: Any, axis: AxisSelector | None, **kwargs: Any) -> Any:
    """Applies a positional function that works along one axis and keeps the shape (``cumsum``, ``sort``...).

    Like the ``jax.numpy`` functions it wraps, ``axis=None`` works on the flattened array and returns a plain
    (unnamed) one-dimensional array; a plain (unnamed) ``a`` is passed to ``fn`` as is.

    Args:
        fn: the positional function, called as ``fn(array, axis=position, **kwargs)``.
        a: the named array (or a plain array).
        axis: the axis to work along, or ``None`` for the flattened array.
        **kwargs: extra keyword arguments for ``fn``.

    Returns:
        A named array with ``a``'s axes (a plain array if ``axis`` is None or ``a`` is unnamed).

    Example:
        >>> import jax.numpy as jnp
        >>> from ponente.namedtensor import named
        >>> wrap_axiswise_call(jnp.cumsum, named(jnp.arange(3), "a"), "a").array.tolist()
        [0, 1, 3]
    """
    if not isinstance(a, NamedArray):
        return fn(a, axis=axis, **kwargs)
    if axis is None:
        return fn(a.array, axis=None, **kwargs)
    return NamedArray(fn(a.array, axis=a._index_of(axis), **kwargs), a.axes)


def unwrap_namedarrays(*a: Any) -> tuple[Any, ...]:
    """The positional arrays of named arrays (other values pass through)."""
    return tuple(x.array if isinstance(x, NamedArray) else x for x in a)
