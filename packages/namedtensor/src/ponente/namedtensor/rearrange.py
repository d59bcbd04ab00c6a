"""``rearrange``: transpose, split and merge axes by name (axis-list form and einops-like string form)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import EllipsisType
from typing import Any, overload

import jax.numpy as jnp

from ._parsing import AxisExpressionError, Capture, Side, parse_rearrangement
from .axis import Axis, rearrange_for_partial_order
from .core import NamedArray

__all__ = ["einops_rearrange", "rearrange"]

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
      transposes ``x`` so that its axes appear in that order; ``...`` stands for the axes not listed, in
      their current order (with several ``...``, see :func:`~ponente.namedtensor.axis.rearrange_for_partial_order`).
      Without ``...`` every axis must be listed.
    * **Expression**: ``rearrange(x, "b (h d) -> b h d", d=64)``, einops-style; see :func:`einops_rearrange`.

    The keyword forms ``rearrange(x, axes=...)`` and ``rearrange(x, expression=..., **bindings)`` work too.

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
    if not args and "expression" in bindings:
        return einops_rearrange(array, bindings.pop("expression"), **bindings)
    if not args and "axes" in bindings:
        args = (bindings.pop("axes"),)
    if len(args) == 1 and isinstance(args[0], str) and any(ch in args[0] for ch in " ,(){}->"):
        return einops_rearrange(array, args[0], **bindings)
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
    picked: list[str] = []
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
        if name in picked:
            raise ValueError(f"rearrange: axis {name!r} is listed more than once in {spec!r}")
        picked.append(name)
    if Ellipsis not in spec and len(picked) < len(names):
        missing = tuple(n for n in names if n not in picked)
        raise ValueError(f"rearrange: axes {missing} of the array are not listed; add them or '...'")
    partial = [Ellipsis if s is Ellipsis else _name_of(s) for s in spec]
    order = [names.index(n) for n in rearrange_for_partial_order(partial, names)]
    if order == list(range(len(names))):
        return array
    return NamedArray(jnp.transpose(array.array, order), tuple(array.axes[i] for i in order))


def einops_rearrange(array: NamedArray, expression: str, /, **bindings: _Binding) -> NamedArray:
    """Rearranges ``array`` as an einops-like expression says: ``"lhs -> rhs"``.

    - An *ordered* left side matches the array's axes by position (its identifiers are variables and need
      not equal the axis names; ``...`` at most once, for the axes in between). An *unordered* left side
      ``{h w}`` selects axes by name; the others are left for ``...``.
    - ``(name: a b)`` on the left splits axis ``name`` (on an ordered side the name may be omitted:
      ``(a b)``) into new axes ``a`` and ``b``; their sizes come from ``bindings`` (one may be inferred).
    - ``(name: a b)`` on the right merges ``a`` and ``b`` (C order) into a new axis ``name``; a single
      ``(name: a)`` renames. A plain identifier on the right keeps the axis it is bound to.
    - ``...`` on the right (any number of times) stands for the axes the right side does not mention,
      placed as :func:`~ponente.namedtensor.axis.rearrange_for_partial_order` does. Without it, every
      axis must be mentioned.
    - ``bindings`` give sizes (``d=64``), or alias an identifier to an axis name or :class:`Axis`
      (``d=HeadSize``, ``P="patch"``). Identifiers may be quoted: ``'my axis'``.

    Args:
        array: the array to rearrange.
        expression: the expression.
        **bindings: sizes or aliases of the identifiers in the expression.

    Returns:
        The rearranged NamedArray.

    Raises:
        AxisExpressionError: (a ``ValueError``) if the expression is malformed or does not fit the
            array; the message points at the offending character.

    Example:
        >>> import ponente.namedtensor as hax
        >>> from ponente.namedtensor.rearrange import einops_rearrange
        >>> x = hax.zeros({"batch": 2, "h": 4, "w": 6, "c": 3})
        >>> einops_rearrange(x, "{batch (h: h1 h) (w: w1 w)} -> (batch: batch h1 w1) ... h w", h1=2, w1=2).axes
        (Axis(name='batch', size=8), Axis(name='c', size=3), Axis(name='h', size=2), Axis(name='w', size=3))
    """
    lhs, rhs = parse_rearrangement(expression)
    res = _Resolver(expression, bindings)
    if not rhs.is_ordered:
        raise res.error("the right-hand side must be ordered (no '{...}')", rhs.position)
    atoms = _Atoms(tuple(array.axes), res)
    if lhs.is_ordered:
        _bind_by_position(lhs, atoms, res)
    else:
        _bind_by_name(lhs, atoms, res)
    order, out_axes = _plan_output(rhs, atoms, res)
    unused_bindings = [b for b in bindings if b not in res.used]
    if unused_bindings:
        raise res.error(f"bindings {unused_bindings} do not occur in the expression", None)
    seen: set[str] = set()
    for ax in out_axes:
        if ax.name in seen:
            raise res.error(f"the result would have axis {ax.name!r} twice", rhs.position)
        seen.add(ax.name)

    flat = atoms.flat()
    raw = array.array
    if len(flat) != len(array.axes):
        raw = jnp.reshape(raw, tuple(a.size for a in flat))
    if order != sorted(order):
        raw = jnp.transpose(raw, order)
    if len(out_axes) != len(flat):
        raw = jnp.reshape(raw, tuple(a.size for a in out_axes))
    return NamedArray(raw, tuple(out_axes))


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
        return AxisExpressionError(message, self.expression, position)


class _Atoms:
    """The array's axes, each split into one or more pieces ("atoms"), and the variables naming them."""

    def __init__(self, axes: tuple[Axis, ...], res: _Resolver):
        self.axes = axes
        self.res = res
        self.pieces: list[list[Axis]] = [[ax] for ax in axes]
        self.variables: dict[str, tuple[int, int]] = {}  # variable -> (axis index, piece index)
        self.bound: set[int] = set()

    def bind(self, capture: Capture, index: int) -> None:
        """Binds ``capture`` (an identifier or a split group) to axis ``index``."""
        axis = self.axes[index]
        if index in self.bound:
            raise self.res.error(f"Axis {axis.name} is bound more than once on the left side", capture.position)
        self.bound.add(index)
        idents = capture.axes if capture.is_group else (capture.binding,)
        for k, ident in enumerate(idents):
            assert ident is not None
            if ident in self.variables or ident in idents[:k]:
                raise self.res.error(f"Capture {ident} is assigned more than once on the left side", capture.position)
        if capture.is_group:
            self.pieces[index] = _split(axis, capture, self.res)
        for piece, ident in enumerate(idents):
            assert ident is not None
            self.variables[ident] = (index, piece)

    def flat(self) -> list[Axis]:
        return [atom for pieces in self.pieces for atom in pieces]

    def atom_index(self, ident: str) -> int:
        index, piece = self.variables[ident]
        return sum(len(p) for p in self.pieces[:index]) + piece


def _bind_by_position(lhs: Side, atoms: _Atoms, res: _Resolver) -> None:
    n = len(atoms.axes)
    names = tuple(a.name for a in atoms.axes)
    captures = lhs.captures
    split = captures.index(Ellipsis) if lhs.has_ellipsis else len(captures)
    head = [c for c in captures[:split] if isinstance(c, Capture)]
    tail = [c for c in captures[split + 1 :] if isinstance(c, Capture)]
    named = len(head) + len(tail)
    if len(head) > n or (not lhs.has_ellipsis and named > n):
        raise res.error(
            f"Too many axes in lhs: the left side names {named} axes but the array has {n}: {names}",
            head[n].position if len(head) > n else lhs.position,
        )
    if not lhs.has_ellipsis and named < n:
        raise res.error(
            f"Not all axes are bound: the left side names {named} axes but the array has {n}: {names};"
            " use '...' to skip axes",
            lhs.position,
        )
    if len(lhs.ellipsis_positions) > 1:
        raise res.error("Only one ellipsis allowed on an ordered left side", lhs.ellipsis_positions[1])
    for index, capture in enumerate(head):
        _bind_positional(capture, index, atoms, res)
    for offset, capture in enumerate(reversed(tail)):
        _bind_positional(capture, n - 1 - offset, atoms, res)


def _bind_positional(capture: Capture, index: int, atoms: _Atoms, res: _Resolver) -> None:
    axis = atoms.axes[index]
    ident = capture.binding
    if not capture.is_group and ident in res.bindings:
        assert ident is not None
        want_name, want_size = res.name(ident), res.size(ident)
        if (isinstance(res.bindings[ident], Axis | str) and want_name != axis.name) or (
            want_size is not None and want_size != axis.size
        ):
            raise res.error(f"Alias {ident}={res.bindings[ident]!r} does not match axis {axis}", capture.position)
    atoms.bind(capture, index)


def _bind_by_name(lhs: Side, atoms: _Atoms, res: _Resolver) -> None:
    names = tuple(a.name for a in atoms.axes)
    for capture in lhs.captures:
        if not isinstance(capture, Capture):
            continue  # '...' adds nothing to an unordered side
        if capture.binding is None:
            raise res.error(
                "Unordered axes must be bound by name: write '(name: a b)' or just 'name'", capture.position
            )
        name = res.name(capture.binding)
        if name not in names:
            raise res.error(f"Could not resolve axis {name!r}: the array's axes are {names}", capture.position)
        atoms.bind(capture, names.index(name))


def _split(axis: Axis, capture: Capture, res: _Resolver) -> list[Axis]:
    sizes = [res.size(ident) for ident in capture.axes]
    unknown = [i for i, s in enumerate(sizes) if s is None]
    known = math.prod(s for s in sizes if s is not None)
    if len(unknown) > 1:
        missing = ", ".join(capture.axes[i] for i in unknown)
        raise res.error(
            f"Sizes for this split axis are ambiguous: cannot infer the sizes of {missing} when splitting {axis};"
            " pass all but one as keywords",
            capture.position,
        )
    if unknown:
        if known == 0 or axis.size % known:
            raise res.error(
                f"Axes do not divide evenly into axis {axis}: it cannot be split into pieces of size {known}",
                capture.position,
            )
        sizes[unknown[0]] = axis.size // known
    elif known != axis.size:
        raise res.error(
            f"Axes do not divide evenly into axis {axis}: {' × '.join(map(str, sizes))} = {known} elements",
            capture.position,
        )
    return [Axis(res.name(ident), size) for ident, size in zip(capture.axes, sizes)]  # type: ignore[arg-type]


def _plan_output(rhs: Side, atoms: _Atoms, res: _Resolver) -> tuple[list[int], list[Axis]]:
    """The transposition of the atoms and the output axes that the right side asks for."""
    flat = atoms.flat()
    partial: list[str | EllipsisType] = []
    merged: dict[int, Axis] = {}  # first atom of each right-side item -> its output axis
    used: set[int] = set()
    for capture in rhs.captures:
        if not isinstance(capture, Capture):
            partial.append(Ellipsis)
            continue
        if capture.binding is None:
            raise res.error("All rhs axes must have a name: write '(name: a b)'", capture.position)
        group: list[int] = []
        for ident in capture.axes:
            if ident not in atoms.variables:
                raise res.error(f"Axis {ident} is not bound on the lhs", capture.position)
            atom = atoms.atom_index(ident)
            if atom in used:
                raise res.error(f"Axis {ident} is used more than once on the right side", capture.position)
            used.add(atom)
            group.append(atom)
        if capture.is_group:
            # an identifier bound on the left stands for its axis, also as the name of a merged axis
            binding = capture.binding
            name = flat[atoms.atom_index(binding)].name if binding in atoms.variables else res.name(binding)
            merged[group[0]] = Axis(name, math.prod(flat[i].size for i in group))
        else:
            merged[group[0]] = flat[group[0]]
        # atoms are ordered by index: split pieces may share names with other axes
        partial.extend(str(i) for i in group)
    unused = [i for i in range(len(flat)) if i not in used]
    if unused and not rhs.has_ellipsis:
        raise res.error(
            f"Not all intermediate axes are used: {tuple(flat[i].name for i in unused)} do not occur on the right"
            " side; add them or '...'",
            rhs.position,
        )
    order = [int(k) for k in rearrange_for_partial_order(partial, [str(i) for i in range(len(flat))])]
    out_axes = [flat[i] if i not in used else merged[i] for i in order if i not in used or i in merged]
    return order, out_axes
