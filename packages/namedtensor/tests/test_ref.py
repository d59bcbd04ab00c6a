"""NamedRef: reads, writes and views by axis name, checked against NumPy arrays updated the same way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis


def _ref(shape):
    sizes = tuple(shape.values())
    data = np.arange(int(np.prod(sizes)), dtype=np.float32).reshape(sizes)
    return hax.new_ref(hax.named(jnp.asarray(data), tuple(shape))), data


def test_read_write_match_numpy():
    ref, data = _ref({"x": 5, "y": 4})
    np.testing.assert_array_equal(ref[{"x": slice(1, 4), "y": 2}].array, data[1:4, 2])
    assert ref[{"x": slice(1, 4), "y": 2}].axes == (Axis("x", 3),)
    ref[{"y": slice(0, 4, 2)}] = hax.full({"x": 5, "y": 2}, -1.0)
    data[:, 0:4:2] = -1
    ref[{"x": 0}] = hax.arange({"y": 4}).astype(jnp.float32)  # broadcast by name
    data[0] = np.arange(4)
    ref["x", 4, "y", 3] = 7.0
    data[4, 3] = 7
    np.testing.assert_array_equal(ref.value().array, data)
    np.testing.assert_array_equal(hax.freeze(ref).array, data)
    np.testing.assert_array_equal(hax.get(ref, {"y": 1}).array, data[:, 1])


def test_views_compose_like_numpy_slices():
    ref, data = _ref({"x": 12, "y": 3})
    view = ref.slice({"x": slice(1, 11, 2)})  # rows 1, 3, 5, 7, 9
    assert view.axes == (Axis("x", 5), Axis("y", 3))
    inner = view.slice({"x": hax.ds(1, 3)})  # rows 3, 5, 7
    np.testing.assert_array_equal(inner.value().array, data[1:11:2][1:4])
    inner[{"x": -1, "y": 0}] = 100.0
    data[7, 0] = 100
    row = inner.slice({"x": 0})
    assert row.axes == (Axis("y", 3),)
    row[...] = hax.zeros({"y": 3})
    data[3] = 0
    np.testing.assert_array_equal(ref.value().array, data)
    picked = view.slice({"x": [0, 4]})
    np.testing.assert_array_equal(picked.value().array, data[[1, 9]])
    assert inner.unsliced().axes == ref.axes
    with pytest.raises(IndexError):
        view.slice({"x": 5})
    with pytest.raises(ValueError, match="'z' is not in this reference"):
        view.slice({"z": 0})


def test_named_index_and_swap():
    ref, data = _ref({"x": 6})
    idx = hax.named(jnp.array([4, 1]), "k")
    got = ref.slice({"x": slice(1, 6)})[{"x": idx}]  # elements 5 and 2
    assert got.axes == (Axis("k", 2),)
    np.testing.assert_array_equal(got.array, data[1:][[4, 1]])
    old = hax.swap(ref, {"x": slice(0, 2)}, hax.ones({"x": 2}))
    np.testing.assert_array_equal(old.array, data[0:2])
    data[0:2] = 1
    np.testing.assert_array_equal(ref.value().array, data)


def test_jit_scan_and_grad():
    ref = hax.new_ref(hax.zeros({"x": 4}))

    @jax.jit
    def fill(ref):
        def step(_, i):
            ref.slice({"x": i})[...] = (i * i).astype(jnp.float32)
            return None, None

        hax.scan(step, Axis("x", 4))(None, jnp.arange(4))

    fill(ref)
    np.testing.assert_array_equal(ref.value().array, np.arange(4) ** 2)
    assert jax.tree_util.tree_leaves(ref) == [ref._ref]

    def f(a):
        buf = hax.new_ref(hax.zeros({"x": 3}))
        buf[{"x": slice(1, 3)}] = hax.full({"x": 2}, a) * hax.named(jnp.array([2.0, 3.0]), "x")
        return buf[...].sum().scalar()

    assert jax.grad(f)(1.5) == pytest.approx(5.0)
