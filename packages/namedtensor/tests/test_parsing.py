"""The expression parser behind ``rearrange`` and ``einsum``: result structure, quoting and error positions."""

import re

import pytest

from ponente.namedtensor._parsing import Capture, parse_einsum, parse_rearrangement


def _items(side):
    return [... if c is Ellipsis else (c.binding, c.axes) if c.is_group else c.binding for c in side.captures]


def test_rearrangement_structure():
    lhs, rhs = parse_rearrangement("{x (g: p q) ...} -> (m: p x) ... q ...")
    assert not lhs.is_ordered
    assert rhs.is_ordered
    assert _items(lhs) == ["x", ("g", ("p", "q")), ...]
    assert _items(rhs) == [("m", ("p", "x")), ..., "q", ...]
    assert rhs.ellipsis_positions == (29, 35)
    assert lhs.captures[1] == Capture("g", ("p", "q"), True, 3)
    # commas separate items in a rearrangement; an anonymous group has no binding
    lhs, _ = parse_rearrangement("a, (b c), d -> a b c d")
    assert _items(lhs) == ["a", (None, ("b", "c")), "d"]


def test_quoted_identifiers():
    lhs, rhs = parse_rearrangement("""'axis one' "two\\"q" -> (n: 'axis one' x_1)""")
    assert _items(lhs) == ["axis one", 'two"q']
    assert _items(rhs) == [("n", ("axis one", "x_1"))]


def test_einsum_structure():
    lhses, rhs = parse_einsum("a b, {c, d} ->  b")
    assert [s.is_ordered for s in lhses] == [True, False]
    assert [_items(s) for s in lhses] == [["a", "b"], ["c", "d"]]
    assert _items(rhs) == ["b"]
    lhses, rhs = parse_einsum(" -> x ...")
    assert len(lhses) == 1
    assert lhses[0].is_ordered
    assert lhses[0].captures == ()
    assert _items(rhs) == ["x", ...]


@pytest.mark.parametrize(
    ("expression", "message", "position"),
    [
        ("a b", "Unexpected end of string", 3),
        ("{a b -> a", "Expected }", 0),
        ("a } -> a", "Unexpected }", 2),
        ("(a: b } -> a", "Unexpected }", 6),
        ("(a b ? -> a", "Unexpected character '?'", 5),
        ("a ? -> a", "Identifier expected", 2),
        ("a 1b -> a", "cannot start with a number", 2),
        ("a '' -> a", "Empty strings", 2),
        ("a 'b -> a", "unclosed quote", 2),
        ("() -> a", "No axes found", 0),
        ("((a)) -> a", "Only one level of nesting", 1),
        ("{a} b -> a", "Unexpected character after }", 4),
        ("a -> b -> c", "Unexpected character '-'", 7),
    ],
)
def test_errors_point_at_the_character(expression, message, position):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        parse_rearrangement(expression)
    lines = str(info.value).splitlines()
    assert lines[-2].strip() == expression
    assert lines[-1].index("^") - lines[-2].index(expression[0]) == position
