"""Every element-wise function, against NumPy on the transposed positional arrays."""

import warnings

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from named_strategies import axes_st, random_named, to_numpy

import ponente.namedtensor as hax
import ponente.namedtensor.elementwise as ew

INT_UNARY = {"bitwise_count", "bitwise_invert", "bitwise_not", "invert"}
INT_BINARY = {
    "bitwise_and",
    "bitwise_left_shift",
    "bitwise_or",
    "bitwise_right_shift",
    "bitwise_xor",
    "gcd",
    "lcm",
    "left_shift",
    "right_shift",
}
TWO_OUTPUTS = {"frexp", "modf", "divmod"}
UNARY = sorted(
    n
    for n in ew.__all__
    if n not in TWO_OUTPUTS and ew.__dict__[n].__code__.co_varnames[:1] == ("a",) and n != "nan_to_num"
)
BINARY = sorted(
    n for n in ew.__all__ if n not in TWO_OUTPUTS and ew.__dict__[n].__code__.co_varnames[:2] == ("x1", "x2")
)


def _reference(name):
    if name == "rsqrt":
        return lambda x: 1 / np.sqrt(x)
    aliases = {"around": "round", "pow": "power", "bitwise_invert": "invert", "bitwise_not": "invert"}
    return getattr(np, aliases.get(name, name), None) or getattr(jnp, name)


def test_function_lists_are_complete():
    assert len(UNARY) > 60
    assert len(BINARY) > 40
    for name in ["abs", "exp", "tanh", "sqrt", "isnan", "logical_not", "sign", "round"]:
        assert name in UNARY
    for name in ["add", "logaddexp", "bitwise_xor", "greater_equal", "maximum", "arctan2", "nextafter"]:
        assert name in BINARY


@pytest.mark.parametrize("name", UNARY)
@settings(max_examples=2)
@given(axes=axes_st(min_axes=1, max_axes=3), seed=st.integers(0, 1000))
def test_unary(name, axes, seed):
    dtype = np.int32 if name in INT_UNARY else np.float32
    x = random_named(axes, seed, dtype, low=-3 if dtype == np.int32 else -2, high=4 if dtype == np.int32 else 2)
    out = getattr(hax, name)(x)
    assert out.axes == x.axes
    names = [a.name for a in axes][::-1]  # compare in a different (reversed) order
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = np.asarray(_reference(name)(to_numpy(x, names)))
    np.testing.assert_allclose(to_numpy(out, names), ref, rtol=2e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("name", BINARY)
@settings(max_examples=2)
@given(axes=axes_st(min_axes=1, max_axes=3), data=st.data())
def test_binary(name, axes, data):
    dtype = np.int32 if name in INT_BINARY else np.float32
    low, high = (0, 5) if dtype == np.int32 else (0.5, 2.0)
    sub = tuple(data.draw(st.permutations(data.draw(st.lists(st.sampled_from(axes), unique=True, min_size=1)))))
    x = random_named(axes, data.draw(st.integers(0, 1000)), dtype, low, high)
    y_dtype, ylow, yhigh = (np.int32, -2, 3) if name == "ldexp" else (dtype, low, high)
    y = random_named(sub, data.draw(st.integers(0, 1000)), y_dtype, ylow, yhigh)
    out = getattr(hax, name)(x, y)
    assert out.axes == axes  # x is the larger (or equal) left operand
    names = [a.name for a in axes]
    ynames = [n for n in names if n in {a.name for a in sub}]
    yref = to_numpy(y, ynames).reshape([a.size if a in sub else 1 for a in axes])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = np.asarray(_reference(name)(to_numpy(x, names), yref))
    np.testing.assert_allclose(to_numpy(out, names), ref, rtol=2e-5, atol=1e-6, equal_nan=True)
    assert getattr(hax, name)(x, 2 if dtype == np.int32 or name == "ldexp" else 1.5).axes == x.axes


def test_two_output_and_special_functions():
    x = hax.named(jnp.array([[1.5, -2.25], [3.0, 0.5]]), ("a", "b"))
    m, e = hax.frexp(x)
    rm, re = np.frexp(np.asarray(x.array))
    np.testing.assert_array_equal(m.array, rm)
    np.testing.assert_array_equal(e.array, re)
    f, i = hax.modf(x)
    rf, ri = np.modf(np.asarray(x.array))
    np.testing.assert_array_equal(f.array, rf)
    np.testing.assert_array_equal(i.array, ri)
    q, r = hax.divmod(x, hax.named(jnp.array([2.0, 0.5]), "b"))
    np.testing.assert_array_equal(q.array, np.floor_divide(np.asarray(x.array), [2.0, 0.5]))
    np.testing.assert_array_equal(r.array, np.mod(np.asarray(x.array), [2.0, 0.5]))
    y = hax.named(jnp.array([np.nan, np.inf, 1.0]), "c")
    np.testing.assert_array_equal(hax.nan_to_num(y, posinf=9.0).array, [0.0, 9.0, 1.0])
    np.testing.assert_array_equal(hax.round(x, 1).array, np.round(np.asarray(x.array), 1))


def test_binary_errors_name_axes():
    with pytest.raises(ValueError, match="subset"):
        hax.add(hax.zeros({"a": 2}), hax.zeros({"b": 2}))
