"""Brace expansion against bash's documented behaviour and a naive cartesian-product reference."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ponente.datacache._braces import expand_braces


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("plain.txt", ["plain.txt"]),
        ("a{b,c}d", ["abd", "acd"]),
        ("x{1..3}", ["x1", "x2", "x3"]),
        ("x{3..1}", ["x3", "x2", "x1"]),
        ("x{01..03}", ["x01", "x02", "x03"]),
        ("x{8..10}", ["x8", "x9", "x10"]),
        ("x{1..7..3}", ["x1", "x4", "x7"]),
        ("{a,b{1,2}}", ["a", "b1", "b2"]),
        ("{a,}z", ["az", "z"]),
        ("keep{x}", ["keep{x}"]),
        ("train.{1..3}-of-3.jsonl.gz", [f"train.{i}-of-3.jsonl.gz" for i in (1, 2, 3)]),
    ],
)
def test_known_expansions(pattern: str, expected: list[str]) -> None:
    assert expand_braces(pattern) == expected


def test_unbalanced_braces_are_an_error() -> None:
    with pytest.raises(ValueError, match="unbalanced"):
        expand_braces("a{b,c")


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.text(alphabet="abcxyz01", min_size=1, max_size=3), min_size=2, max_size=3),
        min_size=1,
        max_size=3,
    ),
    st.lists(st.text(alphabet="pq./_", max_size=3), min_size=4, max_size=4),
)
def test_matches_cartesian_product(groups: list[list[str]], literals: list[str]) -> None:
    pattern = literals[0] + "".join("{" + ",".join(g) + "}" + lit for g, lit in zip(groups, literals[1:]))
    expected = [
        literals[0] + "".join(choice + lit for choice, lit in zip(combo, literals[1:]))
        for combo in itertools.product(*groups)
    ]
    assert expand_braces(pattern) == expected
