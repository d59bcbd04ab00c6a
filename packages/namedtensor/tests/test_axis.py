"""Axis and the axis-spec helpers, checked against plain-Python reference implementations."""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from named_strategies import axes_st

import ponente.namedtensor as hax
from ponente.namedtensor import Axis
from ponente.namedtensor.axis import rearrange_for_partial_order


def test_axis_is_frozen_value_with_alias_and_resize():
    ax = Axis("embed", 8)
    assert ax == Axis("embed", 8)
    assert hash(ax) == hash(Axis("embed", 8))
    assert ax.alias("out") == Axis("out", 8)
    assert ax.resize(3) == Axis("embed", 3)
    with pytest.raises(AttributeError):
        ax.size = 3  # type: ignore[misc]


def test_make_axes_and_names_sizes():
    Batch, Embed = hax.make_axes(batch=4, embed=8)
    assert Batch == Axis("batch", 4)
    assert Embed == Axis("embed", 8)
    assert hax.axis_name(Batch) == "batch"
    assert hax.axis_name("x") == "x"
    assert hax.axis_name((Batch, "y")) == ("batch", "y")
    assert hax.axis_name({"p": 1, "q": 2}) == ("p", "q")
    assert hax.axis_size((Batch, Embed)) == 32
    assert hax.axis_size({"a": 3, "b": 5}) == 15
    assert hax.axis_size(()) == 1
    with pytest.raises(TypeError, match="'x'"):
        hax.axis_size(("x",))


@given(axes_st(), axes_st())
def test_concat_axes_matches_reference(a1, a2):
    names1 = {a.name for a in a1}
    if any(a.name in names1 for a in a2):
        with pytest.raises(ValueError, match="appear in both"):
            hax.concat_axes(a1, a2)
    else:
        assert hax.concat_axes(a1, a2) == a1 + a2
        d = hax.concat_axes({a.name: a.size for a in a1}, a2)
        assert d == {a.name: a.size for a in a1 + a2}


@given(axes_st(), axes_st())
def test_union_intersect_without(a1, a2):
    sizes1 = {a.name: a.size for a in a1}
    conflict = any(a.name in sizes1 and sizes1[a.name] != a.size for a in a2)
    if conflict:
        with pytest.raises(ValueError):
            hax.union_axes(a1, a2)
        with pytest.raises(ValueError):
            hax.intersect_axes(a1, a2)
        with pytest.raises(ValueError):
            hax.without_axes(a1, a2)
        assert hax.without_axes(a1, a2, allow_mismatched_sizes=True) == tuple(
            a for a in a1 if a.name not in {b.name for b in a2}
        )
        return
    expected_union = a1 + tuple(a for a in a2 if a.name not in sizes1)
    assert hax.union_axes(a1, a2) == expected_union
    names2 = {a.name for a in a2}
    assert hax.intersect_axes(a1, a2) == tuple(a for a in a1 if a.name in names2)
    assert hax.without_axes(a1, a2) == tuple(a for a in a1 if a.name not in names2)


@given(axes_st(min_axes=1), st.data())
def test_eliminate_and_replace(axes, data):
    victim = data.draw(st.sampled_from(axes))
    assert hax.eliminate_axes(axes, victim.name) == tuple(a for a in axes if a != victim)
    with pytest.raises(ValueError, match="'zz'"):
        hax.eliminate_axes(axes, "zz")
    new = (Axis("x1", 2), Axis("x2", 3))
    i = axes.index(victim)
    assert hax.replace_axis(axes, victim, new) == axes[:i] + new + axes[i + 1 :]
    with pytest.raises(ValueError, match="'zz'"):
        hax.replace_axis(axes, "zz", new)


@given(axes_st(min_axes=1), st.data())
def test_resolve_and_selects(axes, data):
    sub = data.draw(st.lists(st.sampled_from(axes), unique=True, min_size=1))
    names = tuple(a.name for a in sub)
    assert hax.resolve_axis(axes, names) == tuple(sub)
    assert hax.resolve_axis(axes, names[0]) == sub[0]
    assert hax.resolve_axis(axes, dict.fromkeys(names)) == {a.name: a.size for a in sub}
    assert hax.selects_axis(axes, names)
    assert hax.selects_axis(axes, tuple(sub))
    assert not hax.selects_axis(axes, "zz")
    assert not hax.selects_axis(axes, sub[0].resize(sub[0].size + 1))
    with pytest.raises(ValueError, match="not found"):
        hax.resolve_axis(axes, "zz")
    with pytest.raises(ValueError, match="size"):
        hax.resolve_axis(axes, sub[0].resize(sub[0].size + 1))
    assert hax.axis_size(tuple(sub)) == math.prod(a.size for a in sub)


def test_dslice_dblock():
    assert hax.dslice(2, 3).to_slice() == slice(2, 5)
    assert hax.ds is hax.dslice
    assert hax.dblock(3, 4).to_slice() == slice(12, 16)
    assert hax.dslice.block(1, 5).to_slice() == slice(5, 10)
    with pytest.raises(TypeError):
        jax.jit(lambda i: hax.dslice(i, 2).to_slice())(jnp.int32(1))


@given(st.data())
def test_rearrange_for_partial_order_respects_the_order(data):
    names = data.draw(st.permutations(["a", "b", "c", "d", "e"]))[: data.draw(st.integers(0, 5))]
    listed = data.draw(st.permutations(names))[: data.draw(st.integers(0, len(names)))]
    order: list = list(listed)
    for _ in range(data.draw(st.integers(0 if len(listed) == len(names) else 1, 3))):
        order.insert(data.draw(st.integers(0, len(order))), ...)
    out = rearrange_for_partial_order(tuple(order), tuple(names))
    assert sorted(out) == sorted(names)
    assert [n for n in out if n in listed] == list(listed)
    assert [n for n in out if n not in listed] == [n for n in names if n not in listed]
    if order.count(...) == 1:
        at = order.index(...)
        assert list(out) == order[:at] + [n for n in names if n not in listed] + order[at + 1 :]


def test_rearrange_for_partial_order_places_unlisted_axes_after_their_predecessor():
    # 'b' follows 'a' in the input, so it goes to the first '...' after 'a'; 'x' precedes both
    assert rearrange_for_partial_order((..., "a", ..., "c", ...), ("x", "a", "b", "c", "d")) == (
        "x",
        "a",
        "b",
        "c",
        "d",
    )
    A, B = Axis("a", 2), Axis("b", 3)
    assert rearrange_for_partial_order(("b", ...), (A, B)) == (B, A)
    assert rearrange_for_partial_order((B, A), (A, B)) == (B, A)


def test_rearrange_for_partial_order_errors():
    with pytest.raises(ValueError, match="listed more than once"):
        rearrange_for_partial_order(("a", "a", ...), ("a", "b"))
    with pytest.raises(ValueError, match="'z' of the partial order"):
        rearrange_for_partial_order(("z", ...), ("a", "b"))
    with pytest.raises(ValueError, match="appears more than once"):
        rearrange_for_partial_order(("a", ...), ("a", "a"))
    with pytest.raises(ValueError, match=r"\('b',\) are not in the partial order"):
        rearrange_for_partial_order(("a",), ("a", "b"))
    with pytest.raises(ValueError, match="size"):
        rearrange_for_partial_order((Axis("a", 3), ...), (Axis("a", 2),))
