"""``NamedArray["batch embed"]``: type annotations that name an array's axes (and optionally its dtype).

``NamedArray[spec]`` is ``typing.Annotated[NamedArray, NamedArrayAxes(...)]``, so type checkers see a plain
``NamedArray`` while ``typing.get_args`` (and ``typing.get_type_hints(..., include_extras=True)``) recover the
axis requirement. The spec may be:

- ``"batch embed"`` or ``("batch", "embed")``: exactly these axes, in this order;
- ``"batch ..."``, ``"... embed"``, ``"batch ... embed"``: these at the front / back, any others at the ``...``;
- ``{"batch", "embed"}``: exactly these axes, in any order; ``{"batch", ...}``: at least these, in any order.

At run time, ``x.matches_axes(spec)`` checks an array against any of these forms, and
``isinstance(x, NamedArray["batch ..."])`` works as well. :mod:`ponente.namedtensor.haxtyping` adds dtypes
(``f32["batch embed"]``, ``Float["batch"]``).
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Sequence, Set
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["DTypeCategory", "NamedArrayAxes", "NamedArrayAxesSpec", "named_array_annotation"]


@dataclass(frozen=True)
class DTypeCategory:
    """A family of dtypes such as "any float" (``jnp.floating``), for dtype-qualified annotations.

    Attributes:
        name: the family's name (``"float"``, ``"int"``...), which is also its ``str``.
        category: the abstract NumPy/JAX dtype class every member is a sub-dtype of.

    Example:
        >>> import jax.numpy as jnp
        >>> floats = DTypeCategory("float", jnp.floating)
        >>> floats.contains(jnp.bfloat16), floats.contains(jnp.int32), str(floats)
        (True, False, 'float')
    """

    name: str
    category: Any

    def contains(self, dtype: Any) -> bool:
        """Whether ``dtype`` belongs to this family."""
        return bool(jnp.issubdtype(dtype, self.category))

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class NamedArrayAxes:
    """The axes (and optionally the dtype) an annotation requires of a :class:`~ponente.namedtensor.NamedArray`.

    Attributes:
        before: names required at the front, in order (all the names when ``ordered`` is False).
        after: names required at the back, in order, after the ``...``.
        ordered: whether the names must appear in the given order (False for the set forms).
        subset: whether other axes may appear (where the ``...`` is, or anywhere for an unordered spec).
        dtype: the required dtype, a :class:`DTypeCategory`, or None for any dtype.

    Example:
        >>> spec = NamedArrayAxes.parse("batch ... embed")
        >>> spec.before, spec.after, spec.subset
        (('batch',), ('embed',), True)
        >>> spec.matches(("batch", "pos", "embed")), spec.matches(("embed", "batch"))
        (True, False)
    """

    before: tuple[str, ...]
    after: tuple[str, ...] = ()
    ordered: bool = True
    subset: bool = False
    dtype: Any = None

    @staticmethod
    def parse(item: Any) -> NamedArrayAxes:
        """Parses any accepted spec form (see the module docstring), or an annotation made from one.

        Raises:
            TypeError: for anything else, for a name that is not a string, or for more than one ``...``.
        """
        if typing.get_origin(item) is typing.Annotated:
            item = next((m for m in typing.get_args(item)[1:] if isinstance(m, NamedArrayAxes)), item)
        if isinstance(item, NamedArrayAxes):
            return item
        if isinstance(item, Set):
            names = [p for p in item if p is not Ellipsis]
            _check_names(names, item)
            return NamedArrayAxes(tuple(sorted(names)), (), ordered=False, subset=Ellipsis in item)
        parts: list[Any] = []
        for piece in item if isinstance(item, (tuple, list)) else (item,):
            if isinstance(piece, str):
                parts.extend(Ellipsis if p == "..." else p for p in piece.split())
            else:
                parts.append(piece)
        _check_names([p for p in parts if p is not Ellipsis], item)
        if parts.count(Ellipsis) > 1:
            raise TypeError(f"NamedArray[...]: at most one '...' is allowed, got {item!r}")
        if Ellipsis in parts:
            i = parts.index(Ellipsis)
            return NamedArrayAxes(tuple(parts[:i]), tuple(parts[i + 1 :]), ordered=True, subset=True)
        return NamedArrayAxes(tuple(parts), ())

    def matches(self, names: Sequence[str], dtype: Any = None) -> bool:
        """Whether an array with these axis names (in order) and this dtype satisfies the spec.

        Args:
            names: the array's axis names, in order.
            dtype: the array's dtype; only checked when the spec has one.
        """
        if self.dtype is not None and not _dtype_matches(self.dtype, dtype):
            return False
        names = tuple(names)
        if not self.ordered:
            wanted, have = set(self.before), set(names)
            return wanted <= have if self.subset else wanted == have
        if not self.subset:
            return names == self.before
        n, b, a = len(names), len(self.before), len(self.after)
        return n >= b + a and names[:b] == self.before and names[n - a :] == self.after

    def __str__(self) -> str:
        dtype = f"{_dtype_name(self.dtype)} " if self.dtype is not None else ""
        if not self.ordered:
            names = [*self.before, "..."] if self.subset else list(self.before)
            return dtype + "{" + ", ".join(names) + "}"
        if self.subset:
            return dtype + " ".join((*self.before, "...", *self.after))
        return dtype + " ".join(self.before)


NamedArrayAxesSpec = NamedArrayAxes | str | Sequence[str | EllipsisType] | Set[str | EllipsisType]
"""What ``NamedArray[...]`` and ``NamedArray.matches_axes`` accept."""


def _check_names(names: Sequence[Any], item: Any) -> None:
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"NamedArray[...] takes axis names (str) and ..., got {bad[0]!r} in {item!r}")


def _dtype_matches(required: Any, dtype: Any) -> bool:
    if dtype is None:
        return False
    if isinstance(required, DTypeCategory):
        return required.contains(dtype)
    return bool(np.dtype(dtype) == np.dtype(required))


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, DTypeCategory):
        return dtype.name
    return np.dtype(dtype).name


# ``typing.Annotated[...]`` builds a private ``typing._AnnotatedAlias``, whose ``isinstance`` raises. The subclass
# keeps everything ``typing`` (``get_args``, ``get_type_hints``) and type checkers rely on, and answers
# ``isinstance`` by the spec. test_annotation.py checks both behaviours on every supported Python.
class _CheckedAnnotation(typing._AnnotatedAlias, _root=True):  # type: ignore[name-defined,call-arg]
    """``Annotated[NamedArray, spec]`` that also supports ``isinstance`` (plain ``Annotated`` refuses it)."""

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.__origin__) and self.__metadata__[0].matches(obj.axis_names, obj.dtype)


@functools.cache
def _make(cls: type, spec: NamedArrayAxes) -> Any:
    return _CheckedAnnotation(cls, (spec,))


def named_array_annotation(cls: type, item: Any) -> Any:
    """The annotation ``cls[item]``: ``Annotated[cls, NamedArrayAxes]`` that supports ``isinstance``.

    Args:
        cls: the annotated class (:class:`~ponente.namedtensor.NamedArray`, which passes itself).
        item: an axes spec (see the module docstring) or a :class:`NamedArrayAxes`.

    Raises:
        TypeError: if ``item`` is not a valid spec.
    """
    return _make(cls, NamedArrayAxes.parse(item))
