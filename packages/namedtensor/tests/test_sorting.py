"""sort / argsort / top_k / searchsorted along named axes, against NumPy."""

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from named_strategies import axes_st, random_named, to_numpy

import ponente.namedtensor as hax
from ponente.namedtensor import Axis


@given(axes=axes_st(min_axes=1, max_axes=3), data=st.data())
def test_sort_argsort_topk(axes, data):
    x = random_named(axes, data.draw(st.integers(0, 1000)))
    ax = data.draw(st.sampled_from(axes))
    names = [a.name for a in axes]
    pos = axes.index(ax)
    xa = to_numpy(x, names)
    s = hax.sort(x, ax.name)
    assert s.axes == axes
    np.testing.assert_array_equal(to_numpy(s, names), np.sort(xa, axis=pos))
    np.testing.assert_array_equal(to_numpy(hax.argsort(x, ax.name), names), np.argsort(xa, axis=pos, stable=True))
    k = data.draw(st.integers(1, ax.size))
    v, i = hax.top_k(x, ax.name, k, new_axis="top")
    expected_axes = tuple(a if a != ax else Axis("top", k) for a in axes)
    assert v.axes == expected_axes
    assert i.axes == expected_axes
    ref = -np.sort(-xa, axis=pos)
    np.testing.assert_array_equal(np.asarray(v.array), np.take(ref, range(k), axis=pos))
    np.testing.assert_array_equal(np.take_along_axis(xa, np.asarray(i.array), pos), np.asarray(v.array))


def test_top_k_errors_and_searchsorted():
    x = hax.named(jnp.array([1, 5, 3]), "a")
    with pytest.raises(ValueError, match="exceeds"):
        hax.top_k(x, "a", 4)
    a = hax.named(jnp.array([1, 3, 5, 7]), "a")
    v = hax.named(jnp.array([[0, 3], [6, 9]]), ("p", "q"))
    out = hax.searchsorted(a, v, side="right")
    assert out.axes == v.axes
    np.testing.assert_array_equal(out.array, np.searchsorted([1, 3, 5, 7], [[0, 3], [6, 9]], side="right"))
    with pytest.raises(ValueError, match="one-axis"):
        hax.searchsorted(v, 1)


def test_flattened_argsort_and_specialized_fns_top_k():
    from ponente.namedtensor import specialized_fns

    x = hax.named(jnp.array([[3, 1], [0, 2]]), ("a", "b"))
    np.testing.assert_array_equal(hax.argsort(x, None), np.argsort(np.asarray(x.array), axis=None, stable=True))
    np.testing.assert_array_equal(hax.cumsum(x, None), np.cumsum(np.asarray(x.array)))
    values, indices = specialized_fns.top_k(x, "a", 1)
    np.testing.assert_array_equal(values.array, [[3, 2]])
    np.testing.assert_array_equal(indices.array, [[0, 1]])
