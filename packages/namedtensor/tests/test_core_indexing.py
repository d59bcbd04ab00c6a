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
    # batched gather: the index shares axis "a" with the array, which is matched element-wise; "a" and "c" are
    # not adjacent, so (NumPy's rule) the index axes come first
    per_a = hax.named(jnp.array([[0, 3], [1, 2]]), ("a", "k"))
    g = x["c", per_a]
    assert g.axes == (A, Axis("k", 2), B)
    ref = np.stack([xa[i][:, np.asarray(per_a.array)[i]].T for i in range(2)])
    np.testing.assert_array_equal(g.array, ref)
    # take puts the index's new axes first in a batched gather (Haliax's layout)
    t = hax.take(x, "c", per_a)
    assert t.axes == (Axis("k", 2), A, B)
    np.testing.assert_array_equal(t.array, np.transpose(ref, (1, 0, 2)))
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


def test_advanced_index_placement_follows_numpy():
    x = random_named((A, B, C), 1)
    xa = np.asarray(x.array)
    i_a = hax.named(jnp.array([1, 0, 1]), "k")
    i_c = hax.named(jnp.array([3, 3, 0]), "k")
    # adjacent advanced indices (an int next to an index array) stay in place
    out = x["b", 2, "c", i_c]
    assert out.axes == (A, Axis("k", 3))
    np.testing.assert_array_equal(out.array, xa[:, 2, [3, 3, 0]])
    # separated ones go first, as in NumPy
    out = x["a", i_a, "c", i_c]
    assert out.axes == (Axis("k", 3), B)
    np.testing.assert_array_equal(out.array, xa[[1, 0, 1], :, [3, 3, 0]])
    # dslices are gathers too: two separated ones move to the front (the larger index's axes last)
    out = x["a", hax.ds(0, 2), "c", hax.ds(1, 3)]
    assert out.axes == (A, Axis("c", 3), B)
    np.testing.assert_array_equal(out.array, xa[np.arange(2)[:, None], :, np.arange(1, 4)[None, :]])


def test_plain_1d_array_index_keeps_the_axis_name():
    x = random_named((A, C), 2)
    idx = jnp.array([3, 1, 1])
    out = jax.jit(lambda i: x["c", i])(idx)
    assert out.axes == (A, Axis("c", 3))
    np.testing.assert_array_equal(out.array, np.asarray(x.array)[:, [3, 1, 1]])
    with pytest.raises(TypeError, match="unsupported index"):
        x["c", jnp.zeros((2, 2), jnp.int32)]


@pytest.mark.parametrize("start", [-2, 0, 1, 3, 5])
def test_dslice_out_of_bounds_reads_zeros_and_drops_writes(start):
    x = hax.arange((A, C)) + 1
    xa = np.asarray(x.array)
    positions = np.arange(start, start + 3)
    inside = (positions >= 0) & (positions < C.size)
    ref = np.zeros((2, 3), xa.dtype)
    ref[:, inside] = xa[:, positions[inside]]
    read = jax.jit(lambda s: x["c", hax.ds(s, 3)].array)(start)
    np.testing.assert_array_equal(read, ref)
    np.testing.assert_array_equal(x["c", hax.ds(start, 3)].array, ref)
    np.testing.assert_array_equal(x.at["c", hax.ds(start, 3)].get().array, ref)
    upd = hax.named(jnp.array([[10, 20, 30], [40, 50, 60]]), (A, Axis("c", 3)))
    written = jax.jit(lambda s: x.at["c", hax.ds(s, 3)].set(upd).array)(start)
    ref_w = xa.copy()
    ref_w[:, positions[inside]] = np.asarray(upd.array)[:, inside]
    np.testing.assert_array_equal(written, ref_w)
    # a dslice longer than the axis pads with zeros
    long = x["c", hax.ds(start, 6)].array
    pos6 = np.arange(start, start + 6)
    ok6 = (pos6 >= 0) & (pos6 < C.size)
    ref6 = np.zeros((2, 6), xa.dtype)
    ref6[:, ok6] = xa[:, pos6[ok6]]
    np.testing.assert_array_equal(long, ref6)


def test_dslice_length_may_be_an_axis():
    x = hax.arange((C,))
    np.testing.assert_array_equal(x["c", hax.dslice(1, Axis("w", 2))].array, [1, 2])


def test_ragged_updated_slice_matches_a_loop():
    cache = hax.zeros((A, C), dtype=jnp.int32)
    starts = hax.named(jnp.array([2, 0]), "a")
    upd = hax.named(jnp.array([[1, 2], [3, 4]]), (A, Axis("c", 2)))
    out = jax.jit(hax.updated_slice)(cache, {"c": starts}, upd)
    ref = np.zeros((2, 4), np.int32)
    for b, s in enumerate([2, 0]):
        ref[b, s : s + 2] = np.asarray(upd.array)[b]
    np.testing.assert_array_equal(out.array, ref)
    # an update without the mapped axis is written at every start
    out = hax.updated_slice(cache, {"c": starts}, hax.named(jnp.array([7]), Axis("c", 1)))
    ref = np.zeros((2, 4), np.int32)
    ref[0, 2] = ref[1, 0] = 7
    np.testing.assert_array_equal(out.array, ref)
    with pytest.raises(ValueError, match="not in the original array"):
        hax.updated_slice(cache, {"c": starts}, hax.named(jnp.ones((2, 2), jnp.int32), (A, Axis("new", 2))))
    with pytest.raises(ValueError, match="not in the array's axes"):
        hax.updated_slice(cache, {"c": hax.named(jnp.array([0, 1, 2]), "z")}, hax.zeros(Axis("c", 1), jnp.int32))


def test_updated_slice_static_overflow_is_an_error():
    x = hax.zeros((C,), dtype=jnp.int32)
    with pytest.raises(ValueError, match="do not fit"):
        hax.updated_slice(x, {"c": 2}, hax.zeros(Axis("c", 3), jnp.int32))


def test_roll_takes_a_scalar_named_shift_only():
    x = hax.arange((A, C))
    np.testing.assert_array_equal(
        hax.roll(x, hax.named(jnp.array(1), ()), "c").array, np.roll(np.arange(8).reshape(2, 4), 1, axis=1)
    )
    with pytest.raises(TypeError, match="no axes"):
        hax.roll(x, hax.arange((A,)), "c")
