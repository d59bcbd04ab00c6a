"""NamedArray[...] annotations: spec parsing and matching against a brute-force reference."""

import itertools
import re
import typing

import jax.numpy as jnp
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray
from ponente.namedtensor.annotation import NamedArrayAxes

NAMES = ("a", "b", "c")


def _reference(spec_text: str, names: tuple[str, ...]) -> bool:
    """Ordered specs as a regular expression over the space-joined names ("..." = any run of names)."""
    tokens = spec_text.split()
    pattern = r"\s*".join(r"(?:\S+(?:\s+\S+)*)?" if t == "..." else re.escape(t) for t in tokens)
    return re.fullmatch(pattern, " ".join(names)) is not None


def _all_name_tuples():
    for n in range(4):
        yield from itertools.permutations(NAMES, n)


@pytest.mark.parametrize("spec", ["a b", "a ...", "... b", "a ... c", "...", "", "b a c"])
def test_ordered_specs_match_like_a_regex(spec):
    parsed = NamedArrayAxes.parse(spec)
    for names in _all_name_tuples():
        assert parsed.matches(names) == _reference(spec, names), (spec, names)


def test_set_specs_match_like_sets():
    exact = NamedArrayAxes.parse({"a", "b"})
    at_least = NamedArrayAxes.parse({"a", "b", ...})
    assert not exact.ordered
    assert not exact.subset
    assert at_least.subset
    for names in _all_name_tuples():
        assert exact.matches(names) == (set(names) == {"a", "b"})
        assert at_least.matches(names) == ({"a", "b"} <= set(names))


def test_forms_are_equivalent_and_annotations_carry_the_spec():
    by_str = typing.get_args(NamedArray["a b"])
    assert by_str[0] is NamedArray
    assert by_str[1] == typing.get_args(NamedArray["a", "b"])[1] == NamedArrayAxes(("a", "b"))
    assert NamedArray["a b"] is NamedArray[("a", "b")]
    spec = typing.get_args(NamedArray["a ... c"])[1]
    assert (spec.before, spec.after, spec.subset) == (("a",), ("c",), True)

    def f(x: NamedArray["a ..."]) -> None:  # noqa: F722
        del x

    hints = typing.get_type_hints(f, include_extras=True)
    assert typing.get_args(hints["x"])[1] == NamedArrayAxes(("a",), (), subset=True)
    assert typing.get_type_hints(f)["x"] is NamedArray


def test_runtime_checks():
    x = hax.zeros({"a": 2, "b": 3}, dtype=jnp.float32)
    assert isinstance(x, NamedArray["a ..."])
    assert not isinstance(x, NamedArray["b ..."])
    assert not isinstance(jnp.zeros((2, 3)), NamedArray["a b"])
    assert x.matches_axes("a b")
    assert x.matches_axes({"b", "a"})
    assert x.matches_axes(NamedArray[{"a", ...}])
    assert not x.matches_axes(NamedArray[{"a", "z", ...}])
    assert x.matches_axes(NamedArrayAxes(("a", "b"), dtype=jnp.float32))
    assert not x.matches_axes(NamedArrayAxes(("a", "b"), dtype=jnp.int32))


@pytest.mark.parametrize("bad", ["a ... b ...", ("a", 1), {"a", 2}, 3])
def test_bad_specs_raise(bad):
    with pytest.raises(TypeError):
        NamedArray[bad]
