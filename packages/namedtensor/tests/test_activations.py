"""Activations: each against a NumPy formula on the positional array; axes preserved."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import nn

X = np.linspace(-4.0, 4.0, 24, dtype=np.float32).reshape(4, 6)


def _sig(x):
    return 1 / (1 + np.exp(-x))


SELU_ALPHA, SELU_SCALE = 1.6732632423543772, 1.0507009873554805

REFERENCES = {
    "relu": lambda x: np.maximum(x, 0),
    "relu6": lambda x: np.clip(x, 0, 6),
    "sigmoid": _sig,
    "log_sigmoid": lambda x: np.log(_sig(x)),
    "softplus": lambda x: np.log1p(np.exp(x)),
    "soft_sign": lambda x: x / (np.abs(x) + 1),
    "silu": lambda x: x * _sig(x),
    "swish": lambda x: x * _sig(x),
    "hard_sigmoid": lambda x: np.clip(x + 3, 0, 6) / 6,
    "hard_silu": lambda x: x * np.clip(x + 3, 0, 6) / 6,
    "hard_swish": lambda x: x * np.clip(x + 3, 0, 6) / 6,
    "hard_tanh": lambda x: np.clip(x, -1, 1),
    "selu": lambda x: SELU_SCALE * np.where(x > 0, x, SELU_ALPHA * (np.exp(x) - 1)),
    "relu_squared": lambda x: np.maximum(x, 0) ** 2,
    "quick_gelu": lambda x: x * _sig(1.702 * x),
    "leaky_relu": lambda x: np.where(x >= 0, x, 0.01 * x),
    "elu": lambda x: np.where(x > 0, x, np.exp(x) - 1),
    "celu": lambda x: np.maximum(x, 0) + np.minimum(np.exp(x) - 1, 0),
    "gelu": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_activation_matches_numpy(name):
    x = hax.named(jnp.asarray(X), ("b", "e"))
    out = getattr(nn, name)(x)
    assert out.axes == x.axes
    np.testing.assert_allclose(np.asarray(out.array), REFERENCES[name](X.astype(np.float64)), rtol=1e-5, atol=1e-5)


def test_gelu_exact_uses_erf():
    from math import erf

    x = hax.named(jnp.asarray(X), ("b", "e"))
    ref = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2))))(X.astype(np.float64))
    np.testing.assert_allclose(np.asarray(nn.gelu(x, approximate=False).array), ref, rtol=1e-5, atol=1e-6)


def test_elu_celu_alpha():
    x = hax.named(jnp.asarray(X), ("b", "e"))
    np.testing.assert_allclose(
        nn.elu(x, alpha=2.0).array, np.where(X > 0, X, 2 * (np.exp(X) - 1)), rtol=1e-5, atol=1e-6
    )
    ref = np.maximum(X, 0) + np.minimum(2 * (np.exp(X / 2) - 1), 0)
    np.testing.assert_allclose(nn.celu(x, alpha=2.0).array, ref, rtol=1e-5, atol=1e-6)


@given(st.integers(1, 4), st.integers(1, 3), st.booleans())
def test_glu_halves_the_axis(half, other, axis_first):
    rng = np.random.default_rng(half * 10 + other)
    names = ("mlp", "b") if axis_first else ("b", "mlp")
    raw = rng.standard_normal((2 * half, other) if axis_first else (other, 2 * half)).astype(np.float32)
    out = nn.glu(hax.named(raw, names), "mlp")
    pos = names.index("mlp")
    a, b = np.split(raw, 2, axis=pos)
    np.testing.assert_allclose(out.array, a * _sig(b), rtol=1e-5, atol=1e-6)
    assert out.shape["mlp"] == half


def test_glu_odd_axis_is_an_error():
    with pytest.raises(ValueError, match=r"'mlp'.*even"):
        nn.glu(hax.ones({"mlp": 3}), "mlp")
