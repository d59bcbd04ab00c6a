"""where / clip / isclose / allclose / array_equal / tril / triu / trace / pad, against NumPy."""

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from named_strategies import axes_st, random_named, to_numpy

import ponente.namedtensor as hax
from ponente.namedtensor import Axis

A, B, C = Axis("a", 2), Axis("b", 3), Axis("c", 4)


@given(axes=axes_st(min_axes=1, max_axes=3), data=st.data())
def test_where_broadcasts_by_name(axes, data):
    x = random_named(axes, data.draw(st.integers(0, 100)))
    sub = tuple(data.draw(st.permutations(data.draw(st.lists(st.sampled_from(axes), unique=True)))))
    y = random_named(sub, data.draw(st.integers(0, 100)))
    cond = x > 0
    out = hax.where(cond, y, x)
    assert out.axes == axes
    names = [a.name for a in axes]
    ynames = [n for n in names if n in {a.name for a in sub}]
    yref = to_numpy(y, ynames).reshape([a.size if a in sub else 1 for a in axes])
    xa = to_numpy(x, names)
    np.testing.assert_array_equal(to_numpy(out, names), np.where(xa > 0, yref, xa))
    np.testing.assert_array_equal(to_numpy(hax.where(cond, 1.0, 0.0), names), (xa > 0).astype(np.float32))


def test_where_error_names_axes():
    with pytest.raises(ValueError, match="subset"):
        hax.where(hax.zeros((A,)) > 0, hax.zeros((B,)), 0.0)


def test_clip_isclose_allclose_array_equal():
    x = random_named((A, B), 0)
    xa = np.asarray(x.array)
    lo = hax.named(jnp.array([-1.0, 0.0, 1.0]), "b")
    np.testing.assert_array_equal(hax.clip(x, lo, 2.0).array, np.clip(xa, [-1.0, 0.0, 1.0], 2.0))
    np.testing.assert_array_equal(x.clip(None, 0.0).array, np.minimum(xa, 0.0))
    y = x.rearrange((B, A)) + 1e-7
    assert hax.isclose(x, y).axes == (A, B)
    assert bool(hax.allclose(x, y))
    assert not bool(hax.allclose(x, y + 1.0))
    assert bool(hax.array_equal(x, x.rearrange((B, A))))
    assert not bool(hax.array_equal(x, x + 1))
    assert hax.array_equal(x, hax.zeros((A,))) is False


@given(axes=axes_st(min_axes=2, max_axes=3), data=st.data(), k=st.integers(-2, 2))
def test_tril_triu_trace(axes, data, k):
    x = random_named(axes, data.draw(st.integers(0, 100)))
    r, c = data.draw(st.permutations(axes))[:2]
    names = [a.name for a in axes]
    others = [n for n in names if n not in (r.name, c.name)]
    order = [*others, r.name, c.name]
    xa = to_numpy(x, order)
    # the result's layout is the other axes, then the row axis, then the column axis (as in Haliax)
    lower = hax.tril(x, r, c, k)
    assert lower.axis_names == tuple(order)
    np.testing.assert_array_equal(lower.array, np.tril(xa, k))
    np.testing.assert_array_equal(to_numpy(hax.tril(x, r, c, k), order), np.tril(xa, k))
    np.testing.assert_array_equal(to_numpy(hax.triu(x, r.name, c.name, k), order), np.triu(xa, k))
    t = hax.trace(x, r, c, offset=k)
    assert t.axes == tuple(a for a in axes if a not in (r, c))
    np.testing.assert_allclose(to_numpy(t, others), np.trace(xa, offset=k, axis1=-2, axis2=-1), rtol=1e-5, atol=1e-6)


def test_pad():
    x = random_named((A, B), 0)
    p = hax.pad(x, {"b": (1, 2), "a": 1}, constant_values=9.0)
    assert p.axes == (Axis("a", 4), Axis("b", 6))
    np.testing.assert_array_equal(p.array, np.pad(np.asarray(x.array), ((1, 1), (1, 2)), constant_values=9.0))
    e = hax.pad(x, {"b": (0, 2)}, mode="edge")
    np.testing.assert_array_equal(e.array, np.pad(np.asarray(x.array), ((0, 0), (0, 2)), mode="edge"))


def test_array_equiv_broadcasts_by_name():
    x = hax.ones((A, B))
    assert hax.array_equiv(x, hax.ones(()))
    assert hax.array_equiv(x, hax.ones((B,)))
    assert hax.array_equiv(x.rearrange((B, A)), x)
    assert not hax.array_equiv(x, hax.ones((C,)))
    assert not hax.array_equiv(x, hax.ones((Axis("b", 2),)))
    y = x.at["a", 1].set(2.0)
    assert not hax.array_equiv(y, hax.ones((B,)))
    assert hax.array_equiv(y["a", 1], hax.full((B,), 2.0))


def test_packbits_unpackbits_match_numpy():
    bits = random_named((A, Axis("b", 11)), 3, np.uint8, 0, 2)
    packed = hax.packbits(bits, "b")
    assert packed.axes == (A, Axis("b", 2))
    np.testing.assert_array_equal(packed.array, np.packbits(np.asarray(bits.array), axis=1))
    little = hax.packbits(bits, "b", bitorder="little")
    np.testing.assert_array_equal(little.array, np.packbits(np.asarray(bits.array), axis=1, bitorder="little"))
    back = hax.unpackbits(packed, "b", count=11)
    assert back.axes == bits.axes
    np.testing.assert_array_equal(back.array, bits.array)
    assert hax.unpackbits(packed, "b").axes == (A, Axis("b", 16))


def test_pad_left():
    x = random_named((A, B), 1)
    out = hax.pad_left(x, B, Axis("b", 5), value=-1.0)
    assert out.axes == (A, Axis("b", 5))
    np.testing.assert_array_equal(out.array, np.pad(np.asarray(x.array), ((0, 0), (2, 0)), constant_values=-1.0))
    with pytest.raises(ValueError, match="smaller"):
        hax.pad_left(x, B, Axis("b", 2))
