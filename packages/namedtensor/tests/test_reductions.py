"""Reductions over named axes (with where=), against NumPy on the positional arrays."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from named_strategies import axes_st, random_named, to_numpy

import ponente.namedtensor as hax
from ponente.namedtensor import Axis

REDUCTIONS = {
    "sum": np.sum,
    "prod": np.prod,
    "mean": np.mean,
    "max": np.max,
    "min": np.min,
    "std": np.std,
    "var": np.var,
    "ptp": np.ptp,
    "nansum": np.nansum,
    "nanprod": np.nanprod,
    "nanmean": np.nanmean,
    "nanmax": np.nanmax,
    "nanmin": np.nanmin,
    "nanstd": np.nanstd,
    "nanvar": np.nanvar,
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@settings(max_examples=4)
@given(axes=axes_st(min_axes=1, max_axes=3), data=st.data())
def test_reduction_over_random_axes(name, axes, data):
    x = random_named(axes, data.draw(st.integers(0, 1000)), low=0.5, high=1.5)
    if name.startswith("nan"):
        x = x.at[{axes[0].name: 0}].set(np.nan) if axes[0].size > 1 else x
    reduced = data.draw(st.lists(st.sampled_from(axes), unique=True, min_size=1))
    names = [a.name for a in axes]
    out = getattr(hax, name)(x, tuple(a.name for a in reduced))
    kept = tuple(a for a in axes if a not in reduced)
    assert out.axes == kept
    ref = REDUCTIONS[name](to_numpy(x, names), axis=tuple(axes.index(a) for a in reduced))
    np.testing.assert_allclose(out.array, ref, rtol=1e-4, atol=1e-6, equal_nan=True)
    total = getattr(hax, name)(x)
    assert total.axes == ()
    np.testing.assert_allclose(total.array, REDUCTIONS[name](to_numpy(x, names)), rtol=1e-4, equal_nan=True)


@pytest.mark.parametrize("name", ["sum", "mean", "max", "min", "prod", "std", "var", "ptp", "all", "any"])
def test_where_mask_broadcasts_by_name(name):
    A, B = Axis("a", 3), Axis("b", 4)
    x = random_named((A, B), 1, low=0.5, high=2.0)
    mask = hax.named(np.array([True, False, True, True]), "b")
    out = getattr(hax, name)(x, "b", where=mask)
    xa = np.asarray(x.array)[:, [0, 2, 3]]
    ref = {"ptp": np.ptp, "all": np.all, "any": np.any}.get(name) or getattr(np, name)
    np.testing.assert_allclose(out.array, ref(xa, axis=1), rtol=1e-5)


def test_argmax_argmin():
    x = random_named((Axis("a", 3), Axis("b", 4)), 2)
    xa = np.asarray(x.array)
    assert hax.argmax(x, "b").axes == (Axis("a", 3),)
    np.testing.assert_array_equal(hax.argmax(x, "b").array, xa.argmax(1))
    np.testing.assert_array_equal(hax.argmin(x, "a").array, xa.argmin(0))
    np.testing.assert_array_equal(hax.argmax(x, None).array, xa.argmax())
    np.testing.assert_array_equal(hax.nanargmax(x, "b").array, xa.argmax(1))
    np.testing.assert_array_equal(hax.nanargmin(x, "b").array, xa.argmin(1))
    with pytest.raises(ValueError, match="exactly one axis"):
        hax.argmax(x, ("a", "b"))
    with pytest.raises(ValueError, match="'z'"):
        hax.sum(x, "z")


def test_ddof_and_all_any():
    x = random_named((Axis("a", 5),), 3)
    np.testing.assert_allclose(hax.std(x, ddof=1).array, np.std(np.asarray(x.array), ddof=1), rtol=1e-5)
    b = hax.named(np.array([[True, False], [True, True]]), ("a", "b"))
    np.testing.assert_array_equal(hax.all(b, "b").array, [False, True])
    np.testing.assert_array_equal(hax.any(b, "a").array, [True, True])


def test_aliases_and_plain_arrays():
    x = random_named((Axis("a", 2), Axis("b", 3)), 5)
    xa = np.asarray(x.array)
    np.testing.assert_allclose(hax.amax(x, "a").array, xa.max(axis=0))
    np.testing.assert_allclose(hax.amin(x).array, xa.min())
    np.testing.assert_allclose(hax.product(x, "b").array, xa.prod(axis=1), rtol=1e-6)
    # unnamed arrays go straight to jax.numpy (positional axis), pytrees leaf by leaf
    np.testing.assert_allclose(hax.sum(xa, axis=1), xa.sum(axis=1), rtol=1e-6)
    assert bool(hax.all(xa == xa))
    tree = hax.max({"named": x, "plain": xa})
    np.testing.assert_allclose(tree["named"].array, xa.max())
    np.testing.assert_allclose(tree["plain"], xa.max())
