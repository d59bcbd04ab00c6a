"""Named mutable references: :class:`NamedRef`, a ``jax.Ref`` whose dimensions have axis names.

A ``NamedRef`` is read and written by axis name, like a :class:`NamedArray` is indexed. ``ref.slice(...)``
makes a *view*: a reference to part of the same buffer, whose axes are the selected part. Views compose
(a slice of a slice is one slice of the buffer), so code can hand a layer the part of a cache it owns.

Example:
    >>> import ponente.namedtensor as hax
    >>> cache = hax.new_ref(hax.zeros({"layer": 4, "pos": 3}))
    >>> layer1 = cache.slice({"layer": 1})
    >>> layer1[{"pos": 0}] = 5.0
    >>> cache.value()[{"layer": 1}].array.tolist()
    [5.0, 0.0, 0.0]
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
from collections.abc import Mapping
from types import EllipsisType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .axis import Axis, AxisSelector, axis_name, dslice
from .core import NamedArray, broadcast_to

__all__ = ["NamedRef", "freeze", "get", "new_ref", "swap"]


@functools.cache
def _pallas() -> Any:
    # imported on first use: Pallas' strided slice is the index type of a view, and costs import time
    import jax.experimental.pallas as pl

    return pl


def _is_strided_slice(value: Any) -> bool:
    return isinstance(value, _pallas().Slice)


def _is_int_index(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | np.integer):
        return True
    return (
        not isinstance(value, NamedArray)
        and getattr(value, "ndim", None) == 0
        and jnp.issubdtype(value.dtype, jnp.integer)
    )


def _is_static_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_array_index(entry: Any) -> bool:
    return isinstance(entry, NamedArray | list) or getattr(entry, "ndim", 0) == 1


def _view_axis(axis: Axis, entry: Any) -> list[Axis]:
    """The axes that an index ``entry`` of the buffer's axis ``axis`` leaves in a view or a read."""
    if isinstance(entry, builtins.slice):
        return [Axis(axis.name, len(range(*entry.indices(axis.size))))]
    if _is_strided_slice(entry):
        return [Axis(axis.name, int(entry.size))]
    if _is_int_index(entry):
        return []
    if isinstance(entry, NamedArray):
        return list(entry.axes)
    if isinstance(entry, list):
        return [Axis(axis.name, len(entry))]
    if hasattr(entry, "ndim") and entry.ndim == 1:
        return [Axis(axis.name, entry.shape[0])]
    raise TypeError(f"unsupported index {entry!r} for axis {axis.name!r}")


def _as_strided(entry: Any, axis: Axis) -> Any:
    """A slice-like index as a Pallas strided slice (start, size, stride)."""
    pl = _pallas()
    if isinstance(entry, range):
        entry = builtins.slice(entry.start, entry.stop, entry.step)
    if isinstance(entry, builtins.slice):
        start, stop, step = entry.indices(axis.size)
        if step < 0:
            raise NotImplementedError(f"slices with a negative step are not supported by NamedRef ({entry!r})")
        return pl.Slice(start, len(range(start, stop, step)), step)
    if isinstance(entry, dslice):
        return pl.Slice(entry.start, entry.size, 1)
    return entry


def _compose(current: Any, new: Any, axis: Axis, view: Axis) -> Any:
    """The index of ``axis`` (of the buffer) that selects ``new`` within the view ``current`` selects."""
    if not (isinstance(current, builtins.slice) or _is_strided_slice(current)):
        raise NotImplementedError(f"axis {axis.name!r} is already indexed by an array in this view ({current!r})")
    base = _as_strided(current, axis)
    start, length, stride = base.start, base.size, base.stride
    if isinstance(new, builtins.slice | range | dslice) or _is_strided_slice(new):
        inner = _as_strided(new, view)
        return _pallas().Slice(start + inner.start * stride, inner.size, stride * inner.stride)

    def offset(i: Any) -> Any:
        if _is_static_int(i):
            if not -length <= i < length:
                raise IndexError(f"index {i} is out of bounds for axis {view.name!r} of size {length}")
            return start + (int(i) % length) * stride
        return start + jnp.where(i < 0, i + length, i) * stride

    if _is_int_index(new):
        return offset(new)
    if isinstance(new, list | tuple):
        if not all(_is_static_int(i) for i in new):
            raise TypeError(f"a list index for axis {view.name!r} must hold Python ints, got {new!r}")
        return [offset(i) for i in new]
    if isinstance(new, NamedArray):
        if not jnp.issubdtype(new.dtype, jnp.integer):
            raise TypeError(f"index for axis {view.name!r} must be an integer NamedArray, got dtype {new.dtype}")
        return NamedArray(offset(new.array), new.axes)
    if hasattr(new, "ndim") and new.ndim == 1 and jnp.issubdtype(new.dtype, jnp.integer):
        return offset(new)
    raise TypeError(
        f"unsupported index {new!r} for axis {view.name!r}: use an int, a slice, a dslice, a list of ints, "
        "an integer array or an integer NamedArray"
    )


def _selectors(idx: Any) -> dict[AxisSelector, Any]:
    """``{axis: index}`` from a dict, ``(axis, index, ...)`` pairs, or ``...`` (nothing)."""
    if idx is Ellipsis or idx is None:
        return {}
    if isinstance(idx, Mapping):
        return dict(idx)
    if isinstance(idx, tuple) and len(idx) % 2 == 0:
        return {idx[k]: idx[k + 1] for k in range(0, len(idx), 2)}
    raise TypeError(f"a NamedRef is indexed by name: ref['axis', i] or ref[{{'axis': i}}] or ref[...], not {idx!r}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["_ref"], meta_fields=["_axes", "_prefix"])
@dataclasses.dataclass(frozen=True)
class NamedRef:
    """A mutable reference (``jax.Ref``) with named axes, or a view of part of one.

    Create one with :func:`new_ref`. Read with ``ref[idx]`` or ``ref.value()``, write with
    ``ref[idx] = value``; ``idx`` is a ``{axis: index}`` dict (or ``...`` for everything), where an
    index is an int, a slice, a :func:`~ponente.namedtensor.dslice`, a list of ints, or an integer
    array/NamedArray (at most one array index per access). ``ref.slice(idx)`` returns a view.

    A NamedRef is a pytree whose only leaf is the ``jax.Ref``, so it can be passed to ``jit`` and closed
    over by ``scan``; writes inside are visible outside.

    Attributes:
        _ref: the underlying ``jax.Ref`` (the whole buffer).
        _axes: the buffer's axes.
        _prefix: for each buffer axis, the index the view applies (``slice(None)`` for all of it).

    Example:
        >>> import ponente.namedtensor as hax
        >>> ref = hax.new_ref(hax.arange({"x": 6}))
        >>> view = ref.slice({"x": slice(2, 5)})
        >>> view[{"x": 0}] = 9
        >>> view.axes, ref.value().array.tolist()
        ((Axis(name='x', size=3),), [0, 1, 9, 3, 4, 5])
    """

    _ref: Any
    _axes: tuple[Axis, ...]
    _prefix: tuple[Any, ...]

    def __post_init__(self) -> None:
        if len(self._axes) != len(self._prefix):
            raise ValueError(f"a NamedRef needs one prefix entry per axis: {self._axes} vs {self._prefix}")

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The axes of this view."""
        return tuple(view for axis, entry in zip(self._axes, self._prefix) for view in _view_axis(axis, entry))

    @property
    def shape(self) -> dict[str, int]:
        """``{name: size}`` of this view."""
        return {ax.name: ax.size for ax in self.axes}

    named_shape = shape

    @property
    def ndim(self) -> int:
        """The number of axes of this view."""
        return len(self.axes)

    @property
    def dtype(self) -> Any:
        """The element type."""
        return self._ref.dtype

    def resolve_axis(self, axis: AxisSelector) -> Axis:
        """The axis of this view named like ``axis``.

        Raises:
            ValueError: if this view has no such axis.
        """
        name = axis_name(axis)
        for ax in self.axes:
            if ax.name == name:
                return ax
        raise ValueError(f"axis {name!r} is not in this reference, whose axes are {tuple(a.name for a in self.axes)}")

    def _combined(self, idx: Any) -> tuple[Any, ...]:
        """The buffer index selecting ``idx`` within this view."""
        selectors = _selectors(idx)
        prefix = list(self._prefix)
        if not selectors:
            return tuple(prefix)
        if any(_is_array_index(entry) for entry in prefix):
            raise NotImplementedError("indexing a view that was made with an array index is not supported")
        view_of = [i for i, entry in enumerate(prefix) if not _is_int_index(entry)]  # buffer axis of each view axis
        views = self.axes
        for key, value in selectors.items():
            view = self.resolve_axis(key)
            base = view_of[views.index(view)]
            prefix[base] = _compose(prefix[base], value, self._axes[base], view)
        return tuple(prefix)

    def _plan(self, idx: Any) -> tuple[tuple[Any, ...], tuple[Axis, ...]]:
        """The raw index for the ``jax.Ref`` and the axes of what it selects."""
        combined = self._combined(idx)
        if sum(1 for e in combined if _is_array_index(e)) > 1:
            raise NotImplementedError("a NamedRef access supports at most one array index")
        out = tuple(v for axis, entry in zip(self._axes, combined) for v in _view_axis(axis, entry))
        raw = tuple(
            e.array if isinstance(e, NamedArray) else jnp.asarray(e) if isinstance(e, list) else e for e in combined
        )
        return raw, out

    def _payload(self, value: Any, axes: tuple[Axis, ...]) -> Any:
        if isinstance(value, NamedArray):
            return broadcast_to(value, axes).array.astype(self.dtype)
        return jnp.asarray(value, dtype=self.dtype)

    def __getitem__(self, idx: Any = Ellipsis) -> NamedArray:
        """Reads the part of this view that ``idx`` selects."""
        raw, axes = self._plan(idx)
        return NamedArray(self._ref[raw], axes)

    def __setitem__(self, idx: Any, value: Any) -> None:
        """Writes ``value`` (a NamedArray broadcast by name, or a scalar) to the part ``idx`` selects."""
        raw, axes = self._plan(idx)
        self._ref[raw] = self._payload(value, axes)

    def value(self) -> NamedArray:
        """The current contents of this view."""
        return self[...]

    def slice(self, selector: Mapping[AxisSelector, Any]) -> NamedRef:
        """A view of the part that ``selector`` (``{axis: index}``) selects; writes to it write here.

        Example:
            >>> import ponente.namedtensor as hax
            >>> ref = hax.new_ref(hax.zeros({"layer": 4, "head": 2}))
            >>> ref.slice({"layer": hax.ds(1, 2)}).slice({"layer": 1}).axes
            (Axis(name='head', size=2),)
        """
        return dataclasses.replace(self, _prefix=self._combined(selector))

    def unsliced(self) -> NamedRef:
        """The whole buffer this view belongs to."""
        whole = tuple(builtins.slice(None) for _ in self._axes)
        return dataclasses.replace(self, _prefix=whole)


def new_ref(value: NamedArray) -> NamedRef:
    """A new mutable reference holding ``value``.

    Args:
        value: the initial contents.

    Returns:
        A :class:`NamedRef` with the axes of ``value``.

    Raises:
        TypeError: if ``value`` is not a NamedArray.

    Example:
        >>> import ponente.namedtensor as hax
        >>> ref = hax.new_ref(hax.zeros({"x": 3}))
        >>> ref[{"x": 1}] = 2.0
        >>> ref.value().array.tolist()
        [0.0, 2.0, 0.0]
    """
    if not isinstance(value, NamedArray):
        raise TypeError(f"new_ref needs a NamedArray, got {type(value).__name__}")
    return NamedRef(jax.new_ref(value.array), tuple(value.axes), tuple(builtins.slice(None) for _ in value.axes))


def freeze(ref: NamedRef) -> NamedArray:
    """The current contents of ``ref`` as a NamedArray (same as ``ref.value()``)."""
    return ref.value()


def get(ref: NamedRef, idx: Any = Ellipsis) -> NamedArray:
    """Reads ``ref[idx]``."""
    return ref[idx]


def swap(ref: NamedRef, idx: Any | EllipsisType, value: Any) -> NamedArray:
    """Writes ``value`` at ``idx`` and returns what was there.

    Example:
        >>> import ponente.namedtensor as hax
        >>> ref = hax.new_ref(hax.arange({"x": 3}))
        >>> swap(ref, {"x": 0}, 7).array.tolist(), ref.value().array.tolist()
        (0, [7, 1, 2])
    """
    raw, axes = ref._plan(idx)
    return NamedArray(jax.ref.swap(ref._ref, raw, ref._payload(value, axes)), axes)
