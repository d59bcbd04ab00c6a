"""``NamedArray``: a JAX array whose axes have names, and the name-based shape operations."""

from __future__ import annotations

import builtins
import contextlib
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._util import ensure_tuple
from .annotation import NamedArrayAxes, named_array_annotation
from .axis import Axis, AxisSelection, AxisSelector, AxisSpec, axis_name, selects_axis
from .axis import resolve_axis as _resolve_axis_in


# Late binding -- the ONE place where this module reaches up. ``core`` is the bottom layer (the NamedArray type and
# its axis bookkeeping); reductions, rearrange, dot, sorting, ... are built on it. The method forms of those
# operations (``x.sum("batch")``, ``x.dot(w, axis="embed")``) look them up in the package namespace at call time,
# so no operation module is imported here and the package's import graph stays acyclic.
def _api() -> Any:
    """The package namespace ``ponente.namedtensor`` (imported at call time; see the comment above)."""
    import ponente.namedtensor as api

    return api


__all__ = [
    "NamedArray",
    "are_shape_checks_enabled",
    "broadcast_arrays",
    "broadcast_axis",
    "broadcast_to",
    "enable_shape_checks",
    "flatten",
    "flatten_axes",
    "index",
    "named",
    "ravel",
    "rename",
    "roll",
    "slice",
    "split",
    "take",
    "unbind",
    "unflatten_axis",
    "updated_slice",
]

_shape_checks = threading.local()
builtins_slice = builtins.slice
builtins_sum = builtins.sum


def are_shape_checks_enabled() -> bool:
    """Whether :class:`NamedArray` checks that its array's shape matches its axes (on by default)."""
    return getattr(_shape_checks, "enabled", True)


@contextlib.contextmanager
def enable_shape_checks(enabled: bool) -> Iterator[None]:
    """Context manager that turns the shape check of :class:`NamedArray` on or off (per thread).

    Args:
        enabled: whether constructors inside the block check shapes.

    Example:
        >>> import jax.numpy as jnp
        >>> with enable_shape_checks(False):
        ...     x = NamedArray(jnp.zeros(3), (Axis("a", 4),))  # no error
    """
    old = are_shape_checks_enabled()
    _shape_checks.enabled = enabled
    try:
        yield
    finally:
        _shape_checks.enabled = old


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)
class NamedArray:
    """A JAX array with a named axis per dimension.

    A pytree whose only child is the array; the axes are static auxiliary data, so names cost
    nothing under ``jit``. Axis names are unique within an array. Unless disabled with
    :func:`enable_shape_checks`, the array's shape must equal the axes' sizes.

    Args:
        array: the positional array (any JAX/NumPy array).
        axes: one :class:`Axis` per dimension, in order.

    Raises:
        TypeError: if an axis is not an :class:`Axis`.
        ValueError: if names repeat or the shape does not match the axes.

    Example:
        >>> import jax.numpy as jnp
        >>> x = NamedArray(jnp.zeros((2, 3)), (Axis("batch", 2), Axis("embed", 3)))
        >>> x.shape
        {'batch': 2, 'embed': 3}
    """

    array: Any
    axes: tuple[Axis, ...]

    def __post_init__(self) -> None:
        axes = self.axes
        if not isinstance(axes, tuple):
            axes = tuple(ensure_tuple(axes))
            object.__setattr__(self, "axes", axes)
        for ax in axes:
            if not isinstance(ax, Axis):
                raise TypeError(f"NamedArray axes must be Axis objects, got {ax!r}; use hax.named(array, names)")
        names = [ax.name for ax in axes]
        if len(set(names)) != len(names):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"axis names must be unique within an array, but {dups} repeat in {names}")
        if are_shape_checks_enabled() and hasattr(self.array, "shape"):
            shape = tuple(self.array.shape)
            expected = tuple(ax.size for ax in axes)
            if shape != expected:
                raise ValueError(
                    f"array shape {shape} does not match axes {_fmt_axes(axes)} (expected shape {expected})"
                )

    # pytree ---------------------------------------------------------------------------------------
    def tree_flatten(self) -> tuple[tuple[Any], tuple[Axis, ...]]:
        """Flattens to the array (only child) and the axes (static aux data)."""
        return (self.array,), self.axes

    @classmethod
    def tree_unflatten(cls, aux: tuple[Axis, ...], children: Sequence[Any]) -> NamedArray:
        """Rebuilds from the axes and the array without checking (JAX may pass placeholders)."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "array", children[0])
        object.__setattr__(obj, "axes", aux)
        return obj

    # properties -----------------------------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        """The named shape: ``{axis name: size}`` in axis order."""
        return {ax.name: ax.size for ax in self.axes}

    @property
    def dtype(self) -> Any:
        """The element type of the array."""
        return self.array.dtype

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return len(self.axes)

    @property
    def size(self) -> int:
        """The total number of elements."""
        return int(np.prod([ax.size for ax in self.axes], dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """The number of bytes of the array's elements."""
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, in order."""
        return tuple(ax.name for ax in self.axes)

    def axis_size(self, axis: AxisSelection) -> int:
        """The size of one axis, or the product of the sizes of several.

        Raises:
            ValueError: if an axis is not present.
        """
        resolved = _resolve_axis_in(self.axes, axis)
        if isinstance(resolved, Axis):
            return resolved.size
        if isinstance(resolved, Mapping):
            return int(np.prod(list(resolved.values()), dtype=np.int64))
        return int(np.prod([ax.size for ax in resolved], dtype=np.int64))

    def resolve_axis(self, axis: AxisSelection) -> Any:
        """The full :class:`Axis` (or tuple of axes / shape dict) for a selection of this array's axes.

        Raises:
            ValueError: if an axis is not present or its given size differs.
        """
        return _resolve_axis_in(self.axes, axis)

    def has_axis(self, axis: AxisSelection) -> bool:
        """Whether every selected axis is present (with matching size where given)."""
        return selects_axis(self.axes, axis)

    def axis_indices(self, axis: AxisSelection) -> Any:
        """Position of one axis (or a tuple of positions), ``None`` where absent."""
        names = self.axis_names
        if isinstance(axis, Axis | str):
            name = axis_name(axis)
            return names.index(name) if name in names else None
        return tuple(names.index(n) if n in names else None for n in axis_name(axis))

    def _index_of(self, axis: AxisSelector) -> int:
        ax = self.resolve_axis(axis)
        return self.axis_names.index(ax.name)

    def scalar(self) -> jax.Array:
        """The array of a 0-axis named array.

        Raises:
            ValueError: if the array has axes.
        """
        if self.axes:
            raise ValueError(f"scalar() needs an array without axes, this one has axes {_fmt_axes(self.axes)}")
        return self.array

    def item(self) -> Any:
        """The single element as a Python scalar (the array must have exactly one element)."""
        return self.array.item()

    # python protocol -------------------------------------------------------------------------------
    def __bool__(self) -> bool:
        return bool(self.array)

    def __float__(self) -> float:
        return float(self.scalar())

    def __int__(self) -> int:
        return int(self.scalar())

    def __index__(self) -> int:
        return self.scalar().__index__()

    def __repr__(self) -> str:
        dtype = getattr(self.array, "dtype", None)
        return f"NamedArray(axes={_fmt_axes(self.axes)}, dtype={dtype}, array={self.array!r})"

    def __class_getitem__(cls, item: Any) -> Any:
        """``NamedArray["batch embed"]``: ``Annotated[NamedArray, NamedArrayAxes]`` naming the axes.

        Accepts ``"batch embed"``, ``"batch ..."``, ``("batch", "embed")``, ``{"batch", "embed"}`` (any order),
        ``{"batch", ...}`` (at least these). The result supports ``isinstance``: ``isinstance(x,
        NamedArray["batch ..."])`` checks the names, as :meth:`matches_axes` does.
        """
        return named_array_annotation(cls, item)

    def matches_axes(self, spec: Any) -> bool:
        """Whether this array conforms to an axes spec or annotation (and its dtype, if the annotation has one).

        Args:
            spec: a spec such as ``"batch ..."`` or ``{"batch", "embed"}``, or an annotation such as
                ``NamedArray["batch embed"]`` or ``haxtyping.f32["batch"]``.

        Example:
            >>> import ponente.namedtensor as hax
            >>> x = hax.zeros({"batch": 2, "embed": 3})
            >>> x.matches_axes(NamedArray["batch ..."]), x.matches_axes({"embed", "batch"}), x.matches_axes("embed")
            (True, True, False)
        """
        return NamedArrayAxes.parse(spec).matches(self.axis_names, self.dtype)

    # indexing ---------------------------------------------------------------------------------------
    def __getitem__(self, idx: Any) -> NamedArray:
        """Indexes by name: ``x["batch", 0]``, ``x[{"batch": 0, "pos": slice(0, 4)}]``, ``x["pos", hax.ds(i, 4)]``."""
        return index(self, idx)

    @property
    def at(self) -> _NamedIndexUpdateHelper:
        """Functional updates by name, like ``jax.Array.at``: ``x.at["batch", 0].set(1.0)``.

        Supported: ``get``, ``set``, ``add``, ``multiply``, ``divide``, ``power``, ``min``, ``max``, ``apply``.
        """
        return _NamedIndexUpdateHelper(self)

    # shape methods ----------------------------------------------------------------------------------
    def rename(self, renames: Mapping[AxisSelector, AxisSelector]) -> NamedArray:
        """See :func:`ponente.namedtensor.rename`."""
        return rename(self, renames)

    def broadcast_to(
        self, axes: AxisSpec, ensure_order: bool = True, enforce_no_extra_axes: bool = True
    ) -> NamedArray:
        """See :func:`ponente.namedtensor.broadcast_to`."""
        return broadcast_to(self, axes, ensure_order=ensure_order, enforce_no_extra_axes=enforce_no_extra_axes)

    def broadcast_axis(self, axis: AxisSpec) -> NamedArray:
        """See :func:`ponente.namedtensor.broadcast_axis`."""
        return broadcast_axis(self, axis)

    def flatten_axes(self, old_axes: AxisSelection, new_axis: AxisSelector) -> NamedArray:
        """See :func:`ponente.namedtensor.flatten_axes`."""
        return flatten_axes(self, old_axes, new_axis)

    def unflatten_axis(self, axis: AxisSelector, new_axes: AxisSpec) -> NamedArray:
        """See :func:`ponente.namedtensor.unflatten_axis`."""
        return unflatten_axis(self, axis, new_axes)

    def ravel(self, new_axis_name: AxisSelector) -> NamedArray:
        """See :func:`ponente.namedtensor.ravel`."""
        return ravel(self, new_axis_name)

    def flatten(self, new_axis_name: AxisSelector) -> NamedArray:
        """See :func:`ponente.namedtensor.flatten`."""
        return flatten(self, new_axis_name)

    def split(self, axis: AxisSelector, new_axes: Sequence[Axis]) -> list[NamedArray]:
        """See :func:`ponente.namedtensor.split`."""
        return split(self, axis, new_axes)

    def unbind(self, axis: AxisSelector) -> list[NamedArray]:
        """See :func:`ponente.namedtensor.unbind`."""
        return unbind(self, axis)

    def roll(self, shift: int | Sequence[int], axis: AxisSelection) -> NamedArray:
        """See :func:`ponente.namedtensor.roll`."""
        return roll(self, shift, axis)

    def slice(
        self,
        axis: AxisSelector | Mapping[AxisSelector, Any],
        new_axis: AxisSelector | None = None,
        start: Any = 0,
        length: int | Mapping[AxisSelector, int] | None = None,
    ) -> NamedArray:
        """See :func:`ponente.namedtensor.slice`."""
        return slice(self, axis, new_axis=new_axis, start=start, length=length)

    def updated_slice(self, start: Mapping[AxisSelector, Any], update: NamedArray) -> NamedArray:
        """See :func:`ponente.namedtensor.updated_slice`."""
        return updated_slice(self, start, update)

    def take(self, axis: AxisSelector, index: Any) -> NamedArray:
        """See :func:`ponente.namedtensor.take`."""
        return take(self, axis, index)

    def rearrange(self, *args: Any, **kwargs: Any) -> NamedArray:
        """See :func:`ponente.namedtensor.rearrange`."""
        return _api().rearrange(self, *args, **kwargs)

    def dot(self, *args: Any, **kwargs: Any) -> NamedArray:
        """Contracts with other arrays; see :func:`ponente.namedtensor.dot`."""
        return _api().dot(self, *args, **kwargs)

    def astype(self, dtype: Any) -> NamedArray:
        """The array with its elements converted to ``dtype``."""
        return NamedArray(self.array.astype(dtype), self.axes)

    # reductions, cumulative, sorting, element-wise method forms ------------------------------------
    def sum(
        self, axis: AxisSelection | None = None, *, where: NamedArray | None = None, dtype: Any = None
    ) -> NamedArray:
        """See :func:`ponente.namedtensor.sum`."""
        return _api().sum(self, axis, where=where, dtype=dtype)

    def prod(
        self, axis: AxisSelection | None = None, *, where: NamedArray | None = None, dtype: Any = None
    ) -> NamedArray:
        """See :func:`ponente.namedtensor.prod`."""
        return _api().prod(self, axis, where=where, dtype=dtype)

    def mean(
        self, axis: AxisSelection | None = None, *, where: NamedArray | None = None, dtype: Any = None
    ) -> NamedArray:
        """See :func:`ponente.namedtensor.mean`."""
        return _api().mean(self, axis, where=where, dtype=dtype)

    def max(self, axis: AxisSelection | None = None, *, where: NamedArray | None = None) -> NamedArray:
        """See :func:`ponente.namedtensor.max`."""
        return _api().max(self, axis, where=where)

    def min(self, axis: AxisSelection | None = None, *, where: NamedArray | None = None) -> NamedArray:
        """See :func:`ponente.namedtensor.min`."""
        return _api().min(self, axis, where=where)

    def std(
        self, axis: AxisSelection | None = None, *, where: NamedArray | None = None, ddof: int = 0, dtype: Any = None
    ) -> NamedArray:
        """See :func:`ponente.namedtensor.std`."""
        return _api().std(self, axis, where=where, ddof=ddof, dtype=dtype)

    def var(
        self, axis: AxisSelection | None = None, *, where: NamedArray | None = None, ddof: int = 0, dtype: Any = None
    ) -> NamedArray:
        """See :func:`ponente.namedtensor.var`."""
        return _api().var(self, axis, where=where, ddof=ddof, dtype=dtype)

    def all(self, axis: AxisSelection | None = None, *, where: NamedArray | None = None) -> NamedArray:
        """See :func:`ponente.namedtensor.all`."""
        return _api().all(self, axis, where=where)

    def any(self, axis: AxisSelection | None = None, *, where: NamedArray | None = None) -> NamedArray:
        """See :func:`ponente.namedtensor.any`."""
        return _api().any(self, axis, where=where)

    def ptp(self, axis: AxisSelection | None = None, *, where: NamedArray | None = None) -> NamedArray:
        """See :func:`ponente.namedtensor.ptp`."""
        return _api().ptp(self, axis, where=where)

    def argmax(self, axis: AxisSelector | None = None) -> NamedArray:
        """See :func:`ponente.namedtensor.argmax`."""
        return _api().argmax(self, axis)

    def argmin(self, axis: AxisSelector | None = None) -> NamedArray:
        """See :func:`ponente.namedtensor.argmin`."""
        return _api().argmin(self, axis)

    def cumsum(self, axis: AxisSelector, *, dtype: Any = None) -> NamedArray:
        """See :func:`ponente.namedtensor.cumsum`."""
        return _api().cumsum(self, axis, dtype=dtype)

    def cumprod(self, axis: AxisSelector, *, dtype: Any = None) -> NamedArray:
        """See :func:`ponente.namedtensor.cumprod`."""
        return _api().cumprod(self, axis, dtype=dtype)

    def sort(self, axis: AxisSelector) -> NamedArray:
        """See :func:`ponente.namedtensor.sort`."""
        return _api().sort(self, axis)

    def argsort(self, axis: AxisSelector) -> NamedArray:
        """See :func:`ponente.namedtensor.argsort`."""
        return _api().argsort(self, axis)

    def clip(self, a_min: Any = None, a_max: Any = None) -> NamedArray:
        """See :func:`ponente.namedtensor.clip`."""
        return _api().clip(self, a_min, a_max)

    def tril(self, axis1: AxisSelector, axis2: AxisSelector, k: int = 0) -> NamedArray:
        """See :func:`ponente.namedtensor.tril`."""
        return _api().tril(self, axis1, axis2, k)

    def triu(self, axis1: AxisSelector, axis2: AxisSelector, k: int = 0) -> NamedArray:
        """See :func:`ponente.namedtensor.triu`."""
        return _api().triu(self, axis1, axis2, k)

    def trace(self, axis1: AxisSelector, axis2: AxisSelector, offset: int = 0, dtype: Any = None) -> NamedArray:
        """See :func:`ponente.namedtensor.trace`."""
        return _api().trace(self, axis1, axis2, offset=offset, dtype=dtype)

    def round(self, decimals: int = 0) -> NamedArray:
        """See :func:`ponente.namedtensor.round`."""
        return NamedArray(jnp.round(self.array, decimals), self.axes)

    def conj(self) -> NamedArray:
        """The complex conjugate."""
        return NamedArray(jnp.conj(self.array), self.axes)

    def conjugate(self) -> NamedArray:
        """The complex conjugate."""
        return self.conj()

    @property
    def real(self) -> NamedArray:
        """The real part."""
        return NamedArray(jnp.real(self.array), self.axes)

    @property
    def imag(self) -> NamedArray:
        """The imaginary part."""
        return NamedArray(jnp.imag(self.array), self.axes)

    def copy(self) -> NamedArray:
        """A copy of the array."""
        return NamedArray(jnp.array(self.array, copy=True), self.axes)

    # operators --------------------------------------------------------------------------------------
    def __add__(self, other: Any) -> NamedArray:
        return _binary(jnp.add, self, other)

    def __radd__(self, other: Any) -> NamedArray:
        return _binary(jnp.add, other, self)

    def __sub__(self, other: Any) -> NamedArray:
        return _binary(jnp.subtract, self, other)

    def __rsub__(self, other: Any) -> NamedArray:
        return _binary(jnp.subtract, other, self)

    def __mul__(self, other: Any) -> NamedArray:
        return _binary(jnp.multiply, self, other)

    def __rmul__(self, other: Any) -> NamedArray:
        return _binary(jnp.multiply, other, self)

    def __truediv__(self, other: Any) -> NamedArray:
        return _binary(jnp.true_divide, self, other)

    def __rtruediv__(self, other: Any) -> NamedArray:
        return _binary(jnp.true_divide, other, self)

    def __floordiv__(self, other: Any) -> NamedArray:
        return _binary(jnp.floor_divide, self, other)

    def __rfloordiv__(self, other: Any) -> NamedArray:
        return _binary(jnp.floor_divide, other, self)

    def __mod__(self, other: Any) -> NamedArray:
        return _binary(jnp.mod, self, other)

    def __rmod__(self, other: Any) -> NamedArray:
        return _binary(jnp.mod, other, self)

    def __divmod__(self, other: Any) -> tuple[NamedArray, NamedArray]:
        return _binary(jnp.floor_divide, self, other), _binary(jnp.mod, self, other)

    def __rdivmod__(self, other: Any) -> tuple[NamedArray, NamedArray]:
        return _binary(jnp.floor_divide, other, self), _binary(jnp.mod, other, self)

    def __pow__(self, other: Any) -> NamedArray:
        return _binary(jnp.power, self, other)

    def __rpow__(self, other: Any) -> NamedArray:
        return _binary(jnp.power, other, self)

    def __matmul__(self, other: Any) -> NamedArray:
        raise TypeError("`@` is positional; contract named axes with hax.dot(a, b, axis=...) instead")

    def __and__(self, other: Any) -> NamedArray:
        return _binary(jnp.bitwise_and, self, other)

    def __rand__(self, other: Any) -> NamedArray:
        return _binary(jnp.bitwise_and, other, self)

    def __or__(self, other: Any) -> NamedArray:
        return _binary(jnp.bitwise_or, self, other)

    def __ror__(self, other: Any) -> NamedArray:
        return _binary(jnp.bitwise_or, other, self)

    def __xor__(self, other: Any) -> NamedArray:
        return _binary(jnp.bitwise_xor, self, other)

    def __rxor__(self, other: Any) -> NamedArray:
        return _binary(jnp.bitwise_xor, other, self)

    def __lshift__(self, other: Any) -> NamedArray:
        return _binary(jnp.left_shift, self, other)

    def __rlshift__(self, other: Any) -> NamedArray:
        return _binary(jnp.left_shift, other, self)

    def __rshift__(self, other: Any) -> NamedArray:
        return _binary(jnp.right_shift, self, other)

    def __rrshift__(self, other: Any) -> NamedArray:
        return _binary(jnp.right_shift, other, self)

    def __lt__(self, other: Any) -> NamedArray:
        return _binary(jnp.less, self, other)

    def __le__(self, other: Any) -> NamedArray:
        return _binary(jnp.less_equal, self, other)

    def __gt__(self, other: Any) -> NamedArray:
        return _binary(jnp.greater, self, other)

    def __ge__(self, other: Any) -> NamedArray:
        return _binary(jnp.greater_equal, self, other)

    def __eq__(self, other: Any) -> NamedArray:  # type: ignore[override]
        return _binary(jnp.equal, self, other)

    def __ne__(self, other: Any) -> NamedArray:  # type: ignore[override]
        return _binary(jnp.not_equal, self, other)

    __hash__ = object.__hash__

    def __neg__(self) -> NamedArray:
        return NamedArray(jnp.negative(self.array), self.axes)

    def __pos__(self) -> NamedArray:
        return NamedArray(jnp.positive(self.array), self.axes)

    def __abs__(self) -> NamedArray:
        return NamedArray(jnp.abs(self.array), self.axes)

    def __invert__(self) -> NamedArray:
        return NamedArray(jnp.invert(self.array), self.axes)

    def __round__(self, ndigits: int | None = None) -> NamedArray:
        return NamedArray(jnp.round(self.array, ndigits or 0), self.axes)


def _fmt_axes(axes: Sequence[Axis]) -> str:
    return "(" + ", ".join(f"{ax.name}={ax.size}" for ax in axes) + ")"


def _is_scalar_like(x: Any) -> bool:
    return isinstance(x, int | float | complex | bool | np.generic) or (hasattr(x, "ndim") and x.ndim == 0)


def _check_positional_operand(x: Any, what: str) -> None:
    if not isinstance(x, NamedArray) and not _is_scalar_like(x):
        shape = getattr(x, "shape", None)
        raise TypeError(
            f"{what}: cannot combine a NamedArray with a positional array of shape {shape}; name its axes with "
            "hax.named(array, names) first (only scalars broadcast without names)"
        )


def _result_axes(arrays: Sequence[NamedArray], require_subset: bool = True) -> tuple[Axis, ...]:
    """The broadcast axes of several arrays: the largest operand's order (subset rule) or their union."""
    sizes: dict[str, int] = {}
    for a in arrays:
        for ax in a.axes:
            if ax.name in sizes and sizes[ax.name] != ax.size:
                raise ValueError(
                    f"cannot broadcast: axis {ax.name!r} has size {sizes[ax.name]} in one operand and {ax.size} in "
                    f"another (operands have axes {', '.join(_fmt_axes(b.axes) for b in arrays)})"
                )
            sizes[ax.name] = ax.size
    if not arrays:
        return ()
    largest = arrays[0]
    for a in arrays[1:]:
        if a.ndim > largest.ndim:
            largest = a
    if len(largest.axes) == len(sizes):
        return largest.axes
    if require_subset:
        big = set(largest.axis_names)
        for a in arrays:
            extra = [n for n in a.axis_names if n not in big]
            if extra:
                missing = [n for n in largest.axis_names if n not in set(a.axis_names)]
                raise ValueError(
                    f"cannot broadcast by name: one operand's axes must be a subset of the other's, but "
                    f"{_fmt_axes(a.axes)} has {extra} not in {_fmt_axes(largest.axes)}, which has {missing} not "
                    f"in {_fmt_axes(a.axes)}. Add axes explicitly with hax.broadcast_axis or hax.broadcast_to."
                )
    out = list(largest.axes)
    seen = set(largest.axis_names)
    for a in arrays:
        for ax in a.axes:
            if ax.name not in seen:
                out.append(ax)
                seen.add(ax.name)
    return tuple(out)


def _aligned(a: NamedArray, axes: tuple[Axis, ...]) -> jax.Array:
    """``a``'s array transposed and expanded (size-1 dims) to line up with ``axes``; no materialised broadcast."""
    if a.axes == axes:
        return a.array
    names = [ax.name for ax in axes]
    own = a.axis_names
    order = sorted(range(len(own)), key=lambda i: names.index(own[i]))
    arr = a.array if order == list(range(len(own))) else jnp.transpose(a.array, order)
    present = set(own)
    new_shape = [ax.size if ax.name in present else 1 for ax in axes]
    return arr.reshape(new_shape) if len(new_shape) != arr.ndim else arr


def _binary(op: Any, a: Any, b: Any) -> Any:
    if isinstance(a, NamedArray) and isinstance(b, NamedArray):
        if a.axes == b.axes:
            return NamedArray(op(a.array, b.array), a.axes)
        axes = _result_axes([a, b])
        return NamedArray(op(_aligned(a, axes), _aligned(b, axes)), axes)
    named, positional = (a, b) if isinstance(a, NamedArray) else (b, a)
    if not named.axes and not _is_scalar_like(positional):
        # a NamedArray without axes is a scalar: with a positional array the result is positional (there are no
        # names to keep), e.g. a scanned 0-d slice added to a plain carry
        return op(a.array if a is named else a, b.array if b is named else b)
    _check_positional_operand(positional, getattr(op, "__name__", "operator"))
    if a is named:
        return NamedArray(op(a.array, b), a.axes)
    return NamedArray(op(a, b.array), b.axes)


def broadcast_to(a: Any, axis: AxisSpec, ensure_order: bool = True, enforce_no_extra_axes: bool = True) -> NamedArray:
    """Broadcasts ``a`` so that it has (at least) the axes ``axis``.

    Args:
        a: a named array or a scalar.
        axis: the target axes (with sizes).
        ensure_order: if True the result's axes are ``axis`` in that order, followed by any extra axes of ``a``;
            if False, missing axes are added in front of ``a``'s axes.
        enforce_no_extra_axes: if True, ``a`` may only have axes that are in ``axis``.

    Returns:
        The broadcast named array.

    Raises:
        ValueError: if ``a`` has axes not in ``axis`` (with ``enforce_no_extra_axes``) or sizes differ.

    Example:
        >>> import jax.numpy as jnp
        >>> x = named(jnp.arange(3), "b")
        >>> broadcast_to(x, (Axis("a", 2), Axis("b", 3))).shape
        {'a': 2, 'b': 3}
    """
    from .axis import axis_spec_to_tuple

    target = tuple(axis_spec_to_tuple(axis))
    for t in target:
        if not isinstance(t, Axis):
            raise TypeError(f"broadcast_to needs axes with sizes, got only the name {t!r}")
    target_axes: tuple[Axis, ...] = target  # type: ignore[assignment]
    if not isinstance(a, NamedArray):
        _check_positional_operand(a, "broadcast_to")
        arr = jnp.asarray(a)
        return NamedArray(jnp.broadcast_to(arr, tuple(ax.size for ax in target_axes)), target_axes)
    tnames = {ax.name: ax for ax in target_axes}
    for ax in a.axes:
        if ax.name in tnames and tnames[ax.name].size != ax.size:
            raise ValueError(
                f"broadcast_to: axis {ax.name!r} has size {ax.size} in the array but {tnames[ax.name].size} in the "
                f"target {_fmt_axes(target_axes)}"
            )
    extra = tuple(ax for ax in a.axes if ax.name not in tnames)
    if extra and enforce_no_extra_axes:
        raise ValueError(
            f"broadcast_to: the array has axes {[ax.name for ax in extra]} that are not in the target "
            f"{_fmt_axes(target_axes)}"
        )
    if ensure_order:
        full = target_axes + extra
    else:
        present = set(a.axis_names)
        full = tuple(ax for ax in target_axes if ax.name not in present) + a.axes
    if full == a.axes:
        return a
    arr = jnp.broadcast_to(_aligned(a, full), tuple(ax.size for ax in full))
    return NamedArray(arr, full)


def broadcast_axis(a: NamedArray, axis: AxisSpec) -> NamedArray:
    """Adds the axes ``axis`` that ``a`` lacks, in front; axes ``a`` already has are kept in place.

    Args:
        a: the named array.
        axis: one axis or several (with sizes).

    Returns:
        The broadcast array: new axes first, then ``a``'s axes in their order.

    Raises:
        ValueError: if an axis is present with a different size.

    Example:
        >>> import jax.numpy as jnp
        >>> broadcast_axis(named(jnp.arange(3), "b"), Axis("a", 2)).shape
        {'a': 2, 'b': 3}
    """
    return broadcast_to(a, axis, ensure_order=False, enforce_no_extra_axes=False)


def broadcast_arrays(*arrays: Any, require_subset: bool = True, ensure_order: bool = True) -> tuple[Any, ...]:
    """Broadcasts named arrays to common axes by name.

    With ``require_subset`` (the default, the rule binary operations follow), the operand with the most axes
    must contain every other operand's axes, and all results take its axis order. Otherwise the result
    axes are the union: the largest operand's axes, then the others' new axes in order of appearance.
    Scalars and ``None`` pass through unchanged.

    Args:
        *arrays: named arrays and scalars.
        require_subset: whether to require the subset rule instead of taking the union.
        ensure_order: whether every result has exactly the common order (always True here; kept for Haliax).

    Returns:
        A tuple with one entry per input.

    Raises:
        ValueError: if the subset rule is violated (naming the axes) or sizes differ.

    Example:
        >>> import jax.numpy as jnp
        >>> x, y = broadcast_arrays(named(jnp.ones((2, 3)), ("a", "b")), named(jnp.ones(2), "a"))
        >>> y.axes == x.axes
        True
    """
    del ensure_order
    named_ones = [a for a in arrays if isinstance(a, NamedArray)]
    for a in arrays:
        if a is not None and not isinstance(a, NamedArray):
            _check_positional_operand(a, "broadcast_arrays")
    axes = _result_axes(named_ones, require_subset=require_subset)
    return tuple(broadcast_to(a, axes) if isinstance(a, NamedArray) else a for a in arrays)


# renaming and reshaping ---------------------------------------------------------------------------------------
def rename(array: NamedArray, renames: Mapping[AxisSelector, AxisSelector]) -> NamedArray:
    """Renames axes. The data and the axis order are unchanged.

    Args:
        array: the named array.
        renames: ``{old: new}``; ``new`` may be a name or an :class:`Axis` of the same size.

    Returns:
        The renamed array.

    Raises:
        ValueError: if an old axis is absent, a new size differs, or names collide.

    Example:
        >>> import jax.numpy as jnp
        >>> rename(named(jnp.ones((2, 3)), ("a", "b")), {"a": "x"}).shape
        {'x': 2, 'b': 3}
    """
    mapping: dict[str, AxisSelector] = {}
    for old, new in renames.items():
        old_ax = array.resolve_axis(old)
        if isinstance(new, Axis) and new.size != old_ax.size:
            raise ValueError(f"rename: axis {old_ax.name!r} has size {old_ax.size}, cannot rename it to {new}")
        mapping[old_ax.name] = new
    axes = tuple(Axis(axis_name(mapping[ax.name]), ax.size) if ax.name in mapping else ax for ax in array.axes)
    return NamedArray(array.array, axes)


def flatten_axes(array: NamedArray, old_axes: AxisSelection, new_axis: AxisSelector) -> NamedArray:
    """Merges several axes into one, placed where the first of them was (row-major, in the given order).

    Args:
        array: the named array.
        old_axes: the axes to merge, in the order of the merged index (first is slowest).
        new_axis: the name (or :class:`Axis` with the product size) of the merged axis.

    Returns:
        The array with ``old_axes`` replaced by ``new_axis``.

    Raises:
        ValueError: if an axis is absent or ``new_axis``'s size is wrong.

    Example:
        >>> import jax.numpy as jnp
        >>> flatten_axes(named(jnp.ones((2, 3, 4)), ("a", "b", "c")), ("a", "b"), "ab").shape
        {'ab': 6, 'c': 4}
    """
    olds = tuple(array.resolve_axis(ax) for ax in ensure_tuple(old_axes))  # type: ignore[arg-type]
    if not olds:
        raise ValueError("flatten_axes: no axes to flatten")
    size = int(np.prod([ax.size for ax in olds], dtype=np.int64))
    new = _sized_axis(new_axis, size, "flatten_axes")
    old_names = {ax.name for ax in olds}
    if new.name in array.axis_names and new.name not in old_names:
        raise ValueError(f"flatten_axes: new axis name {new.name!r} already used by {_fmt_axes(array.axes)}")
    first = min(array.axis_names.index(ax.name) for ax in olds)
    rest = [ax for ax in array.axes if ax.name not in old_names]
    before = [ax for ax in array.axes[:first] if ax.name not in old_names]
    after = rest[len(before) :]
    order = before + list(olds) + after
    arr = jnp.transpose(array.array, [array.axis_names.index(ax.name) for ax in order])
    out_axes = (*before, new, *after)
    return NamedArray(arr.reshape([ax.size for ax in out_axes]), tuple(out_axes))


def _sized_axis(axis: AxisSelector, size: int, where: str) -> Axis:
    if isinstance(axis, Axis):
        if axis.size != size:
            raise ValueError(f"{where}: axis {axis.name!r} must have size {size}, got {axis.size}")
        return axis
    return Axis(axis, size)


def unflatten_axis(array: NamedArray, axis: AxisSelector, new_axes: AxisSpec) -> NamedArray:
    """Splits one axis into several (row-major), in its place. The inverse of :func:`flatten_axes`.

    Args:
        array: the named array.
        axis: the axis to split.
        new_axes: the axes replacing it; the product of their sizes must equal its size.

    Returns:
        The reshaped array.

    Raises:
        ValueError: if the sizes do not multiply to the axis size.

    Example:
        >>> import jax.numpy as jnp
        >>> x = named(jnp.ones((6, 4)), ("ab", "c"))
        >>> unflatten_axis(x, "ab", (Axis("a", 2), Axis("b", 3))).shape
        {'a': 2, 'b': 3, 'c': 4}
    """
    from .axis import axis_spec_to_tuple, replace_axis

    old = array.resolve_axis(axis)
    new = tuple(axis_spec_to_tuple(new_axes))
    if any(not isinstance(n, Axis) for n in new):
        raise TypeError(f"unflatten_axis: new axes need sizes, got {new_axes}")
    size = int(np.prod([n.size for n in new], dtype=np.int64))  # type: ignore[union-attr]
    if size != old.size:
        raise ValueError(
            f"unflatten_axis: axis {old.name!r} has size {old.size} but the new axes {axis_name(new)} "
            f"multiply to {size}"
        )
    out_axes = replace_axis(array.axes, old, new)  # type: ignore[arg-type]
    return NamedArray(array.array.reshape([ax.size for ax in out_axes]), out_axes)


def ravel(array: NamedArray, new_axis_name: AxisSelector) -> NamedArray:
    """Flattens all axes (row-major, in axis order) into one axis.

    Args:
        array: the named array.
        new_axis_name: name (or sized :class:`Axis`) of the single axis.

    Returns:
        A one-axis array.

    Example:
        >>> import jax.numpy as jnp
        >>> ravel(named(jnp.ones((2, 3)), ("a", "b")), "ab").shape
        {'ab': 6}
    """
    new = _sized_axis(new_axis_name, array.size, "ravel")
    return NamedArray(array.array.reshape(-1), (new,))


def flatten(array: NamedArray, new_axis_name: AxisSelector) -> NamedArray:
    """Same as :func:`ravel`: flattens all axes into one."""
    return ravel(array, new_axis_name)


def split(a: NamedArray, axis: AxisSelector, new_axes: Sequence[Axis]) -> list[NamedArray]:
    """Splits an axis into consecutive pieces; piece ``i`` has the axis ``new_axes[i]`` in its place.

    Args:
        a: the named array.
        axis: the axis to split.
        new_axes: one axis per piece; their sizes must add up to the axis size.

    Returns:
        The list of pieces.

    Raises:
        ValueError: if the sizes do not add up.

    Example:
        >>> import jax.numpy as jnp
        >>> x, y = split(named(jnp.arange(5), "a"), "a", [Axis("a", 2), Axis("a", 3)])
        >>> y.array.tolist()
        [2, 3, 4]
    """
    old = a.resolve_axis(axis)
    total = builtins_sum(ax.size for ax in new_axes)
    if total != old.size:
        raise ValueError(f"split: axis {old.name!r} has size {old.size} but the new axes' sizes add up to {total}")
    i = a.axis_names.index(old.name)
    cuts = np.cumsum([ax.size for ax in new_axes])[:-1].tolist()
    pieces = jnp.split(a.array, cuts, axis=i)
    return [NamedArray(p, (*a.axes[:i], ax, *a.axes[i + 1 :])) for p, ax in zip(pieces, new_axes)]


def unbind(array: NamedArray, axis: AxisSelector) -> list[NamedArray]:
    """Splits along an axis into a list of arrays without it.

    Args:
        array: the named array.
        axis: the axis to unbind.

    Returns:
        ``axis.size`` arrays.

    Example:
        >>> import jax.numpy as jnp
        >>> tuple(x.item() for x in unbind(named(jnp.arange(3), "a"), "a"))
        (0, 1, 2)
    """
    i = array._index_of(axis)
    rest = array.axes[:i] + array.axes[i + 1 :]
    return [NamedArray(p, rest) for p in jnp.moveaxis(array.array, i, 0)]


def roll(array: NamedArray, shift: int | Sequence[int], axis: AxisSelection) -> NamedArray:
    """Rolls elements along one or several axes (like ``jnp.roll``).

    Args:
        array: the named array.
        shift: the shift, or one per axis.
        axis: the axis or axes.

    Returns:
        The rolled array (same axes).

    Example:
        >>> import jax.numpy as jnp
        >>> roll(named(jnp.arange(4), "a"), 1, "a").array.tolist()
        [3, 0, 1, 2]
    """
    if isinstance(shift, NamedArray):
        if shift.axes:
            raise TypeError(f"roll: a named shift must have no axes, got one with axes {_fmt_axes(shift.axes)}")
        shift = shift.array
    if isinstance(axis, Axis | str):
        return NamedArray(jnp.roll(array.array, shift, array._index_of(axis)), array.axes)
    idx = tuple(array._index_of(ax) for ax in ensure_tuple(axis))  # type: ignore[arg-type]
    return NamedArray(jnp.roll(array.array, shift, idx), array.axes)


# slicing and indexing ----------------------------------------------------------------------------------------
def slice(
    array: NamedArray,
    axis: AxisSelector | Mapping[AxisSelector, Any],
    new_axis: AxisSelector | None = None,
    start: Any = 0,
    length: int | Mapping[AxisSelector, int] | None = None,
) -> NamedArray:
    """Takes a contiguous slice along one or several axes; the start may be traced, the length is static.

    Two forms: ``slice(x, "pos", start=i, length=4)`` (optionally renaming the axis with ``new_axis``),
    and ``slice(x, {"pos": i, "batch": 0}, length={"pos": 4, "batch": 2})``.

    Args:
        array: the named array.
        axis: the axis to slice, or a ``{axis: start}`` mapping.
        new_axis: the name (or :class:`Axis`) of the sliced axis; by default the old name.
        start: the start index (an int or traced integer), single-axis form only.
        length: the static length (single-axis form; default: to the end), or a ``{axis: length}`` mapping.

    Returns:
        The sliced array.

    Raises:
        ValueError: if an axis is absent or a length is missing/too large.

    Example:
        >>> import jax.numpy as jnp
        >>> slice(named(jnp.arange(6), "a"), "a", start=2, length=3).array.tolist()
        [2, 3, 4]
    """
    if isinstance(axis, Mapping):
        starts = dict(axis)
        lengths = dict(length) if isinstance(length, Mapping) else {}
        out = array
        for ax, st in starts.items():
            ln = lengths.get(ax, lengths.get(axis_name(ax))) if lengths else None
            out = slice(out, ax, start=st, length=ln)
        return out
    old = array.resolve_axis(axis)
    i = array.axis_names.index(old.name)
    if length is None:
        if not isinstance(start, int):
            raise ValueError(f"slice: axis {old.name!r} needs a static length when the start is traced")
        length = old.size - start
    if not isinstance(length, int) or length < 0 or length > old.size:
        raise ValueError(f"slice: length {length} is invalid for axis {old.name!r} of size {old.size}")
    new = _sized_axis(new_axis if new_axis is not None else old.name, length, "slice")
    if isinstance(start, int):
        if start < 0 or start + length > old.size:
            raise ValueError(
                f"slice: [{start}, {start + length}) is out of bounds for axis {old.name!r} of size {old.size}"
            )
        arr = jax.lax.slice_in_dim(array.array, start, start + length, axis=i)
    else:
        arr = jax.lax.dynamic_slice_in_dim(array.array, start, length, axis=i)
    return NamedArray(arr, (*array.axes[:i], new, *array.axes[i + 1 :]))


def updated_slice(array: NamedArray, start: Mapping[AxisSelector, Any], update: NamedArray) -> NamedArray:
    """Writes ``update`` into ``array`` at the given (possibly traced) starts, like ``lax.dynamic_update_slice``.

    ``update`` has a subset of ``array``'s axes (in any order); an axis it lacks is written at its start
    index only (as if of size 1). Axes without a start begin at 0. A start may be a named array of starts
    (a *ragged* update): its axes must be axes of ``array``, and each element along them gets its own start,
    e.g. one write position per sequence of a batch.

    Args:
        array: the named array to update.
        start: ``{axis: start index}``; an index is an int, a traced integer scalar, or a named integer array.
        update: the values to write.

    Returns:
        The updated array.

    Raises:
        ValueError: if ``update`` has an axis ``array`` lacks, is larger along an axis, or (static start) does not
            fit; or if a start names an axis ``array`` lacks.

    Example:
        >>> import jax.numpy as jnp
        >>> x = named(jnp.zeros(5, int), "a")
        >>> updated_slice(x, {"a": 1}, named(jnp.array([7, 8]), "a")).array.tolist()
        [0, 7, 8, 0, 0]
        >>> cache = named(jnp.zeros((2, 4), int), ("batch", "seq"))
        >>> lengths = named(jnp.array([0, 2]), "batch")
        >>> updated_slice(cache, {"seq": lengths}, named(jnp.array([5, 6]), "batch")).array.tolist()
        [[5, 0, 0, 0], [0, 0, 6, 0]]
    """
    names = array.axis_names
    starts: dict[str, Any] = {}
    for key, value in start.items():
        name = axis_name(key)
        if name not in names:
            raise ValueError(f"updated_slice: start given for axis {name!r}, which is not in {_fmt_axes(array.axes)}")
        starts[name] = value.array if isinstance(value, NamedArray) and not value.axes else value
    extra = [ax.name for ax in update.axes if ax.name not in names]
    if extra:
        raise ValueError(
            f"updated_slice: the update has axes {extra} that are not in the original array with shape "
            f"{_fmt_axes(array.axes)}"
        )
    for ax in update.axes:
        if ax.size > array.axis_size(ax.name):
            raise ValueError(
                f"updated_slice: update axis {ax.name!r} has size {ax.size} > {array.axis_size(ax.name)} in the array"
            )
    for value in starts.values():
        if isinstance(value, NamedArray):
            for ax in value.axes:
                if ax.name not in names:
                    raise ValueError(
                        f"updated_slice: the start indices have axis {ax.name!r}, which is not in the array's axes "
                        f"{_fmt_axes(array.axes)}"
                    )
            return _ragged_updated_slice(array, starts, update, value.axes[0].name)
    for name, s in starts.items():
        if isinstance(s, int | np.integer):
            length = update.axis_size(name) if name in update.axis_names else 1
            if s < 0 or int(s) + length > array.axis_size(name):
                raise ValueError(
                    f"updated_slice: {length} element(s) starting at {int(s)} do not fit axis {name!r} of size "
                    f"{array.axis_size(name)}"
                )
    un = update.axis_names
    order = [un.index(n) for n in names if n in un]
    upd = jnp.transpose(update.array, order) if order != list(range(len(order))) else update.array
    upd = upd.reshape([update.axis_size(n) if n in un else 1 for n in names])
    idx = [starts.get(n, 0) for n in names]
    return NamedArray(jax.lax.dynamic_update_slice(array.array, upd.astype(array.dtype), idx), array.axes)


def _ragged_updated_slice(array: NamedArray, starts: dict[str, Any], update: NamedArray, name: str) -> NamedArray:
    """:func:`updated_slice` mapped (``jax.vmap``) over axis ``name`` of the named start indices."""

    def along(x: Any) -> bool:
        return isinstance(x, NamedArray) and name in x.axis_names

    def without(axes: tuple[Axis, ...]) -> tuple[Axis, ...]:
        return tuple(ax for ax in axes if ax.name != name)

    keys = list(starts)
    mapped = [starts[k].array if along(starts[k]) else None for k in keys]
    start_dims = [starts[k].axis_names.index(name) if along(starts[k]) else None for k in keys]

    def one(arr: jax.Array, raw_starts: list[Any], upd: Any) -> jax.Array:
        inner: dict[AxisSelector, Any] = {
            k: NamedArray(raw, without(starts[k].axes)) if along(starts[k]) else starts[k]
            for k, raw in zip(keys, raw_starts)
        }
        inner_update = NamedArray(upd, without(update.axes)) if along(update) else update
        return updated_slice(NamedArray(arr, without(array.axes)), inner, inner_update).array

    pos = array.axis_names.index(name)
    upd_dim = update.axis_names.index(name) if along(update) else None
    out = jax.vmap(one, in_axes=(pos, start_dims, upd_dim))(
        array.array, mapped, update.array if along(update) else None
    )
    return NamedArray(jnp.moveaxis(out, 0, pos), array.axes)


def take(array: NamedArray, axis: AxisSelector, index: Any) -> NamedArray:
    """Selects elements along an axis by integer index (an int or a named array of indices).

    With a named index, ``axis`` is replaced by the index's axes. If the index shares no other axis with
    ``array``, they take ``axis``'s place; otherwise the shared axes are matched element-wise (a batched
    gather) and, as in Haliax, the index's other axes come first, followed by ``array``'s remaining axes.

    Args:
        array: the named array.
        axis: the axis to index.
        index: an int, a traced integer scalar, or a named integer array.

    Returns:
        The gathered array.

    Example:
        >>> import jax.numpy as jnp
        >>> emb = named(jnp.arange(6).reshape(3, 2), ("vocab", "embed"))
        >>> take(emb, "vocab", named(jnp.array([2, 0]), "pos")).array.tolist()
        [[4, 5], [0, 1]]
    """
    name = array.resolve_axis(axis).name
    out = array[{name: index}]
    if not isinstance(index, NamedArray):
        return out
    if not any(ax.name != name and ax.name in array.axis_names for ax in index.axes):
        return out
    new = tuple(ax for ax in index.axes if ax.name == name or ax.name not in array.axis_names)
    order = (*new, *(ax for ax in array.axes if ax.name != name))
    return NamedArray(_aligned(out, order), order)


def _normalize_index(array: NamedArray, idx: Any) -> dict[str, Any]:
    if isinstance(idx, Mapping):
        pairs = list(idx.items())
    elif isinstance(idx, tuple):
        if len(idx) % 2:
            raise TypeError(
                "indexing a NamedArray by tuple needs (axis, index) pairs, e.g. x['batch', 0, 'pos', 1:3]; "
                f"got {idx!r}"
            )
        pairs = [(idx[k], idx[k + 1]) for k in range(0, len(idx), 2)]
    else:
        raise TypeError(
            f"NamedArrays are indexed by name: x['axis', index] or x[{{'axis': index}}], not positionally ({idx!r})"
        )
    out: dict[str, Any] = {}
    for ax, i in pairs:
        if not isinstance(ax, Axis | str):
            raise TypeError(f"index keys must be axes or axis names, got {ax!r}")
        resolved = array.resolve_axis(ax)
        if resolved.name in out:
            raise ValueError(f"axis {resolved.name!r} is indexed twice")
        out[resolved.name] = _checked_index(resolved, i)
    return out


def _is_int_like(i: Any) -> bool:
    if isinstance(i, bool):
        return False
    if isinstance(i, int | np.integer):
        return True
    return (
        hasattr(i, "ndim") and not isinstance(i, NamedArray) and i.ndim == 0 and jnp.issubdtype(i.dtype, jnp.integer)
    )


def _checked_index(ax: Axis, i: Any) -> Any:
    """Validates the index of axis ``ax``; a plain 1-D integer array becomes a named one along a same-named axis."""
    from .axis import dslice

    if isinstance(i, builtins_slice | dslice):
        return i
    if _is_int_like(i):
        if isinstance(i, int | np.integer) and not -ax.size <= int(i) < ax.size:
            raise IndexError(f"index {int(i)} is out of bounds for axis {ax.name!r} of size {ax.size}")
        return i
    if isinstance(i, NamedArray):
        if not jnp.issubdtype(i.dtype, jnp.integer):
            raise TypeError(f"index for axis {ax.name!r} must be an integer NamedArray, got dtype {i.dtype}")
        return i
    if isinstance(i, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in i):
        i = np.asarray(i, dtype=np.int32)
    if getattr(i, "ndim", None) == 1 and jnp.issubdtype(i.dtype, jnp.integer):
        return NamedArray(jnp.asarray(i), (Axis(ax.name, i.shape[0]),))
    raise TypeError(
        f"unsupported index {i!r} for axis {ax.name!r}: use an int, a slice, hax.dslice, a NamedArray, or a 1-D "
        "integer array (whose result axis keeps the name)"
    )


def _index_broadcast_axes(index_axes: Sequence[tuple[Axis, ...]]) -> tuple[Axis, ...]:
    """The broadcast axes of advanced indices in Haliax's order: the largest index's axes, others' new axes first."""
    sizes: dict[str, int] = {}
    for axes in index_axes:
        for ax in axes:
            if sizes.setdefault(ax.name, ax.size) != ax.size:
                raise ValueError(
                    f"index arrays disagree on the size of axis {ax.name!r}: {sizes[ax.name]} vs {ax.size}"
                )
    ordered = sorted(index_axes, key=lambda axes: math.prod(ax.size for ax in axes), reverse=True)
    result = ordered[0]
    for axes in ordered[1:]:
        big, small = (
            (result, axes)
            if math.prod(ax.size for ax in result) >= math.prod(ax.size for ax in axes)
            else (axes, result)
        )
        big_names = {ax.name for ax in big}
        result = (*(ax for ax in small if ax.name not in big_names), *big)
    return tuple(result)


def _plan_index(array: NamedArray, idx: Any) -> tuple[tuple[Axis, ...], dict[str, Any]]:
    """Resolves an index to (result axes, {name: index}), placing axes by NumPy's advanced-indexing rules.

    Ints, named index arrays and dslices are *advanced* indices (a dslice gathers ``size`` elements along an axis
    of the same name). The index arrays broadcast together by name; an axis of ``array`` that is not indexed but
    appears in an index array is matched element-wise (it becomes advanced too). If the advanced indices are on
    adjacent axes, their broadcast axes take that place; otherwise they come first (NumPy's rule; Haliax's too).
    """
    from .axis import dslice

    norm = _normalize_index(array, idx)
    index_axes: list[tuple[Axis, ...]] = []
    for name, i in norm.items():
        if isinstance(i, dslice):
            index_axes.append((Axis(name, i.size),))
        elif isinstance(i, NamedArray):
            index_axes.append(i.axes)
    index_names = {ax.name for axes in index_axes for ax in axes}
    advanced: list[bool] = []
    kept: list[Axis | None] = []
    for ax in array.axes:
        i = norm.get(ax.name, builtins_slice(None))
        if not isinstance(i, builtins_slice):
            advanced.append(True)
            kept.append(None)
        elif ax.name in index_names:
            if i != builtins_slice(None):
                raise ValueError(f"axis {ax.name!r} is sliced and also an axis of an index array; index it by one")
            advanced.append(True)
            kept.append(None)
            index_axes.append((ax,))
        else:
            advanced.append(False)
            kept.append(Axis(ax.name, len(range(*i.indices(ax.size)))))
    kept_axes = [ax for ax in kept if ax is not None]
    if not index_axes:
        return tuple(kept_axes), norm
    new_axes = _index_broadcast_axes(index_axes)
    positions = [p for p, adv in enumerate(advanced) if adv]
    if positions == list(range(positions[0], positions[-1] + 1)):
        before = [ax for ax in kept[: positions[0]] if ax is not None]
        after = [ax for ax in kept[positions[-1] + 1 :] if ax is not None]
        return (*before, *new_axes, *after), norm
    return (*new_axes, *kept_axes), norm


def _dslice_window(arr: jax.Array, axis: int, start: Any, size: int) -> jax.Array:
    """``size`` elements of ``arr`` from ``start`` along ``axis``, zeros where that runs outside the array."""
    n = arr.shape[axis]
    if isinstance(start, int | np.integer) and start >= 0 and int(start) + size <= n:
        return jax.lax.slice_in_dim(arr, int(start), int(start) + size, axis=axis)
    positions = start + jnp.arange(size)
    valid = ((positions >= 0) & (positions < n)).reshape([size if d == axis else 1 for d in range(arr.ndim)])
    if size > n:
        window = jnp.take(arr, jnp.clip(positions, 0, n - 1), axis=axis)
    else:
        # a dynamic slice (cheap, unlike a gather) at the clamped start, rotated by how far the clamp moved it
        clamped = jnp.clip(start, 0, n - size)
        window = jnp.roll(jax.lax.dynamic_slice_in_dim(arr, clamped, size, axis=axis), clamped - start, axis=axis)
    return jnp.where(valid, window, jnp.zeros((), arr.dtype))


def _full_gather_index(array: NamedArray, out_axes: tuple[Axis, ...], norm: dict[str, Any]) -> tuple[Any, ...]:
    """Integer index arrays (one per dimension of ``array``) that broadcast to ``out_axes``.

    A dslice's positions outside the axis become ``size`` (out of bounds), for the ``fill``/``drop`` modes.
    """
    from .axis import dslice

    out_names = [ax.name for ax in out_axes]

    def along(name: str, values: Any) -> Any:
        shape = [1] * len(out_axes)
        shape[out_names.index(name)] = -1
        return jnp.reshape(values, shape)

    result = []
    for ax in array.axes:
        i = norm.get(ax.name, builtins_slice(None))
        if isinstance(i, builtins_slice):
            result.append(along(ax.name, jnp.arange(ax.size)[i]))
        elif isinstance(i, dslice):
            pos = i.start + jnp.arange(i.size)
            result.append(along(ax.name, jnp.where((pos >= 0) & (pos < ax.size), pos, ax.size)))
        elif isinstance(i, NamedArray):
            result.append(_aligned(i, out_axes))
        else:
            result.append(jnp.asarray(i).reshape([1] * len(out_axes)))
    return tuple(result)


def _has_gather(norm: dict[str, Any]) -> bool:
    from .axis import dslice

    return any(isinstance(i, NamedArray | dslice) for i in norm.values())


def index(array: NamedArray, slices: Any) -> NamedArray:
    """Indexes by axis name; the function behind ``array[...]``.

    ``slices`` is a ``{axis: index}`` dict or a tuple of ``(axis, index, axis, index, ...)``. An index is an
    int (the axis disappears), a slice (the axis shrinks), a :func:`dslice` (traced start, static length; reads
    past either end give zeros), an integer ``NamedArray``, or a plain 1-D integer array (a named array along an
    axis of the indexed axis's name). Named indices broadcast together by name; their axes that the array also
    has (and that are not indexed) are matched element-wise. The result's axes are placed by NumPy's rule for
    advanced indices (ints, index arrays and dslices): where the indexed axes were if those are adjacent,
    otherwise first.

    Args:
        array: the named array.
        slices: the index.

    Returns:
        The indexed array.

    Raises:
        ValueError / IndexError / TypeError: for unknown axes, out-of-bounds static ints, unsupported indices.

    Example:
        >>> import jax.numpy as jnp
        >>> x = named(jnp.arange(6).reshape(2, 3), ("a", "b"))
        >>> x["a", 1, "b", 1:].array.tolist()
        [4, 5]
        >>> from ponente.namedtensor import dslice
        >>> x["b", dslice(2, 2)].array.tolist()
        [[2, 0], [5, 0]]
    """
    from .axis import dslice

    out_axes, norm = _plan_index(array, slices)
    if any(isinstance(i, dslice) for i in norm.values()):
        arr, axes = array.array, list(array.axes)
        for name, i in list(norm.items()):
            if isinstance(i, dslice):
                p = array.axis_names.index(name)
                arr = _dslice_window(arr, p, i.start, i.size)
                axes[p] = Axis(name, i.size)
                norm[name] = builtins_slice(None)
        array = NamedArray(arr, tuple(axes))
    named_idx = [(name, i) for name, i in norm.items() if isinstance(i, NamedArray)]
    if not named_idx:
        positional = tuple(norm.get(ax.name, builtins_slice(None)) for ax in array.axes)
        arr = array.array[positional]
        natural = [ax.name for ax in array.axes if not _is_int_like(norm.get(ax.name, builtins_slice(None)))]
        return NamedArray(_aligned(NamedArray(arr, tuple(map(Axis, natural, arr.shape))), out_axes), out_axes)
    others_whole = all(i == builtins_slice(None) for i in norm.values() if not isinstance(i, NamedArray))
    if len(named_idx) == 1 and others_whole:
        ((name, ix),) = named_idx
        if not any(ax.name != name and ax.name in array.axis_names for ax in ix.axes):
            pos = array.axis_names.index(name)
            arr = jnp.take(array.array, ix.array, axis=pos, mode="clip")
            natural_axes = (*array.axes[:pos], *ix.axes, *array.axes[pos + 1 :])
            return NamedArray(_aligned(NamedArray(arr, natural_axes), out_axes), out_axes)
    return NamedArray(array.array[_full_gather_index(array, out_axes, norm)], out_axes)


class _NamedIndexUpdateHelper:
    def __init__(self, array: NamedArray) -> None:
        self._array = array

    def __getitem__(self, idx: Any) -> _NamedIndexUpdateRef:
        return _NamedIndexUpdateRef(self._array, idx)


class _NamedIndexUpdateRef:
    """``x.at[idx]``: functional updates at a named index (like ``jax.Array.at``).

    Elements of a :func:`dslice` that fall outside the array read as zeros and are not written.
    """

    def __init__(self, array: NamedArray, idx: Any) -> None:
        from .axis import dslice

        self._array = array
        self._out_axes, self._norm = _plan_index(array, idx)
        self._has_dslice = any(isinstance(i, dslice) for i in self._norm.values())

    def _positional(self) -> tuple[Any, ...]:
        if not _has_gather(self._norm):
            return tuple(self._norm.get(ax.name, builtins_slice(None)) for ax in self._array.axes)
        return _full_gather_index(self._array, self._out_axes, self._norm)

    def _values(self, values: Any) -> Any:
        if isinstance(values, NamedArray):
            return broadcast_to(values, self._out_axes).array
        _check_positional_operand(values, "at[...]")
        return values

    def _apply(self, method: str, values: Any, **kwargs: Any) -> NamedArray:
        if self._has_dslice:
            kwargs.setdefault("mode", "drop")
        ref = self._array.array.at[self._positional()]
        return NamedArray(getattr(ref, method)(self._values(values), **kwargs), self._array.axes)

    def get(self, **kwargs: Any) -> NamedArray:
        """The indexed values (same as ``array[idx]``)."""
        if self._has_dslice and "mode" not in kwargs:
            kwargs.update(mode="fill", fill_value=0)
        return NamedArray(self._array.array.at[self._positional()].get(**kwargs), self._out_axes)

    def set(self, values: Any, **kwargs: Any) -> NamedArray:
        """Replaces the indexed values."""
        return self._apply("set", values, **kwargs)

    def add(self, values: Any, **kwargs: Any) -> NamedArray:
        """Adds to the indexed values (repeated indices accumulate)."""
        return self._apply("add", values, **kwargs)

    def multiply(self, values: Any, **kwargs: Any) -> NamedArray:
        """Multiplies the indexed values."""
        return self._apply("multiply", values, **kwargs)

    mul = multiply

    def divide(self, values: Any, **kwargs: Any) -> NamedArray:
        """Divides the indexed values."""
        return self._apply("divide", values, **kwargs)

    def power(self, values: Any, **kwargs: Any) -> NamedArray:
        """Raises the indexed values to a power."""
        return self._apply("power", values, **kwargs)

    def min(self, values: Any, **kwargs: Any) -> NamedArray:
        """Element-wise minimum with the indexed values."""
        return self._apply("min", values, **kwargs)

    def max(self, values: Any, **kwargs: Any) -> NamedArray:
        """Element-wise maximum with the indexed values."""
        return self._apply("max", values, **kwargs)

    def apply(self, func: Any, **kwargs: Any) -> NamedArray:
        """Applies a unary function to the indexed values."""
        ref = self._array.array.at[self._positional()]
        return NamedArray(ref.apply(func, **kwargs), self._array.axes)


def named(a: Any, axis: AxisSelection) -> NamedArray:
    """Names the dimensions of a positional array.

    Args:
        a: a JAX/NumPy array or anything ``jnp.asarray`` accepts.
        axis: one axis or name per dimension, or a shape dict; names alone take their size from ``a``.

    Returns:
        The named array (same data).

    Raises:
        ValueError: if the number of axes or a given size does not match ``a``'s shape.

    Example:
        >>> import jax.numpy as jnp
        >>> named(jnp.zeros((2, 3)), ("batch", "embed")).shape
        {'batch': 2, 'embed': 3}
    """
    a = jnp.asarray(a)
    if isinstance(axis, Mapping):
        selectors: tuple[Any, ...] = tuple(Axis(k, v) if v is not None else k for k, v in axis.items())
    else:
        selectors = ensure_tuple(axis)
    if len(selectors) != a.ndim:
        raise ValueError(
            f"named: array has {a.ndim} dimensions (shape {tuple(a.shape)}) but {len(selectors)} axes were given: "
            f"{axis_name(selectors)}"
        )
    axes = []
    for sel, size in zip(selectors, a.shape):
        if isinstance(sel, Axis):
            if sel.size != size:
                raise ValueError(f"named: axis {sel.name!r} has size {sel.size} but the array's dimension is {size}")
            axes.append(sel)
        elif isinstance(sel, str):
            axes.append(Axis(sel, int(size)))
        else:
            raise TypeError(f"named: expected an Axis or a name, got {sel!r}")
    return NamedArray(a, tuple(axes))
