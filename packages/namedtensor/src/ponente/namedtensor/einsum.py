"""``einsum``: Einstein summation with long axis names, in ordered, unordered and output-only forms."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._parsing import AxisExpressionError, Capture, Side, parse_einsum
from .axis import Axis
from .core import NamedArray
from .dot import _all_axes, _contract

__all__ = ["einsum"]


def einsum(
    equation: str,
    *arrays: NamedArray,
    precision: Any = None,
    preferred_element_type: Any = None,
    **axis_aliases: Axis | str,
) -> NamedArray:
    """Tensor contraction written as an equation over axis names.

    The form of ``equation`` picks the mode:

    * **ordered** ``"b q d, b k d -> b q k"``: one comma-separated group per array, matching the
      array's axes *by position* (the labels need not be the axis names; ``...`` matches the axes in
      between). A label used in several groups must refer to the same axis name. The output lists
      labels (and ``...`` for the axes matched by ``...`` that are not labelled elsewhere); labels that
      are not in the output are summed.
    * **unordered** ``"{d} -> q k"``: the braces name axes (by name); those named on the left and not
      on the right are contracted, every other axis is kept, the right side's axes last in its order.
      With ``...`` on the left, everything not on the right is contracted; with ``...`` on the right,
      it stands for the kept axes not listed.
    * **output-only** ``"-> b q k"``: exactly the listed axes are kept (``...``: every axis not listed),
      everything else is contracted.

    Equal axis names across arrays are one index (batched if kept, summed if not).

    Args:
        equation: the equation.
        *arrays: the NamedArrays.
        precision: passed to ``jax.lax.dot_general``.
        preferred_element_type: the accumulation/result dtype.
        **axis_aliases: map labels of the equation to axis names or :class:`Axis` (sizes are checked),
            so library code can use short fixed labels: ``einsum("{D} -> ", x, D=Embed)``.

    Returns:
        The contracted NamedArray.

    Raises:
        AxisExpressionError: (a ``ValueError``) for a malformed equation, or one that does not fit the
            arrays; the message points at the offending character.

    Example:
        >>> import ponente.namedtensor as hax
        >>> x = hax.ones({"h": 2, "w": 3, "d": 4})
        >>> w = hax.ones({"d": 4})
        >>> hax.einsum("h w d, d -> h w", x, w).axes == hax.einsum("{d} -> h w", x, w).axes
        True
    """
    lhses, unordered, rhs = parse_einsum(equation)
    for i, a in enumerate(arrays):
        if not isinstance(a, NamedArray):
            raise TypeError(f"einsum: operand {i} is a {type(a).__name__}, not a NamedArray")
    if not arrays:
        raise AxisExpressionError("einsum: needs at least one array", equation, None)
    ctx = _Context(equation, axis_aliases, arrays)
    if lhses:
        out = _ordered(ctx, lhses, rhs)
    elif unordered is not None:
        out = _unordered(ctx, unordered, rhs)
    else:
        out = _output_only(ctx, rhs)
    unused = [a for a in axis_aliases if a not in ctx.used_aliases]
    if unused:
        raise AxisExpressionError(f"einsum: aliases {unused} do not occur in the equation", equation, None)
    scope = f"einsum {equation}"
    return _contract(arrays, out, precision=precision, preferred_element_type=preferred_element_type, scope=scope)


class _Context:
    def __init__(self, equation: str, aliases: Mapping[str, Axis | str], arrays: Sequence[NamedArray]):
        self.equation = equation
        self.aliases = aliases
        self.used_aliases: set[str] = set()
        self.arrays = arrays
        self.all_axes = _all_axes(arrays)
        self.by_name = {ax.name: ax for ax in self.all_axes}

    def error(self, message: str, position: int | None) -> AxisExpressionError:
        return AxisExpressionError(f"einsum: {message}", self.equation, position)

    def label(self, capture: Capture | Any) -> str:
        assert isinstance(capture, Capture)
        assert capture.binding is not None
        return capture.binding

    def resolve(self, capture: Capture) -> Axis:
        """The input axis named by ``capture`` (through the aliases)."""
        label = self.label(capture)
        alias = self.aliases.get(label)
        name = label
        if alias is not None:
            self.used_aliases.add(label)
            name = alias if isinstance(alias, str) else alias.name
        if name not in self.by_name:
            raise self.error(f"axis {name!r} is in none of the arrays {tuple(self.by_name)}", capture.position)
        axis = self.by_name[name]
        if isinstance(alias, Axis) and alias.size != axis.size:
            raise self.error(
                f"alias {label}={alias} has size {alias.size} but the arrays have {axis}", capture.position
            )
        return axis


def _ordered(ctx: _Context, lhses: list[Side], rhs: Side) -> list[Axis]:
    arrays_axes = [tuple(a.axes) for a in ctx.arrays]
    if len(lhses) != len(arrays_axes):
        raise ctx.error(f"the equation has {len(lhses)} operand groups but {len(arrays_axes)} arrays were given", None)
    bound: dict[str, Axis] = {}
    ellipsis_axes: list[Axis] = []
    for k, (side, axes) in enumerate(zip(lhses, arrays_axes)):
        n_labels = sum(1 for c in side.captures if c is not Ellipsis)
        if (side.has_ellipsis and n_labels > len(axes)) or (not side.has_ellipsis and n_labels != len(axes)):
            raise ctx.error(
                f"operand {k} has axes {tuple(a.name for a in axes)} but its group has {n_labels} labels",
                side.position,
            )
        split = side.captures.index(Ellipsis) if side.has_ellipsis else len(side.captures)
        head, tail = side.captures[:split], side.captures[split + 1 :]
        matched = list(zip(head, axes[: len(head)])) + list(zip(tail, axes[len(axes) - len(tail) :]))
        if side.has_ellipsis:
            for ax in axes[len(head) : len(axes) - len(tail)]:
                if all(e.name != ax.name for e in ellipsis_axes):
                    ellipsis_axes.append(ax)
        for capture, ax in matched:
            assert isinstance(capture, Capture)
            label = ctx.label(capture)
            alias = ctx.aliases.get(label)
            if alias is not None:
                ctx.used_aliases.add(label)
                want = alias if isinstance(alias, str) else alias.name
                if want != ax.name or (isinstance(alias, Axis) and alias.size != ax.size):
                    raise ctx.error(f"label {label!r} is aliased to {alias!r} but matches axis {ax}", capture.position)
            if label in bound and bound[label].name != ax.name:
                raise ctx.error(
                    f"label {label!r} matches axis {bound[label].name!r} earlier but {ax.name!r} in operand {k}",
                    capture.position,
                )
            other = next((lab for lab, b in bound.items() if b.name == ax.name and lab != label), None)
            if other is not None:
                raise ctx.error(f"labels {other!r} and {label!r} both match axis {ax.name!r}", capture.position)
            bound[label] = ax
    out: list[Axis] = []
    for capture in rhs.captures:
        if capture is Ellipsis:
            labelled = {b.name for b in bound.values()}
            out.extend(ax for ax in ellipsis_axes if ax.name not in labelled)
            continue
        assert isinstance(capture, Capture)
        label = ctx.label(capture)
        if label not in bound:
            raise ctx.error(f"output label {label!r} does not occur on the left side", capture.position)
        out.append(bound[label])
    return out


def _names(ctx: _Context, side: Side) -> list[Axis]:
    out: list[Axis] = []
    for capture in side.captures:
        if capture is Ellipsis:
            continue
        assert isinstance(capture, Capture)
        ax = ctx.resolve(capture)
        if ax in out:
            raise ctx.error(f"axis {ax.name!r} is named twice on one side", capture.position)
        out.append(ax)
    return out


def _unordered(ctx: _Context, lhs: Side, rhs: Side) -> list[Axis]:
    named_left = _names(ctx, lhs)
    named_right = _names(ctx, rhs)
    if lhs.has_ellipsis and not rhs.has_ellipsis:
        return named_right
    contracted = {ax.name for ax in named_left} - {ax.name for ax in named_right}
    rest = [ax for ax in ctx.all_axes if ax.name not in contracted and ax not in named_right]
    if rhs.has_ellipsis:
        return _fill_ellipsis(rhs, named_right, rest)
    return rest + named_right


def _output_only(ctx: _Context, rhs: Side) -> list[Axis]:
    named = _names(ctx, rhs)
    if not rhs.has_ellipsis:
        return named
    rest = [ax for ax in ctx.all_axes if ax not in named]
    return _fill_ellipsis(rhs, named, rest)


def _fill_ellipsis(side: Side, named: list[Axis], rest: list[Axis]) -> list[Axis]:
    out: list[Axis] = []
    it = iter(named)
    for capture in side.captures:
        if capture is Ellipsis:
            out.extend(rest)
        else:
            out.append(next(it))
    return out
