"""``einsum``: Einstein summation with long axis names, in ordered, unordered and output-only forms."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import EllipsisType
from typing import Any

from ._parsing import AxisExpressionError, Capture, Side, parse_einsum
from .axis import Axis, rearrange_for_partial_order
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
      With ``...`` on the left, everything not on the right is contracted; with ``...`` on the right
      (possibly several times), it stands for the kept axes not listed, placed as
      :func:`~ponente.namedtensor.axis.rearrange_for_partial_order` does.
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
    lhses, rhs = parse_einsum(equation)
    for i, a in enumerate(arrays):
        if not isinstance(a, NamedArray):
            raise TypeError(f"einsum: operand {i} is a {type(a).__name__}, not a NamedArray")
    if not arrays:
        raise AxisExpressionError("einsum needs at least one array", equation, None)
    output_only = len(lhses) == 1 and lhses[0].is_ordered and not lhses[0].captures
    unordered = len(lhses) == 1 and not lhses[0].is_ordered
    _check_form(equation, lhses, rhs, ordered=not (output_only or unordered))
    ctx = _Context(equation, axis_aliases, arrays)
    if output_only:
        out = _output_only(ctx, rhs)
    elif unordered:
        out = _unordered(ctx, lhses[0], rhs)
    else:
        out = _ordered(ctx, lhses, rhs)
    ctx.check_aliases_used()
    scope = f"einsum {equation}"
    return _contract(arrays, out, precision=precision, preferred_element_type=preferred_element_type, scope=scope)


def _check_form(equation: str, lhses: list[Side], rhs: Side, ordered: bool) -> None:
    """Errors for what the grammar allows but einsum does not."""
    if len(lhses) > 1:
        for side in lhses:
            if not side.is_ordered:
                raise AxisExpressionError(
                    "an unordered '{...}' left-hand side must be the only one", equation, side.position
                )
    if not rhs.is_ordered:
        raise AxisExpressionError("the output side must be ordered (no '{...}')", equation, rhs.position)
    for side in [*lhses, rhs]:
        for capture in side.captures:
            if isinstance(capture, Capture) and capture.is_group:
                raise AxisExpressionError(
                    "Parenthesized groups are not supported in einsum", equation, capture.position
                )
        if ordered and len(side.ellipsis_positions) > 1:
            raise AxisExpressionError(
                "'...' may occur at most once per side in an ordered einsum", equation, side.ellipsis_positions[1]
            )


class _Context:
    def __init__(self, equation: str, aliases: Mapping[str, Axis | str], arrays: Sequence[NamedArray]):
        self.equation = equation
        self.aliases = aliases
        self.used_aliases: set[str] = set()
        self.arrays = arrays
        self.all_axes = _all_axes(arrays)
        self.by_name = {ax.name: ax for ax in self.all_axes}
        self.unordered = False

    def error(self, message: str, position: int | None) -> AxisExpressionError:
        return AxisExpressionError(message, self.equation, position)

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
            raise self.error(
                f"Axis {name} not present (not found in any of the input arrays, whose axes are"
                f" {tuple(self.by_name)})",
                capture.position,
            )
        axis = self.by_name[name]
        if isinstance(alias, Axis) and alias.size != axis.size:
            raise self.error(
                f"Size mismatch: alias {label}={alias} has size {alias.size} but the arrays have {axis}",
                capture.position,
            )
        return axis

    def check_aliases_used(self) -> None:
        unused = [a for a in self.aliases if a not in self.used_aliases]
        if not unused:
            return
        if self.unordered:
            raise self.error(f"Axis alias {', '.join(unused)} not used in the equation", None)
        raise self.error(f"Unused aliases from kwargs: {', '.join(unused)}", None)


def _ordered(ctx: _Context, lhses: list[Side], rhs: Side) -> list[Axis]:
    arrays_axes = [tuple(a.axes) for a in ctx.arrays]
    if len(lhses) != len(arrays_axes):
        raise ctx.error(
            f"Number of operand groups ({len(lhses)}) does not match number of arrays ({len(arrays_axes)})", None
        )
    bound: dict[str, Axis] = {}
    ellipsis_axes: list[Axis] = []
    for k, (side, axes) in enumerate(zip(lhses, arrays_axes)):
        n_labels = sum(1 for c in side.captures if c is not Ellipsis)
        if (side.has_ellipsis and n_labels > len(axes)) or (not side.has_ellipsis and n_labels != len(axes)):
            raise ctx.error(
                f"Mismatched number of axes in einsum: operand {k} has axes {tuple(a.name for a in axes)} but its"
                f" group has {n_labels} labels",
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


def _resolve_side(ctx: _Context, side: Side) -> list[Axis | EllipsisType]:
    """The axes a by-name side lists (``...`` kept in place); an axis named twice is an error."""
    out: list[Axis | EllipsisType] = []
    for capture in side.captures:
        if not isinstance(capture, Capture):
            out.append(Ellipsis)
            continue
        ax = ctx.resolve(capture)
        if ax in out:
            raise ctx.error(f"Axis {ax.name} occurs multiple times on one side", capture.position)
        out.append(ax)
    return out


def _named(spec: list[Axis | EllipsisType]) -> list[Axis]:
    return [ax for ax in spec if isinstance(ax, Axis)]


def _unordered(ctx: _Context, lhs: Side, rhs: Side) -> list[Axis]:
    ctx.unordered = True
    named_left = _named(_resolve_side(ctx, lhs))
    right = _resolve_side(ctx, rhs)
    named_right = _named(right)
    if lhs.has_ellipsis and not rhs.has_ellipsis:
        return named_right
    contracted = {ax.name for ax in named_left} - {ax.name for ax in named_right}
    kept = [ax for ax in ctx.all_axes if ax.name not in contracted]
    if not rhs.has_ellipsis:
        right = [Ellipsis, *right]  # the kept axes not named on the right come first
    return list(rearrange_for_partial_order(right, kept))


def _output_only(ctx: _Context, rhs: Side) -> list[Axis]:
    right = _resolve_side(ctx, rhs)
    if not rhs.has_ellipsis:
        return _named(right)
    return list(rearrange_for_partial_order(right, ctx.all_axes))
