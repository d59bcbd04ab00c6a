"""Creation functions, against NumPy."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from named_strategies import axes_st, random_named, to_numpy

import ponente.namedtensor as hax
from ponente.namedtensor import Axis

A, B, C = Axis("a", 2), Axis("b", 3), Axis("c", 4)


@given(axes_st())
def test_filled(axes):
    shape = tuple(a.size for a in axes)
    assert hax.zeros(axes).axes == axes
    np.testing.assert_array_equal(hax.zeros(axes).array, np.zeros(shape))
    np.testing.assert_array_equal(hax.ones(axes, dtype=jnp.int32).array, np.ones(shape, np.int32))
    np.testing.assert_array_equal(hax.full(axes, 2.5).array, np.full(shape, 2.5))
    d = {a.name: a.size for a in axes}
    assert hax.zeros(d).axes == axes
    x = random_named(axes, 0)
    assert hax.zeros_like(x).axes == axes
    assert hax.ones_like(x).dtype == x.dtype
    np.testing.assert_array_equal(hax.full_like(x, 7, dtype=jnp.int32).array, np.full(shape, 7))


def test_ranges():
    np.testing.assert_array_equal(hax.arange(C).array, np.arange(4))
    np.testing.assert_array_equal(hax.arange(C, start=1, step=2).array, np.arange(1, 9, 2))
    grid = hax.arange((A, B))
    assert grid.axes == (A, B)
    np.testing.assert_array_equal(grid.array, np.arange(6).reshape(2, 3))
    traced = jax.jit(lambda s: hax.arange(C, start=s).array)(jnp.int32(5))
    np.testing.assert_array_equal(traced, np.arange(5, 9))
    np.testing.assert_allclose(hax.linspace(C, start=0, stop=1).array, np.linspace(0, 1, 4), rtol=1e-6)
    np.testing.assert_allclose(hax.linspace(C, start=0, stop=1, endpoint=False).array, np.linspace(0, 1, 4, False))
    np.testing.assert_allclose(hax.logspace(C, start=0, stop=3).array, np.logspace(0, 3, 4), rtol=1e-5)
    np.testing.assert_allclose(hax.geomspace(C, start=1, stop=8).array, np.geomspace(1, 8, 4), rtol=1e-5)
    with pytest.raises(TypeError, match="size"):
        hax.linspace("c", start=0, stop=1)
    with pytest.raises(TypeError, match="'c'"):
        hax.zeros(("c",))


@given(axes=axes_st(min_axes=1), data=st.data())
def test_stack_and_concatenate(axes, data):
    xs = [random_named(tuple(data.draw(st.permutations(axes))), i) for i in range(3)]
    names = [a.name for a in axes]
    s = hax.stack("s", xs)
    assert s.axes == (Axis("s", 3), *xs[0].axes)
    ref = np.stack([to_numpy(x, [a.name for a in xs[0].axes]) for x in xs])
    np.testing.assert_array_equal(s.array, ref)
    ax = data.draw(st.sampled_from(axes))
    c = hax.concatenate(ax.name, xs)
    assert c.axes == tuple(a if a.name != ax.name else ax.resize(3 * ax.size) for a in xs[0].axes)
    ref = np.concatenate([to_numpy(x, names) for x in xs], axis=names.index(ax.name))
    np.testing.assert_array_equal(to_numpy(c, names), ref)


def test_stack_concatenate_errors():
    with pytest.raises(ValueError, match="array 1"):
        hax.stack("s", [hax.zeros((A,)), hax.zeros((B,))])
    with pytest.raises(ValueError, match="no axis 'c'"):
        hax.concatenate("c", [hax.zeros((A,)), hax.zeros((C,))])
    with pytest.raises(ValueError, match="must have size 1"):
        hax.stack(Axis("s", 3), [hax.zeros((A,))])


def test_repeat_tile():
    x = random_named((A, B), 0)
    xa = np.asarray(x.array)
    r = hax.repeat(x, 2, "b")
    assert r.axes == (A, Axis("b", 6))
    np.testing.assert_array_equal(r.array, np.repeat(xa, 2, axis=1))
    t = hax.tile(x, {"a": 2, "n": 3})
    assert t.axes == (Axis("n", 3), Axis("a", 4), B)
    np.testing.assert_array_equal(t.array, np.tile(xa, (3, 2, 1)))
