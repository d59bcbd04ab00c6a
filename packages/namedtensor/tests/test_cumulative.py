"""Cumulative ops along a named axis, against NumPy."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from named_strategies import axes_st, random_named, to_numpy

import ponente.namedtensor as hax

REFS = {
    "cumsum": np.cumsum,
    "cumprod": np.cumprod,
    "nancumsum": np.nancumsum,
    "nancumprod": np.nancumprod,
    "cummax": np.maximum.accumulate,
    "cummin": np.minimum.accumulate,
}


@pytest.mark.parametrize("name", sorted(REFS))
@settings(max_examples=4)
@given(axes=axes_st(min_axes=1, max_axes=3), data=st.data())
def test_cumulative(name, axes, data):
    x = random_named(axes, data.draw(st.integers(0, 1000)), low=0.5, high=1.5)
    ax = data.draw(st.sampled_from(axes))
    out = getattr(hax, name)(x, ax.name)
    assert out.axes == axes
    names = [a.name for a in axes]
    ref = REFS[name](to_numpy(x, names), axis=axes.index(ax))
    np.testing.assert_allclose(to_numpy(out, names), ref, rtol=1e-5)


def test_reverse_cummax():
    x = hax.named(np.array([1.0, 3.0, 2.0, 0.0]), "a")
    np.testing.assert_array_equal(hax.cummax(x, "a", reverse=True).array, [3.0, 3.0, 2.0, 0.0])
