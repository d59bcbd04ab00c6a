"""unique* / bincount / nonzero with static sizes, against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis

U = Axis("u", 4)


def test_unique_family():
    data = np.array([[3, 1, 3], [2, 1, 1]])
    x = hax.named(data, ("a", "b"))
    vals, idx, inv, counts = hax.unique_all(x, U)
    rv, ri, rinv, rc = np.unique(data, return_index=True, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(vals.array[:3], rv)
    np.testing.assert_array_equal(idx.array[:3], ri)
    np.testing.assert_array_equal(inv.array, rinv.reshape(data.shape))
    assert inv.axes == x.axes
    assert vals.axes == (U,)
    np.testing.assert_array_equal(counts.array, [*rc, 0])
    np.testing.assert_array_equal(hax.unique_values(x, U, fill_value=-1).array, [*rv, -1])
    _v2, c2 = hax.unique_counts(x, Axis("u", 3))
    np.testing.assert_array_equal(c2.array, rc)
    v3, inv3 = hax.unique_inverse(x, Axis("u", 3))
    np.testing.assert_array_equal(v3.array[inv3.array], data)
    jitted = jax.jit(lambda x: hax.unique(x, U, fill_value=0).array)(x)
    np.testing.assert_array_equal(jitted, [1, 2, 3, 0])
    rows = hax.unique(hax.named(np.array([[1, 2], [1, 2], [0, 5]]), ("r", "c")), Axis("ur", 2), axis="r")
    assert rows.axes == (Axis("ur", 2), Axis("c", 2))
    np.testing.assert_array_equal(rows.array, [[0, 5], [1, 2]])
    with pytest.raises(TypeError, match="static size"):
        hax.unique(x, "u")  # type: ignore[arg-type]


def test_bincount():
    x = hax.named(np.array([[0, 2], [2, 5]]), ("a", "b"))
    out = hax.bincount(x, Axis("bin", 6))
    np.testing.assert_array_equal(out.array, np.bincount([0, 2, 2, 5], minlength=6))
    w = hax.named(np.array([0.5, 2.0]), "b")
    weighted = hax.bincount(x, Axis("bin", 6), weights=w)
    np.testing.assert_allclose(weighted.array, np.bincount([0, 2, 2, 5], weights=[0.5, 2, 0.5, 2], minlength=6))


def test_nonzero_and_where_one_arg():
    data = np.array([[0, 4, 0], [7, 0, 1]])
    x = hax.named(data, ("a", "b"))
    ia, ib = hax.nonzero(x, size=4, fill_value=-1)
    ra, rb = np.nonzero(data)
    np.testing.assert_array_equal(ia.array[:3], ra)
    np.testing.assert_array_equal(ib.array[:3], rb)
    assert ia.axes == (Axis("nonzero", 4),)
    assert ia.array[3] == -1
    K = Axis("k", 3)
    _wa, wb = hax.where(x != 0, new_axis=K)
    np.testing.assert_array_equal(wb.array, rb)
    assert wb.axes == (K,)
    with pytest.raises(ValueError, match="new_axis"):
        hax.where(x != 0)
    jitted = jax.jit(lambda x: hax.nonzero(x, size=3)[1].array)(x)
    np.testing.assert_array_equal(jitted, rb)
    assert jnp.issubdtype(jitted.dtype, jnp.integer)


def test_unique_shortcuts_along_an_axis():
    rows = hax.named(jnp.array([[1, 2], [3, 4], [1, 2], [0, 9]]), ("row", "col"))
    U = hax.Axis("u", 3)
    values, first, inverse, counts = hax.unique_all(rows, U, axis="row")
    ref_values, ref_first, ref_inverse, ref_counts = np.unique(
        np.asarray(rows.array), axis=0, return_index=True, return_inverse=True, return_counts=True
    )
    assert values.axes == (U, hax.Axis("col", 2))
    np.testing.assert_array_equal(values.array, ref_values)
    np.testing.assert_array_equal(first.array, ref_first)
    np.testing.assert_array_equal(inverse.array, ref_inverse.reshape(-1))
    np.testing.assert_array_equal(counts.array, ref_counts)
    np.testing.assert_array_equal(hax.unique_values(rows, U, axis="row").array, ref_values)
    np.testing.assert_array_equal(hax.unique_counts(rows, U, axis="row")[1].array, ref_counts)
    np.testing.assert_array_equal(hax.unique_inverse(rows, U, axis="row")[1].array, ref_inverse.reshape(-1))
