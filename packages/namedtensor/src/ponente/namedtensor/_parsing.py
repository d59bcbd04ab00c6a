"""Parser for the einops-like axis expressions used by ``rearrange`` and ``einsum``.

Grammar (whitespace separates items; inside ``{...}``, and on any side of a rearrangement, commas do too)::

    expression := side "->" side                  (rearrange)
                | side ("," side)* "->" side      (einsum; top-level commas separate operands)
    side       := "{" item* "}" | item*
    item       := identifier | "..." | "(" [identifier ":"] identifier+ ")"
    identifier := [A-Za-z_][A-Za-z0-9_]* | "'" text "'" | '"' text '"'   (backslash escapes inside quotes)

The parser checks the grammar only; what an expression means (how many ``...``, whether a side may be
unordered, which identifiers must be bound) is checked by ``rearrange`` and ``einsum``. Errors raise
:class:`AxisExpressionError`, whose message repeats the expression with a caret under the offending character.
"""

from __future__ import annotations

import dataclasses
from types import EllipsisType

__all__ = ["AxisExpressionError", "Capture", "Side", "parse_einsum", "parse_rearrangement"]


class AxisExpressionError(ValueError):
    """A malformed ``rearrange``/``einsum`` expression, or one that does not fit its arrays.

    The message names the problem and points at the offending character of the expression.

    Attributes:
        expression: the expression.
        position: index of the offending character, or ``None`` if the problem has no single place.
    """

    def __init__(self, message: str, expression: str, position: int | None = None):
        self.expression = expression
        self.position = position
        if position is None:
            text = f"In {expression!r}: {message}"
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
    """One side of an expression: its items in order and whether it was ``{unordered}``.

    Attributes:
        captures: the items; ``...`` appears as ``Ellipsis``.
        is_ordered: False for a side written in braces.
        position: index of the side's first character in the expression.
        ellipsis_positions: index in the expression of each ``...``, in order.
    """

    captures: tuple[Capture | EllipsisType, ...]
    is_ordered: bool
    position: int
    ellipsis_positions: tuple[int, ...] = ()

    @property
    def has_ellipsis(self) -> bool:
        """Whether ``...`` occurs on this side."""
        return bool(self.ellipsis_positions)


def _is_ident_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


class _Parser:
    def __init__(self, expression: str):
        self.s = expression
        self.i = 0

    def error(self, message: str, position: int | None = None) -> AxisExpressionError:
        return AxisExpressionError(message, self.s, self.i if position is None else position)

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def skip_space(self, commas: bool) -> None:
        while self.i < len(self.s) and (self.s[self.i].isspace() or (commas and self.s[self.i] == ",")):
            self.i += 1

    def at_arrow(self) -> bool:
        return self.s.startswith("->", self.i)

    def ident(self) -> str:
        start = self.i
        if self.peek() in ("'", '"'):
            return self.quoted()
        while self.i < len(self.s) and _is_ident_char(self.s[self.i]):
            self.i += 1
        name = self.s[start : self.i]
        if not name:
            ch = self.peek()
            found = f"unexpected character {ch!r}" if ch else "end of expression"
            raise self.error(f"Identifier expected: {found}")
        if name[0].isdigit():
            raise self.error(f"Identifiers cannot start with a number: {name!r}", start)
        return name

    def quoted(self) -> str:
        start = self.i
        quote = self.s[self.i]
        self.i += 1
        chars: list[str] = []
        while True:
            if self.i >= len(self.s):
                raise self.error(f"Unexpected end of string: unclosed quote {quote}", start)
            ch = self.s[self.i]
            if ch == quote:
                self.i += 1
                break
            if ch == "\\":
                self.i += 1
                if self.i >= len(self.s):
                    raise self.error("Unexpected end of string after '\\'")
                ch = self.s[self.i]
            chars.append(ch)
            self.i += 1
        if not chars:
            raise self.error("Empty strings are not valid identifiers", start)
        return "".join(chars)

    def group(self) -> Capture:
        start = self.i
        self.i += 1  # "("
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
                if binding is not None:
                    raise self.error("Only one binding allowed per group, as in '(name: a b)'")
                if len(names) != 1:
                    raise self.error("':' must follow exactly one group name, as in '(name: a b)'")
                binding = names.pop()
                self.i += 1
                continue
            if ch == "(":
                raise self.error("Only one level of nesting is allowed: unexpected '(' inside a group")
            if ch in "{}":
                raise self.error(f"Unexpected {ch} inside a group")
            if self.s.startswith("...", self.i):
                raise self.error("'...' is not allowed inside a group")
            if self.at_arrow():
                raise self.error("unclosed '(' before '->'", start)
            if not (_is_ident_char(ch) or ch in ("'", '"')):
                raise self.error(f"Unexpected character {ch!r} inside a group")
            names.append(self.ident())
        if not names:
            raise self.error("No axes found in the group; a group needs at least one axis", start)
        return Capture(binding, tuple(names), True, start)

    def side(self, stop_at_comma: bool) -> Side:
        """Parses one side; stops at '->', at the end, or (if ``stop_at_comma``) at a top-level ','."""
        self.skip_space(commas=False)
        start = self.i
        unordered = self.peek() == "{"
        if unordered:
            self.i += 1
        captures: list[Capture | EllipsisType] = []
        ellipses: list[int] = []
        while True:
            self.skip_space(commas=unordered or not stop_at_comma)
            ch = self.peek()
            if not ch:
                if unordered:
                    raise self.error("Expected }: unclosed '{'", start)
                break
            if unordered and ch == "}":
                self.i += 1
                self.skip_space(commas=False)
                if self.peek() and not self.at_arrow() and not (stop_at_comma and self.peek() == ","):
                    raise self.error(f"Unexpected character after }}: {self.peek()!r}")
                break
            if self.at_arrow() or (stop_at_comma and ch == ","):
                if unordered:
                    raise self.error("Expected }: unclosed '{'", start)
                break
            if ch == "{":
                raise self.error("Unexpected {: '{' may only open a side")
            if ch == "}":
                raise self.error("Unexpected } (no '{' to close)")
            if ch == ")":
                raise self.error("Unexpected ): unmatched ')'")
            if ch == "(":
                captures.append(self.group())
            elif self.s.startswith("...", self.i):
                captures.append(Ellipsis)
                ellipses.append(self.i)
                self.i += 3
            else:
                pos = self.i
                name = self.ident()
                captures.append(Capture(name, (name,), False, pos))
        return Side(tuple(captures), not unordered, start, tuple(ellipses))

    def arrow(self) -> None:
        if not self.peek():
            raise self.error("Unexpected end of string: expected '->'")
        if not self.at_arrow():
            raise self.error(f"Expected '->', found unexpected character {self.peek()!r}")
        self.i += 2

    def finish(self) -> None:
        if self.i < len(self.s):
            raise self.error(f"Unexpected character {self.peek()!r} after the right-hand side")


def parse_rearrangement(expression: str) -> tuple[Side, Side]:
    """Parses ``"lhs -> rhs"`` for ``rearrange``.

    Args:
        expression: the expression, e.g. ``"b (h: heads d) -> b heads d"``.

    Returns:
        The left and right sides.

    Raises:
        AxisExpressionError: if the expression is malformed.

    Example:
        >>> lhs, rhs = parse_rearrangement("{(c: a b) d} -> ... d a")
        >>> lhs.is_ordered, lhs.captures[0].binding, lhs.captures[0].axes, rhs.has_ellipsis
        (False, 'c', ('a', 'b'), True)
    """
    parser = _Parser(expression)
    lhs = parser.side(stop_at_comma=False)
    parser.arrow()
    rhs = parser.side(stop_at_comma=False)
    parser.finish()
    return lhs, rhs


def parse_einsum(expression: str) -> tuple[list[Side], Side]:
    """Parses an einsum equation: ``"a b, b c -> a c"``, ``"{b} -> a c"`` or ``"-> a c"``.

    Args:
        expression: the equation.

    Returns:
        ``(lhses, rhs)``: one side per operand group (for the output-only form ``"-> a c"``, a single
        empty ordered side; for the unordered form, a single unordered side) and the output side.

    Raises:
        AxisExpressionError: if the equation is malformed.

    Example:
        >>> lhses, rhs = parse_einsum("h w d, d -> h w")
        >>> [len(side.captures) for side in lhses], [c.binding for c in rhs.captures]
        ([3, 1], ['h', 'w'])
    """
    parser = _Parser(expression)
    lhses: list[Side] = []
    while True:
        lhses.append(parser.side(stop_at_comma=True))
        if parser.peek() == ",":
            parser.i += 1
            continue
        parser.arrow()
        break
    rhs = parser.side(stop_at_comma=False)
    parser.finish()
    return lhses, rhs
