"""Tests for ``dot``: contraction by name against ``np.einsum`` on the positional arrays."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray

POOL = ("a", "b", "c", "d", "e")


def _ones(shape, dtype=jnp.float32):
    return NamedArray(jnp.ones(tuple(shape.values()), dtype), tuple(Axis(n, s) for n, s in shape.items()))


@st.composite
def operands(draw, n_min=1, n_max=3):
    sizes = {name: draw(st.integers(1, 3)) for name in POOL}
    arrays = []
    for _ in range(draw(st.integers(n_min, n_max))):
        names = draw(st.permutations(POOL).map(lambda p: p[: draw(st.integers(0, 4))]))
        shape = tuple(sizes[n] for n in names)
        seed = draw(st.integers(0, 2**16))
        raw = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        arrays.append(NamedArray(jnp.asarray(raw), tuple(Axis(n, sizes[n]) for n in names)))
    return arrays


def _reference(arrays, out_names):
    letters = {name: chr(ord("a") + i) for i, name in enumerate(POOL)}
    spec = ",".join("".join(letters[ax.name] for ax in a.axes) for a in arrays)
    spec += "->" + "".join(letters[n] for n in out_names)
    return np.einsum(spec, *[np.asarray(a.array, dtype=np.float64) for a in arrays])


def _union(arrays):
    out = []
    for a in arrays:
        out += [ax.name for ax in a.axes if ax.name not in out]
    return out


@settings(max_examples=40, deadline=None)
@given(operands(), st.data())
def test_dot_matches_einsum(arrays, data):
    union = _union(arrays)
    contracted = data.draw(st.lists(st.sampled_from(union), unique=True)) if union else []
    result = hax.dot(*arrays, axis=tuple(contracted))
    expected_names = [n for n in union if n not in contracted]
    assert [ax.name for ax in result.axes] == expected_names
    np.testing.assert_allclose(result.array, _reference(arrays, expected_names), rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(operands(n_min=2, n_max=2), st.data())
def test_dot_out_axes_permutes_result(arrays, data):
    union = _union(arrays)
    order = data.draw(st.permutations(union))
    result = hax.dot(*arrays, axis=(), out_axes=tuple(order))
    assert [ax.name for ax in result.axes] == list(order)
    np.testing.assert_allclose(result.array, _reference(arrays, order), rtol=1e-4, atol=1e-4)


def test_dot_axis_none_contracts_everything():
    x = hax.named(jnp.arange(6.0).reshape(2, 3), ("h", "w"))
    y = hax.named(jnp.arange(3.0), "w")
    result = hax.dot(x, y, axis=None)
    assert result.axes == ()
    assert float(result.array) == pytest.approx(
        float(np.einsum("hw,w->", np.arange(6.0).reshape(2, 3), np.arange(3.0)))
    )


def test_dot_partial_out_axes_with_ellipsis():
    x = _ones({"h": 2, "w": 3, "d": 4})
    y = _ones({"d": 4, "c": 5})
    result = hax.dot(x, y, axis="d", out_axes=("c", ...))
    assert [ax.name for ax in result.axes] == ["c", "h", "w"]
    result = hax.dot(x, y, axis="d", out_axes=(..., "h"))
    assert [ax.name for ax in result.axes] == ["w", "c", "h"]


def test_legacy_positional_axis_warns_and_matches():
    x = hax.named(jnp.arange(6.0).reshape(2, 3), ("h", "w"))
    y = hax.named(jnp.arange(3.0), "w")
    with pytest.warns(DeprecationWarning, match="deprecated"):
        legacy = hax.dot("w", x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        modern = hax.dot(x, y, axis="w")
    np.testing.assert_array_equal(legacy.array, modern.array)
    assert legacy.axes == modern.axes


def test_dot_errors_name_the_axis():
    x = _ones({"h": 2, "w": 3})
    with pytest.raises(ValueError, match="'missing'"):
        hax.dot(x, x, axis="missing")
    with pytest.raises(ValueError, match=r"'w' has size 3 .* but 4"):
        hax.dot(x, _ones({"w": 4}), axis="w")
    with pytest.raises(TypeError, match="keyword"):
        hax.dot(x, x)


def test_dot_preferred_element_type_and_precision():
    x = hax.named(jnp.ones((2, 3), dtype=jnp.bfloat16), ("h", "w"))
    result = hax.dot(x, x, axis="w", preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    assert result.dtype == jnp.float32
    np.testing.assert_array_equal(result.array, np.full((2,), 3.0))


def test_dot_under_jit_and_grad():
    x = hax.named(jnp.arange(6.0).reshape(2, 3), ("h", "w"))
    w = hax.named(jnp.arange(3.0) + 1.0, "w")

    def loss(w):
        return hax.dot(x, w, axis="w").array.sum()

    grad = jax.jit(jax.grad(loss))(w)
    assert grad.axes == w.axes
    np.testing.assert_allclose(grad.array, np.arange(6.0).reshape(2, 3).sum(0))


def test_method_form_delegates_to_dot():
    x = NamedArray(jnp.arange(6.0).reshape(2, 3), (Axis("h", 2), Axis("w", 3)))
    y = NamedArray(jnp.arange(3.0), (Axis("w", 3),))
    np.testing.assert_array_equal(x.dot(y, axis="w").array, np.arange(6.0).reshape(2, 3) @ np.arange(3.0))
