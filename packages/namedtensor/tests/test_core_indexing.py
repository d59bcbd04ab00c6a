"""Indexing by name (core.index / __getitem__ / .at / slice / updated_slice / take), compared with NumPy."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from named_strategies import axes_st, random_named

import ponente.namedtensor as hax
from ponente.namedtensor import Axis

A, B, C = Axis("a", 2), Axis("b", 3), Axis("c", 4)


@given(axes_st(min_axes=1, max_axes=3), st.data())
def test_int_and_slice_indexing_matches_numpy(axes, data):
    x = random_named(axes, data.draw(st.integers(0, 1000)))
    chosen = data.draw(st.lists(st.sampled_from(axes), unique=True, min_size=1))
    idx = {}
    ref_idx = [slice(None)] * len(axes)
    for ax in chosen:
        if data.draw(st.booleans()):
            i = data.draw(st.integers(-ax.size, ax.size - 1))
        else:
            i = slice(data.draw(st.integers(0, ax.size)), data.draw(st.integers(0, ax.size)))
        idx[ax.name] = i
        ref_idx[axes.index(ax)] = i
    out = x[idx]
    ref = np.asarray(x.array)[tuple(ref_idx)]
    expected_axes = tuple(
        ax if ax.name not in idx else Axis(ax.name, len(range(*idx[ax.name].indices(ax.size))))
        for ax in axes
        if not isinstance(idx.get(ax.name), int)
    )
    assert out.axes == expected_axes
    np.testing.assert_array_equal(out.array, ref)
    # tuple form gives the same
    flat = tuple(v for k, i in idx.items() for v in (k, i))
    np.testing.assert_array_equal(x[flat].array, ref)


def test_index_errors():
    x = hax.zeros((A, B))
    with pytest.raises(ValueError, match="'z'"):
        x["z", 0]
    with pytest.raises(IndexError, match="'a'"):
        x["a", 5]
    with pytest.raises(TypeError, match="pairs"):
        x["a", 0, "b"]
    with pytest.raises(TypeError, match="by name"):
        x[0]


def test_dslice_under_jit():
    x = random_named((A, C), 0)

    @jax.jit
    def f(i):
        return x["c", hax.ds(i, 2)].array, hax.slice(x, "c", start=i, length=2).array

    a, b = f(jnp.int32(1))
    np.testing.assert_array_equal(a, np.asarray(x.array)[:, 1:3])
    np.testing.assert_array_equal(b, np.asarray(x.array)[:, 1:3])
    blk = x["c", hax.dblock(1, 2)]
    np.testing.assert_array_equal(blk.array, np.asarray(x.array)[:, 2:4])


def test_slice_forms_and_new_axis():
    x = random_named((A, C), 0)
    s = hax.slice(x, "c", new_axis="cc", start=1, length=2)
    assert s.axes == (A, Axis("cc", 2))
    d = x.slice({"a": 1, "c": 0}, length={"a": 1, "c": 3})
    np.testing.assert_array_equal(d.array, np.asarray(x.array)[1:2, 0:3])
    with pytest.raises(ValueError, match="out of bounds"):
        hax.slice(x, "c", start=3, length=2)


def test_updated_slice():
    x = hax.zeros((A, C), dtype=jnp.int32)
    upd = hax.named(jnp.array([[7, 8]]), (Axis("c", 1), Axis("a", 2)))  # other order
    out = hax.updated_slice(x, {"c": 2}, upd)
    ref = np.zeros((2, 4), np.int32)
    ref[:, 2] = [7, 8]
    np.testing.assert_array_equal(out.array, ref)
    out2 = jax.jit(lambda i: x.updated_slice({"a": i, "c": 1}, hax.named(jnp.array([5, 6]), "c")))(1)
    ref2 = np.zeros((2, 4), np.int32)
    ref2[1, 1:3] = [5, 6]
    np.testing.assert_array_equal(out2.array, ref2)


def test_named_array_indices_and_take():
    x = random_named((A, B, C), 0)
    xa = np.asarray(x.array)
    ids = hax.named(jnp.array([[2, 0], [1, 1], [0, 2]]), ("p", "q"))
    out = x["b", ids]
    assert out.axes == (A, Axis("p", 3), Axis("q", 2), C)
    np.testing.assert_array_equal(out.array, xa[:, np.asarray(ids.array), :])
    t = hax.take(x, "c", hax.named(jnp.array([3, 0]), "k"))
    assert t.axes == (A, B, Axis("k", 2))
    np.testing.assert_array_equal(t.array, xa[:, :, [3, 0]])
    assert hax.take(x, "a", 1).axes == (B, C)
    # batched gather: the index shares axis "a" with the array
    per_a = hax.named(jnp.array([[0, 3], [1, 2]]), ("a", "k"))
    g = x["c", per_a]
    assert g.axes == (A, B, Axis("k", 2))
    ref = np.stack([xa[i][:, np.asarray(per_a.array)[i]] for i in range(2)])
    np.testing.assert_array_equal(g.array, ref)
    # two named indices broadcast together and replace both axes
    ia = hax.named(jnp.array([0, 1, 1]), "k")
    ic = hax.named(jnp.array([3, 2, 0]), "k")
    both = x[{"a": ia, "c": ic}]
    assert both.axes == (Axis("k", 3), B)
    np.testing.assert_array_equal(both.array, xa[[0, 1, 1], :, [3, 2, 0]])


def test_at_updates_match_numpy():
    x = random_named((A, C), 0)
    xa = np.asarray(x.array)
    ref = xa.copy()
    ref[1, :] = 5
    np.testing.assert_array_equal(x.at["a", 1].set(5.0).array, ref)
    ref = xa.copy()
    ref[:, 1:3] += np.array([1.0, 2.0])
    np.testing.assert_allclose(x.at["c", 1:3].add(hax.named(jnp.array([1.0, 2.0]), "c")).array, ref)
    ref = xa.copy()
    ref[:, [0, 0, 2]] *= 1.0
    np.testing.assert_allclose(x.at["c", hax.named(jnp.array([0, 2]), "k")].multiply(2.0).array[:, 1], xa[:, 1])
    # repeated indices accumulate for add
    ref = xa.copy()
    np.add.at(ref, (slice(None), [0, 0, 2]), 1.0)
    np.testing.assert_allclose(x.at["c", hax.named(jnp.array([0, 0, 2]), "k")].add(1.0).array, ref, rtol=1e-6)
    ref = xa.copy()
    ref[0, 1:3] = np.maximum(ref[0, 1:3], 0.0)
    np.testing.assert_allclose(x.at["a", 0, "c", hax.ds(1, 2)].max(0.0).array, ref)
    ref = xa.copy()
    ref[1] = ref[1] ** 2
    np.testing.assert_allclose(x.at["a", 1].power(2.0).array, ref, rtol=1e-6)
    np.testing.assert_allclose(x.at["a", 1].apply(jnp.square).array, ref, rtol=1e-6)
    ref = xa.copy()
    ref[1] = np.minimum(ref[1], -1.0)
    np.testing.assert_allclose(x.at["a", 1].min(-1.0).array, ref)
    ref = xa.copy()
    ref[0] /= 2.0
    np.testing.assert_allclose(x.at["a", 0].divide(2.0).array, ref, rtol=1e-6)
    np.testing.assert_array_equal(x.at["a", 0].get().array, xa[0])


def test_traced_int_index_and_at_under_jit():
    x = hax.arange((A, C))
    xa = np.arange(8).reshape(2, 4)

    @jax.jit
    def f(i):
        return x["a", i].array, x.at["a", i].set(-1).array, x.at["c", hax.ds(i, 2)].add(100).array

    row, setrow, added = f(jnp.int32(1))
    np.testing.assert_array_equal(row, xa[1])
    ref = xa.copy()
    ref[1] = -1
    np.testing.assert_array_equal(setrow, ref)
    ref = xa.copy()
    ref[:, 1:3] += 100
    np.testing.assert_array_equal(added, ref)
