"""Axes: a name with a size, and the helpers that manipulate collections of axes.

An axis spec is one :class:`Axis`, a sequence of axes, or a shape dict ``{"batch": 4}``. An axis
selector is an :class:`Axis` or just a name; an axis selection is one or several selectors, or a
partial shape dict whose sizes may be ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, TypeAlias, TypeVar, overload

import equinox as eqx
import jax

from ._util import ensure_tuple

__all__ = [
    "Axis",
    "AxisSelection",
    "AxisSelector",
    "AxisSpec",
    "PartialAxisSpec",
    "PartialShapeDict",
    "ShapeDict",
    "axis_name",
    "axis_size",
    "axis_spec_to_shape_dict",
    "axis_spec_to_tuple",
    "concat_axes",
    "dblock",
    "ds",
    "dslice",
    "eliminate_axes",
    "intersect_axes",
    "is_axis_compatible",
    "make_axes",
    "rearrange_for_partial_order",
    "replace_axis",
    "resolve_axis",
    "selects_axis",
    "to_jax_shape",
    "union_axes",
    "without_axes",
]


@dataclass(frozen=True)
class Axis:
    """A named axis with a size. Frozen and hashable, so it can be static pytree data.

    Args:
        name: the axis name, unique within an array.
        size: the number of elements along the axis.

    Example:
        >>> Embed = Axis("embed", 8)
        >>> Embed.alias("embed_out"), Embed.resize(16).size
        (Axis(name='embed_out', size=8), 16)
    """

    name: str
    size: int

    def alias(self, new_name: str) -> Axis:
        """Returns an axis of the same size with the name ``new_name``."""
        return Axis(new_name, self.size)

    def resize(self, size: int) -> Axis:
        """Returns an axis with the same name and the size ``size``."""
        return Axis(self.name, size)

    def __str__(self) -> str:
        return f"{self.name}({self.size})"


ShapeDict: TypeAlias = Mapping[str, int]
"""A mapping from axis name to size, e.g. ``{"batch": 4, "embed": 8}``."""
PartialShapeDict: TypeAlias = Mapping[str, int | None]
"""A mapping from axis name to size or ``None`` (any size)."""
AxisSelector: TypeAlias = Axis | str
"""One axis, given as an :class:`Axis` or only its name."""
AxisSpec: TypeAlias = ShapeDict | Sequence[Axis] | Axis
"""Fully specified axes: one :class:`Axis`, a sequence of them, or a shape dict."""
AxisSelection: TypeAlias = PartialShapeDict | Sequence[AxisSelector] | AxisSelector
"""Axes given by name or as axes: a selector, a sequence of selectors, or a partial shape dict."""
PartialAxisSpec: TypeAlias = Sequence[AxisSelector | EllipsisType]
"""Axes in order, where ``...`` stands for any other axes: ``("batch", ..., "embed")``."""


def _entries(spec: Any) -> list[tuple[str, int | None]]:
    """(name, size or None) for every axis of a spec, selection or shape dict, in order."""
    if isinstance(spec, Mapping):
        return [(_check_name(k), v) for k, v in spec.items()]
    out: list[tuple[str, int | None]] = []
    for ax in ensure_tuple(spec):
        if isinstance(ax, Axis):
            out.append((ax.name, ax.size))
        elif isinstance(ax, str):
            out.append((ax, None))
        else:
            raise TypeError(f"expected an Axis or an axis name (str), got {ax!r} of type {type(ax).__name__}")
    return out


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"axis names must be strings, got {name!r} of type {type(name).__name__}")
    return name


def _rebuild(like: Any, entries: Sequence[tuple[str, int | None]]) -> Any:
    """Builds a dict if ``like`` is a mapping, else a tuple of Axis (or names where the size is unknown)."""
    if isinstance(like, Mapping):
        return dict(entries)
    return tuple(name if size is None else Axis(name, size) for name, size in entries)


@overload
def axis_name(ax: AxisSelector) -> str: ...  # type: ignore[overload-overlap]


@overload
def axis_name(ax: Sequence[AxisSelector] | PartialShapeDict) -> tuple[str, ...]: ...


def axis_name(ax: AxisSelection) -> str | tuple[str, ...]:
    """The name of one axis, or the tuple of names of several.

    Args:
        ax: an axis, a name, a sequence of them, or a shape dict.

    Returns:
        A string for a single axis, otherwise a tuple of strings.

    Example:
        >>> axis_name(Axis("batch", 4)), axis_name([Axis("a", 1), "b"]), axis_name({"c": 2})
        ('batch', ('a', 'b'), ('c',))
    """
    if isinstance(ax, Axis):
        return ax.name
    if isinstance(ax, str):
        return ax
    return tuple(name for name, _ in _entries(ax))


def axis_size(ax: AxisSpec) -> int:
    """The number of elements spanned by the axes: the size of one axis or the product of several.

    Args:
        ax: an axis, a sequence of axes, or a shape dict.

    Returns:
        The product of the sizes (1 for no axes).

    Raises:
        TypeError: if an axis is given only by name (its size is unknown).

    Example:
        >>> axis_size(Axis("a", 3)), axis_size({"a": 3, "b": 4})
        (3, 12)
    """
    total = 1
    for name, size in _entries(ax):
        if size is None:
            raise TypeError(f"axis {name!r} is given only by name; its size is unknown")
        total *= size
    return total


def axis_spec_to_shape_dict(axis_spec: AxisSelection) -> dict[str, int | None]:
    """Converts axes to a ``{name: size}`` dict (``None`` for axes given only by name)."""
    return dict(_entries(axis_spec))


def axis_spec_to_tuple(axis_spec: AxisSelection) -> tuple[AxisSelector, ...]:
    """Converts axes to a tuple of :class:`Axis` (or names where the size is unknown)."""
    return tuple(_rebuild((), _entries(axis_spec)))


def to_jax_shape(shape: AxisSpec) -> tuple[int, ...]:
    """The positional shape ``(size, ...)`` of an axis spec."""
    out = []
    for name, size in _entries(shape):
        if size is None:
            raise TypeError(f"axis {name!r} is given only by name; its size is unknown")
        out.append(size)
    return tuple(out)


def make_axes(**kwargs: int) -> tuple[Axis, ...]:
    """Creates several axes at once from keyword arguments.

    Args:
        **kwargs: ``name=size`` pairs, in order.

    Returns:
        A tuple of :class:`Axis`, one per keyword.

    Example:
        >>> Batch, Embed = make_axes(batch=4, embed=8)
        >>> Embed
        Axis(name='embed', size=8)
    """
    return tuple(Axis(name, size) for name, size in kwargs.items())


def _duplicates(names: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    dups: list[str] = []
    for n in names:
        if n in seen and n not in dups:
            dups.append(n)
        seen.add(n)
    return dups


def concat_axes(a1: AxisSelection, a2: AxisSelection) -> Any:
    """Concatenates two axis specs; no axis may appear in both.

    Args:
        a1: the first axes.
        a2: the axes to append.

    Returns:
        A dict if ``a1`` is a dict, otherwise a tuple of axes (names where sizes are unknown).

    Raises:
        ValueError: if an axis name appears in both, naming the axes.

    Example:
        >>> concat_axes(Axis("a", 1), (Axis("b", 2),))
        (Axis(name='a', size=1), Axis(name='b', size=2))
    """
    e1, e2 = _entries(a1), _entries(a2)
    overlap = [n for n, _ in e1 if n in {m for m, _ in e2}]
    if overlap:
        raise ValueError(f"cannot concatenate axes: {overlap} appear in both {axis_name(a1)} and {axis_name(a2)}")
    return _rebuild(a1, e1 + e2)


def union_axes(a1: AxisSelection, a2: AxisSelection) -> Any:
    """The axes of ``a1`` followed by those of ``a2`` that are not in ``a1``.

    Args:
        a1: the first axes.
        a2: the second axes.

    Returns:
        A dict if ``a1`` is a dict, otherwise a tuple.

    Raises:
        ValueError: if an axis appears in both with different sizes.

    Example:
        >>> union_axes({"a": 1, "b": 2}, {"b": 2, "c": 3})
        {'a': 1, 'b': 2, 'c': 3}
    """
    e1 = _entries(a1)
    sizes = dict(e1)
    out = list(e1)
    for name, size in _entries(a2):
        if name in sizes:
            if sizes[name] is not None and size is not None and sizes[name] != size:
                raise ValueError(f"axis {name!r} has size {sizes[name]} in {a1} but size {size} in {a2}")
            if sizes[name] is None and size is not None:
                out = [(n, size if n == name else s) for n, s in out]
                sizes[name] = size
        else:
            out.append((name, size))
            sizes[name] = size
    return _rebuild(a1, out)


def eliminate_axes(axis_spec: AxisSelection, to_remove: AxisSelection) -> Any:
    """Removes axes from a spec; every axis to remove must be present.

    Args:
        axis_spec: the axes to remove from.
        to_remove: the axes (or names) to remove.

    Returns:
        The remaining axes, as a dict if ``axis_spec`` is a dict, otherwise a tuple.

    Raises:
        ValueError: if an axis of ``to_remove`` is not in ``axis_spec``.

    Example:
        >>> eliminate_axes((Axis("a", 1), Axis("b", 2)), "a")
        (Axis(name='b', size=2),)
    """
    names = set(axis_name(axis_spec) if not isinstance(axis_spec, Axis | str) else (axis_name(axis_spec),))
    for name, _ in _entries(to_remove):
        if name not in names:
            raise ValueError(f"axis {name!r} not present in {_fmt(axis_spec)}")
    return without_axes(axis_spec, to_remove)


def without_axes(axis_spec: AxisSelection, to_remove: AxisSelection, allow_mismatched_sizes: bool = False) -> Any:
    """Removes axes from a spec, ignoring those that are absent.

    Args:
        axis_spec: the axes to remove from.
        to_remove: the axes (or names) to remove.
        allow_mismatched_sizes: if False, an axis present in both with different sizes is an error.

    Returns:
        The remaining axes, as a dict if ``axis_spec`` is a dict, otherwise a tuple.

    Raises:
        ValueError: if sizes disagree and ``allow_mismatched_sizes`` is False.

    Example:
        >>> without_axes({"a": 1, "b": 2}, ("b", "z"))
        {'a': 1}
    """
    remove = dict(_entries(to_remove))
    out = []
    for name, size in _entries(axis_spec):
        if name in remove:
            other = remove[name]
            if not allow_mismatched_sizes and size is not None and other is not None and size != other:
                raise ValueError(f"axis {name!r} has size {size} in {_fmt(axis_spec)} but size {other} to remove")
        else:
            out.append((name, size))
    return _rebuild(axis_spec, out)


def intersect_axes(ax1: AxisSelection, ax2: AxisSelection) -> Any:
    """The axes of ``ax1`` that are also in ``ax2``, in the order of ``ax1``.

    Args:
        ax1: the first axes.
        ax2: the second axes.

    Returns:
        A dict if ``ax1`` is a dict, otherwise a tuple.

    Raises:
        ValueError: if a shared axis has different sizes.

    Example:
        >>> intersect_axes(("a", "b", "c"), ("c", "a"))
        ('a', 'c')
    """
    other = dict(_entries(ax2))
    out = []
    for name, size in _entries(ax1):
        if name in other:
            if size is not None and other[name] is not None and size != other[name]:
                raise ValueError(f"axis {name!r} has size {size} in {_fmt(ax1)} but size {other[name]} in {_fmt(ax2)}")
            out.append((name, size if size is not None else other[name]))
    return _rebuild(ax1, out)


def replace_axis(axis_spec: AxisSpec, old: AxisSelector, new: AxisSpec) -> Any:
    """Replaces the axis ``old`` with the axis or axes ``new``, in place.

    Args:
        axis_spec: the axes.
        old: the axis (or name) to replace; must be present.
        new: one axis or several that take its position.

    Returns:
        A dict if ``axis_spec`` is a dict, otherwise a tuple of axes.

    Raises:
        ValueError: if ``old`` is absent or a new name collides with another axis.

    Example:
        >>> replace_axis((Axis("a", 1), Axis("b", 2)), "a", (Axis("x", 3), Axis("y", 4)))
        (Axis(name='x', size=3), Axis(name='y', size=4), Axis(name='b', size=2))
    """
    entries = _entries(axis_spec)
    old_name = axis_name(old)
    names = [n for n, _ in entries]
    if old_name not in names:
        raise ValueError(f"axis {old_name!r} not present in {_fmt(axis_spec)}")
    new_entries = _entries(new)
    rest = [n for n in names if n != old_name]
    clash = [n for n, _ in new_entries if n in rest]
    if clash:
        raise ValueError(f"cannot replace {old_name!r}: new axes {clash} already present in {_fmt(axis_spec)}")
    i = names.index(old_name)
    return _rebuild(axis_spec, entries[:i] + new_entries + entries[i + 1 :])


@overload
def resolve_axis(axis_spec: AxisSpec, axis_selection: AxisSelector) -> Axis: ...  # type: ignore[overload-overlap]


@overload
def resolve_axis(axis_spec: AxisSpec, axis_selection: Sequence[AxisSelector]) -> tuple[Axis, ...]: ...


@overload
def resolve_axis(axis_spec: AxisSpec, axis_selection: PartialShapeDict) -> dict[str, int]: ...


def resolve_axis(axis_spec: AxisSpec, axis_selection: AxisSelection) -> Any:
    """Looks up the full axes (with sizes) that a selection names.

    Args:
        axis_spec: the available axes (e.g. ``array.axes``).
        axis_selection: one selector, a sequence of them, or a partial shape dict.

    Returns:
        An :class:`Axis` for a single selector, a tuple of axes for a sequence, a dict for a dict.

    Raises:
        ValueError: if a selected axis is absent or its given size differs.

    Example:
        >>> resolve_axis((Axis("a", 1), Axis("b", 2)), "b")
        Axis(name='b', size=2)
    """
    available = dict(_entries(axis_spec))

    def one(name: str, size: int | None) -> Axis:
        if name not in available:
            raise ValueError(f"axis {name!r} not found in {_fmt(axis_spec)}")
        found = available[name]
        if size is not None and found is not None and size != found:
            raise ValueError(f"axis {name!r} has size {found} in {_fmt(axis_spec)}, but size {size} was requested")
        return Axis(name, found if found is not None else size)  # type: ignore[arg-type]

    if isinstance(axis_selection, Axis | str):
        ((name, size),) = _entries(axis_selection)
        return one(name, size)
    resolved = [one(n, s) for n, s in _entries(axis_selection)]
    if isinstance(axis_selection, Mapping):
        return {a.name: a.size for a in resolved}
    return tuple(resolved)


def selects_axis(selector: AxisSelection, selected: AxisSelection) -> bool:
    """Whether ``selector`` contains every axis of ``selected`` (with matching sizes where both are known).

    Args:
        selector: the axes available.
        selected: the axes looked for.

    Returns:
        True if every axis of ``selected`` is in ``selector``.

    Example:
        >>> selects_axis(("a", Axis("b", 2)), Axis("b", 2)), selects_axis("a", "b")
        (True, False)
    """
    available = dict(_entries(selector))
    for name, size in _entries(selected):
        if name not in available:
            return False
        other = available[name]
        if size is not None and other is not None and size != other:
            return False
    return True


def is_axis_compatible(ax1: AxisSelector, ax2: AxisSelector) -> bool:
    """Whether two selectors can denote the same axis: same name, and same size if both are known."""
    (n1, s1), (n2, s2) = _entries(ax1)[0], _entries(ax2)[0]
    return n1 == n2 and (s1 is None or s2 is None or s1 == s2)


_Ax = TypeVar("_Ax", Axis, str)


def rearrange_for_partial_order(partial_order: PartialAxisSpec, axes: Sequence[_Ax]) -> tuple[_Ax, ...]:
    """Orders ``axes`` to follow ``partial_order``, where each ``...`` stands for any of the unlisted axes.

    Listed axes appear in the order given. Each unlisted axis goes into one ``...``: walking ``axes`` in
    order, an unlisted axis joins the current ``...`` (at first, the first one); a listed axis moves the
    current ``...`` forward to the first ``...`` after it that is still empty, if there is one. So unlisted
    axes stay close to the listed axes they followed. Without ``...``, ``partial_order`` must list every axis.

    Args:
        partial_order: axes (or names) and ``...`` entries, each axis at most once.
        axes: the axes to order (:class:`Axis` objects or names), each name at most once.

    Returns:
        The elements of ``axes``, reordered.

    Raises:
        ValueError: if an axis is listed twice or is not in ``axes``, if ``axes`` repeats a name, if sizes
            disagree, or if there is no ``...`` and an axis is not listed.

    Example:
        >>> rearrange_for_partial_order(("c", ..., "a"), ("a", "b", "c", "d"))
        ('c', 'b', 'd', 'a')
        >>> rearrange_for_partial_order(("a", ..., "c", ...), ("a", "b", "c", "d"))
        ('a', 'b', 'c', 'd')
    """
    by_name: dict[str, _Ax] = {}
    for ax in axes:
        name = axis_name(ax)
        if name in by_name:
            raise ValueError(f"axis {name!r} appears more than once in {_fmt(axes)}")
        by_name[name] = ax
    slots: list[list[_Ax]] = []
    position: dict[str, int] = {}
    for entry in partial_order:
        if entry is Ellipsis:
            slots.append([])
            continue
        assert not isinstance(entry, EllipsisType)
        name = axis_name(entry)
        if name in position:
            raise ValueError(f"axis {name!r} is listed more than once in the partial order {tuple(partial_order)!r}")
        if name not in by_name:
            raise ValueError(f"axis {name!r} of the partial order {tuple(partial_order)!r} is not in {_fmt(axes)}")
        found = by_name[name]
        if isinstance(entry, Axis) and isinstance(found, Axis) and entry.size != found.size:
            raise ValueError(f"axis {name!r} has size {found.size} in {_fmt(axes)} but {entry.size} in the order")
        position[name] = len(slots)
        slots.append([found])
    ellipses = [i for i, entry in enumerate(partial_order) if entry is Ellipsis]
    if not ellipses:
        unlisted = [n for n in by_name if n not in position]
        if unlisted:
            raise ValueError(
                f"axes {tuple(unlisted)} are not in the partial order {tuple(partial_order)!r}; list them or add '...'"
            )
        return tuple(slot[0] for slot in slots)
    current = ellipses[0]
    for name, ax in by_name.items():
        if name not in position:
            slots[current].append(ax)
            continue
        after = max(position[name] + 1, current)
        current = next((i for i in ellipses if i >= after and not slots[i]), current)
    return tuple(ax for slot in slots for ax in slot)


def _fmt(spec: Any) -> str:
    entries = _entries(spec)
    return "(" + ", ".join(n if s is None else f"{n}={s}" for n, s in entries) + ")"


class dslice(eqx.Module):  # noqa: N801 (Haliax's name)
    """A dynamic slice: a start that may be traced and a static length.

    Use it to index a named array along an axis at a start computed under ``jit``:
    ``x["pos", hax.dslice(i, 4)]``. ``ds`` is an alias.

    Reading past either end of the axis gives zeros; writing (``x.at[...]``) past it drops those elements.

    Attributes:
        start: the first index (a Python int or a traced integer scalar).
        size: the static number of elements (an :class:`Axis` may be passed for its size).

    Example:
        >>> dslice(2, 3).to_slice()
        slice(2, 5, None)
        >>> dslice(4, Axis("block", 2)).size
        2
    """

    start: int | jax.Array
    size: int = eqx.field(static=True)

    def __init__(self, start: int | jax.Array, size: int | Axis) -> None:
        self.start = start
        self.size = size.size if isinstance(size, Axis) else size

    def to_slice(self) -> slice:
        """The equivalent static Python slice.

        Raises:
            TypeError: if ``start`` is traced (not a Python int).
        """
        if not isinstance(self.start, int):
            raise TypeError("dslice.to_slice() needs a static (Python int) start")
        return slice(self.start, self.start + self.size)

    @staticmethod
    def block(idx: int | jax.Array, size: int) -> dslice:
        """The ``idx``-th block of ``size`` elements: ``dslice(idx * size, size)``."""
        return dslice(idx * size, size)


ds = dslice
"""Short alias of :class:`dslice`."""


def dblock(idx: int | jax.Array, size: int) -> dslice:
    """The ``idx``-th block of ``size`` elements as a :class:`dslice` (start ``idx * size``).

    Args:
        idx: the block index (may be traced).
        size: the static block length.

    Returns:
        ``dslice(idx * size, size)``.

    Example:
        >>> dblock(2, 4).to_slice()
        slice(8, 12, None)
    """
    return dslice(idx * size, size)
