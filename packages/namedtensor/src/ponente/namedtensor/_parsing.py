"""Parser for the einops-like axis expressions used by ``rearrange`` and ``einsum``.

Grammar (whitespace or commas separate items inside one side)::

    expression := side "->" side                  (rearrange)
                | side ("," side)* "->" side      (einsum; top-level commas separate operands)
    side       := "{" item* "}" | item*
    item       := identifier | "..." | "(" [identifier ":"] identifier* ")"

Errors raise :class:`AxisExpressionError`, whose message repeats the expression with a caret under
the offending character.
"""

from __future__ import annotations

import dataclasses
from types import EllipsisType

__all__ = ["AxisExpressionError", "Capture", "Side", "parse_einsum", "parse_rearrangement"]


class AxisExpressionError(ValueError):
    """A malformed ``rearrange``/``einsum`` expression, or one that does not fit its arrays.

    The message names the problem and points at the offending character of the expression.
    """

    def __init__(self, message: str, expression: str, position: int | None = None):
        self.expression = expression
        self.position = position
        if position is None:
            text = f"{message}\n    {expression}"
        else:
            text = f"{message} (at character {position})\n    {expression}\n    {' ' * position}^"
        super().__init__(text)


@dataclasses.dataclass(frozen=True)
class Capture:
    """One item of a side: a single identifier, or a parenthesized group ``(name: a b)``.

    Attributes:
        binding: the identifier, or the group's name (``None`` for an anonymous group ``(a b)``).
        axes: the identifiers inside a group; for a single identifier, just that identifier.
        is_group: whether this item was parenthesized.
        position: index of the item's first character in the expression.
    """

    binding: str | None
    axes: tuple[str, ...]
    is_group: bool
    position: int


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of an expression: its items in order and whether it was ``{unordered}``."""

    captures: tuple[Capture | EllipsisType, ...]
    is_ordered: bool
    position: int

    @property
    def has_ellipsis(self) -> bool:
        """Whether ``...`` occurs on this side."""
        return any(c is Ellipsis for c in self.captures)


def _is_ident_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


class _Parser:
    def __init__(self, expression: str, operand_commas: bool):
        self.s = expression
        self.i = 0
        self.operand_commas = operand_commas

    def error(self, message: str, position: int | None = None) -> AxisExpressionError:
        return AxisExpressionError(message, self.s, self.i if position is None else position)

    def skip_space(self, commas: bool) -> None:
        while self.i < len(self.s) and (self.s[self.i].isspace() or (commas and self.s[self.i] == ",")):
            self.i += 1

    def at_arrow(self) -> bool:
        return self.s.startswith("->", self.i)

    def ident(self) -> str:
        start = self.i
        while self.i < len(self.s) and _is_ident_char(self.s[self.i]):
            self.i += 1
        name = self.s[start : self.i]
        if not name:
            found = repr(self.s[self.i]) if self.i < len(self.s) else "end of expression"
            raise self.error(f"expected an axis name, found {found}")
        if name[0].isdigit():
            raise self.error(f"axis name {name!r} must not start with a digit", start)
        return name

    def group(self) -> Capture:
        start = self.i
        self.i += 1  # "("
        self.skip_space(commas=False)
        binding: str | None = None
        names: list[str] = []
        while True:
            self.skip_space(commas=False)
            if self.i >= len(self.s):
                raise self.error("unclosed '('", start)
            ch = self.s[self.i]
            if ch == ")":
                self.i += 1
                break
            if ch == ":":
                if binding is not None or len(names) != 1:
                    raise self.error("':' must follow exactly one group name, as in '(name: a b)'")
                binding = names.pop()
                self.i += 1
                continue
            if ch in "({}":
                raise self.error(f"unexpected {ch!r} inside a group")
            if self.s.startswith("...", self.i):
                raise self.error("'...' is not allowed inside a group")
            if self.at_arrow():
                raise self.error("unclosed '(' before '->'", start)
            names.append(self.ident())
        if binding is not None and not names:
            raise self.error(f"group {binding!r} has no axes after ':'", start)
        return Capture(binding, tuple(names), True, start)

    def side(self, stop_at_comma: bool) -> Side:
        self.skip_space(commas=False)
        start = self.i
        unordered = self.i < len(self.s) and self.s[self.i] == "{"
        if unordered:
            self.i += 1
        captures: list[Capture | EllipsisType] = []
        while True:
            self.skip_space(commas=not stop_at_comma)
            if self.i >= len(self.s):
                if unordered:
                    raise self.error("unclosed '{'", start)
                break
            ch = self.s[self.i]
            if unordered and ch == "}":
                self.i += 1
                self.skip_space(commas=False)
                if self.i < len(self.s) and not self.at_arrow() and not (stop_at_comma and self.s[self.i] == ","):
                    raise self.error("unexpected text after '}'")
                break
            if self.at_arrow() or (stop_at_comma and ch == ","):
                if unordered:
                    raise self.error("unclosed '{'", start)
                break
            if ch == "{":
                raise self.error("'{' may only open a side")
            if ch in ")}":
                raise self.error(f"unmatched {ch!r}")
            if ch == "(":
                captures.append(self.group())
            elif self.s.startswith("...", self.i):
                if Ellipsis in captures:
                    raise self.error("'...' may occur at most once per side")
                captures.append(Ellipsis)
                self.i += 3
            elif _is_ident_char(ch):
                pos = self.i
                name = self.ident()
                captures.append(Capture(name, (name,), False, pos))
            else:
                raise self.error(f"unexpected character {ch!r}")
        return Side(tuple(captures), not unordered, start)


def _check_unique(side: Side, expression: str) -> None:
    # Group names ("C" in "(C: C H W)") live apart from the identifiers they group.
    seen: set[str] = set()
    for capture in side.captures:
        if capture is Ellipsis:
            continue
        for name in capture.axes:
            if name in seen:
                raise AxisExpressionError(
                    f"axis {name!r} occurs more than once on one side", expression, capture.position
                )
            seen.add(name)


def parse_rearrangement(expression: str) -> tuple[Side, Side]:
    """Parse ``"lhs -> rhs"`` for :func:`rearrange`.

    Raises:
        AxisExpressionError: if the expression is malformed.
    """
    parser = _Parser(expression, operand_commas=False)
    lhs = parser.side(stop_at_comma=False)
    if not parser.at_arrow():
        raise parser.error("expected '->' separating the input and output axes")
    parser.i += 2
    rhs = parser.side(stop_at_comma=False)
    if not rhs.is_ordered:
        raise AxisExpressionError("the right-hand side must be ordered (no '{...}')", expression, rhs.position)
    if parser.i < len(expression):
        raise parser.error("unexpected text after the right-hand side")
    _check_unique(lhs, expression)
    _check_unique(rhs, expression)
    return lhs, rhs


def parse_einsum(expression: str) -> tuple[list[Side], Side | None, Side]:
    """Parse an einsum equation ``"a b, b c -> a c"``, ``"{b} -> a c"`` or ``"-> a c"``.

    Returns:
        ``(lhses, None, rhs)`` for the ordered form (one side per operand), ``([], unordered_lhs, rhs)``
        for the unordered form and ``([], None, rhs)`` for the output-only form.

    Raises:
        AxisExpressionError: if the expression is malformed.
    """
    parser = _Parser(expression, operand_commas=True)
    parser.skip_space(commas=False)
    lhses: list[Side] = []
    unordered: Side | None = None
    if not parser.at_arrow():
        while True:
            side = parser.side(stop_at_comma=True)
            if not side.is_ordered:
                if lhses or unordered is not None:
                    raise AxisExpressionError(
                        "an unordered '{...}' left-hand side must be the only one", expression, side.position
                    )
                unordered = side
            else:
                if unordered is not None:
                    raise AxisExpressionError(
                        "an unordered '{...}' left-hand side must be the only one", expression, side.position
                    )
                lhses.append(side)
            if parser.i < len(expression) and expression[parser.i] == ",":
                parser.i += 1
                continue
            break
    if not parser.at_arrow():
        raise parser.error("expected '->' before the output axes")
    parser.i += 2
    rhs = parser.side(stop_at_comma=False)
    if not rhs.is_ordered:
        raise AxisExpressionError("the output side must be ordered (no '{...}')", expression, rhs.position)
    if parser.i < len(expression):
        raise parser.error("unexpected text after the output axes")
    for side in [*lhses, rhs] + ([unordered] if unordered is not None else []):
        for capture in side.captures:
            if capture is not Ellipsis and capture.is_group:
                raise AxisExpressionError(
                    "parenthesized groups are not supported in einsum", expression, capture.position
                )
        _check_unique(side, expression)
    return lhses, unordered, rhs
