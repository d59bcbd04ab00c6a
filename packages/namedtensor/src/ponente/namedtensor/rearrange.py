"""``rearrange``: transpose, split and merge axes by name (axis-list form and einops-like string form)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import EllipsisType
from typing import Any, overload

import jax.numpy as jnp

from ._parsing import AxisExpressionError, Capture, parse_rearrangement
from .axis import Axis
from .core import NamedArray

__all__ = ["rearrange"]

_Binding = Axis | str | int


@overload
def rearrange(array: NamedArray, axes: Sequence[Axis | str | EllipsisType], /) -> NamedArray: ...


@overload
def rearrange(array: NamedArray, expression: str, /, **bindings: _Binding) -> NamedArray: ...


@overload
def rearrange(array: NamedArray, /, *axes: Axis | str | EllipsisType) -> NamedArray: ...


def rearrange(array: NamedArray, /, *args: Any, **bindings: Any) -> NamedArray:
    """Reorder, split and merge the axes of ``array``.

    Two forms:

    * **Axis list**: ``rearrange(x, ("batch", ..., "embed"))`` (or ``rearrange(x, "batch", ..., "embed")``)
      transposes ``x`` so that its axes appear in that order; ``...`` (at most once) stands for the
      axes not listed, in their current order. Without ``...`` every axis must be listed.
    * **Expression**: ``rearrange(x, "b (h d) -> b h d", d=64)``, einops-style:

      - an *ordered* left side matches the array's axes by position (the identifiers are variables and
        need not equal the axis names); an *unordered* left side ``{h w}`` selects axes by name and
        leaves the others to ``...``;
      - ``(name: a b)`` on the left splits axis ``name`` (by position on an ordered side the name may be
        omitted: ``(a b)``) into new axes ``a`` and ``b``; their sizes come from ``bindings`` (at most
        one may be inferred);
      - ``(name: a b)`` on the right merges ``a`` and ``b`` (C order) into a new axis ``name``;
      - ``bindings`` give sizes (``d=64``), or alias a variable to an axis name or :class:`Axis`
        (``d=HeadSize``, ``P="patch"``).

    Args:
        array: the array to rearrange.
        *args: an axis sequence (or the axes as separate arguments), or an expression string.
        **bindings: only with an expression: sizes or aliases of the identifiers in it.

    Returns:
        A NamedArray with the requested axes, sharing the data of ``array`` reordered.

    Raises:
        AxisExpressionError: (a ``ValueError``) if the expression is malformed or does not fit the
            array; the message points at the offending character.
        ValueError: if an axis in the axis-list form is missing or left out.

    Example:
        >>> import jax.numpy as jnp
        >>> import ponente.namedtensor as hax
        >>> x = hax.named(jnp.zeros((2, 6)), ("batch", "embed"))
        >>> hax.rearrange(x, "b (h: heads d) -> b heads d", d=3).axes
        (Axis(name='batch', size=2), Axis(name='heads', size=2), Axis(name='d', size=3))
    """
    if len(args) == 1 and isinstance(args[0], str) and any(ch in args[0] for ch in " ,(){}->"):
        return _rearrange_expression(array, args[0], bindings)
    if bindings:
        raise TypeError("rearrange: keyword bindings are only allowed with an expression string ('a b -> b a')")
    if len(args) == 1 and isinstance(args[0], Sequence) and not isinstance(args[0], str):
        axes = tuple(args[0])
    else:
        axes = tuple(args)
    return _permute(array, axes)


def _name_of(axis: Axis | str) -> str:
    return axis if isinstance(axis, str) else axis.name


def _permute(array: NamedArray, spec: tuple[Axis | str | EllipsisType, ...]) -> NamedArray:
    names = [a.name for a in array.axes]
    if sum(1 for s in spec if s is Ellipsis) > 1:
        raise ValueError(f"rearrange: '...' may occur at most once in {spec!r}")
    picked: list[int] = []
    for s in spec:
        if s is Ellipsis:
            continue
        assert not isinstance(s, EllipsisType)
        name = _name_of(s)
        if name not in names:
            raise ValueError(f"rearrange: axis {name!r} is not in the array, whose axes are {tuple(names)}")
        index = names.index(name)
        if isinstance(s, Axis) and s.size != array.axes[index].size:
            raise ValueError(f"rearrange: axis {name!r} has size {array.axes[index].size}, but {s} was requested")
        if index in picked:
            raise ValueError(f"rearrange: axis {name!r} is listed more than once in {spec!r}")
        picked.append(index)
    rest = [i for i in range(len(names)) if i not in picked]
    if Ellipsis not in spec and rest:
        missing = tuple(names[i] for i in rest)
        raise ValueError(f"rearrange: axes {missing} of the array are not listed; add them or '...'")
    order: list[int] = []
    next_picked = iter(picked)
    for s in spec:
        if s is Ellipsis:
            order.extend(rest)
        else:
            order.append(next(next_picked))
    if order == list(range(len(names))):
        return array
    return NamedArray(jnp.transpose(array.array, order), tuple(array.axes[i] for i in order))


class _Resolver:
    """Turns the identifiers of an expression into axis names and sizes using the bindings."""

    def __init__(self, expression: str, bindings: Mapping[str, _Binding]):
        self.expression = expression
        self.bindings = bindings
        self.used: set[str] = set()

    def name(self, ident: str) -> str:
        binding = self.bindings.get(ident)
        if binding is None:
            return ident
        self.used.add(ident)
        if isinstance(binding, Axis):
            return binding.name
        if isinstance(binding, str):
            return binding
        return ident

    def size(self, ident: str) -> int | None:
        binding = self.bindings.get(ident)
        if isinstance(binding, Axis):
            self.used.add(ident)
            return binding.size
        if isinstance(binding, int) and not isinstance(binding, bool):
            self.used.add(ident)
            return binding
        return None

    def error(self, message: str, position: int | None) -> AxisExpressionError:
        return AxisExpressionError(f"rearrange: {message}", self.expression, position)


def _split(axis: Axis, capture: Capture, res: _Resolver) -> list[Axis]:
    sizes = [res.size(ident) for ident in capture.axes]
    unknown = [i for i, s in enumerate(sizes) if s is None]
    known = math.prod(s for s in sizes if s is not None)
    if len(unknown) > 1:
        missing = ", ".join(capture.axes[i] for i in unknown)
        raise res.error(
            f"cannot infer the sizes of {missing} when splitting {axis}; pass one as a keyword", capture.position
        )
    if unknown:
        if known == 0 or axis.size % known:
            raise res.error(f"axis {axis} cannot be split into pieces of size {known}", capture.position)
        sizes[unknown[0]] = axis.size // known
    elif known != axis.size:
        raise res.error(
            f"axis {axis} cannot be split into {' × '.join(map(str, sizes))} = {known} elements", capture.position
        )
    return [Axis(res.name(ident), size) for ident, size in zip(capture.axes, sizes)]  # type: ignore[arg-type]


def _rearrange_expression(array: NamedArray, expression: str, bindings: Mapping[str, _Binding]) -> NamedArray:
    lhs, rhs = parse_rearrangement(expression)
    res = _Resolver(expression, bindings)
    axes = tuple(array.axes)
    # Each array axis becomes one or more "atoms" (split pieces); variables name atoms.
    atoms_per_axis: list[list[Axis]] = [[ax] for ax in axes]
    variables: dict[str, tuple[int, int]] = {}  # variable -> (array axis index, piece index)
    claimed: set[int] = set()

    if lhs.is_ordered:
        n_named = sum(1 for c in lhs.captures if c is not Ellipsis)
        if (lhs.has_ellipsis and n_named > len(axes)) or (not lhs.has_ellipsis and n_named != len(axes)):
            expected = f"at least {n_named}" if lhs.has_ellipsis else str(n_named)
            raise res.error(
                f"the left side names {expected} axes but the array has {len(axes)}: {tuple(a.name for a in axes)}",
                lhs.position,
            )
        positions: list[int] = []
        front = True
        for i, c in enumerate(lhs.captures):
            if c is Ellipsis:
                front = False
                continue
            after = sum(1 for d in lhs.captures[i + 1 :] if d is not Ellipsis)
            positions.append(len(positions) if front else len(axes) - 1 - after)
        captures = [c for c in lhs.captures if c is not Ellipsis]
        for index, c in zip(positions, captures):
            assert isinstance(c, Capture)
            axis = axes[index]
            claimed.add(index)
            if c.is_group:
                if c.binding is not None and res.name(c.binding) != axis.name:
                    raise res.error(f"group {c.binding!r} is matched by position to axis {axis}", c.position)
                atoms_per_axis[index] = _split(axis, c, res)
                for piece, ident in enumerate(c.axes):
                    variables[ident] = (index, piece)
            else:
                assert c.binding is not None
                ident = c.binding
                if ident in bindings:
                    want_name, want_size = res.name(ident), res.size(ident)
                    if (isinstance(bindings[ident], (Axis, str)) and want_name != axis.name) or (
                        want_size is not None and want_size != axis.size
                    ):
                        raise res.error(f"{ident!r}={bindings[ident]!r} does not match axis {axis}", c.position)
                variables[ident] = (index, 0)
    else:
        names = [a.name for a in axes]
        for c in lhs.captures:
            if c is Ellipsis:
                continue
            assert isinstance(c, Capture)
            if c.binding is None:
                raise res.error("a split on an unordered side needs the axis name: '(name: a b)'", c.position)
            name = res.name(c.binding)
            if name not in names:
                raise res.error(f"axis {name!r} is not in the array, whose axes are {tuple(names)}", c.position)
            index = names.index(name)
            claimed.add(index)
            if c.is_group:
                atoms_per_axis[index] = _split(axes[index], c, res)
                for piece, ident in enumerate(c.axes):
                    variables[ident] = (index, piece)
            else:
                variables[c.binding] = (index, 0)

    flat_atoms: list[Axis] = [atom for pieces in atoms_per_axis for atom in pieces]
    offsets = [0]
    for pieces in atoms_per_axis:
        offsets.append(offsets[-1] + len(pieces))
    pool = [offsets[i] for i in range(len(axes)) if i not in claimed]

    order: list[int] = []
    out_axes: list[Axis] = []
    used_vars: set[str] = set()

    def atom_of(ident: str, position: int) -> int:
        if ident not in variables:
            raise res.error(f"{ident!r} on the right side is not bound on the left side", position)
        if ident in used_vars:
            raise res.error(f"{ident!r} occurs more than once on the right side", position)
        used_vars.add(ident)
        index, piece = variables[ident]
        return offsets[index] + piece

    for c in rhs.captures:
        if c is Ellipsis:
            order.extend(pool)
            out_axes.extend(flat_atoms[i] for i in pool)
            continue
        assert isinstance(c, Capture)
        if c.is_group:
            if c.binding is None:
                raise res.error("a merged axis needs a name: write '(name: a b)'", c.position)
            group = [atom_of(ident, c.position) for ident in c.axes]
            order.extend(group)
            out_axes.append(Axis(res.name(c.binding), math.prod(flat_atoms[i].size for i in group)))
        else:
            assert c.binding is not None
            i = atom_of(c.binding, c.position)
            order.append(i)
            out_axes.append(flat_atoms[i])

    unused = [v for v in variables if v not in used_vars]
    if unused:
        raise res.error(
            f"{', '.join(map(repr, unused))} bound on the left side do not occur on the right side", rhs.position
        )
    if pool and not rhs.has_ellipsis:
        left = tuple(axes[i].name for i in range(len(axes)) if i not in claimed)
        raise res.error(f"axes {left} are not mentioned; add '...' to the right side", rhs.position)
    unused_bindings = [b for b in bindings if b not in res.used]
    if unused_bindings:
        raise res.error(f"bindings {unused_bindings} do not occur in the expression", None)
    seen: set[str] = set()
    for ax in out_axes:
        if ax.name in seen:
            raise res.error(f"the result would have axis {ax.name!r} twice", rhs.position)
        seen.add(ax.name)

    raw = array.array
    if len(flat_atoms) != len(axes):
        raw = jnp.reshape(raw, tuple(a.size for a in flat_atoms))
    if order != sorted(order):
        raw = jnp.transpose(raw, order)
    if len(out_axes) != len(flat_atoms):
        raw = jnp.reshape(raw, tuple(a.size for a in out_axes))
    return NamedArray(raw, tuple(out_axes))
