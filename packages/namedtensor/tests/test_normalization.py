"""LayerNorm and RmsNorm against NumPy formulas, over one and several axes."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn

B, P, E = Axis("b", 2), Axis("pos", 3), Axis("embed", 5)


def _data(seed):
    return np.random.default_rng(seed).standard_normal((2, 3, 5)).astype(np.float32) * 3 + 1


@given(st.integers(0, 1000))
def test_layer_norm_matches_numpy(seed):
    raw = _data(seed)
    rng = np.random.default_rng(seed + 1)
    w, b = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    ln = nn.LayerNorm.init(E, eps=1e-5)
    ln = nn.LayerNorm(ln.axis, hax.named(w, "embed"), hax.named(b, "embed"), ln.eps, ln.dtype)
    out = ln(hax.named(raw, (B, P, E)))
    ref = (raw - raw.mean(-1, keepdims=True)) / np.sqrt(raw.var(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(out.array, ref, rtol=1e-4, atol=1e-4)
    assert out.axes == (B, P, E)


def test_layer_norm_over_two_axes_and_no_params():
    raw = _data(0)
    ln = nn.LayerNorm.init((P, E), use_weight=False, use_bias=False)
    assert ln.weight is None
    assert ln.bias is None
    out = ln(hax.named(raw, (B, P, E)))
    ref = (raw - raw.mean((1, 2), keepdims=True)) / np.sqrt(raw.var((1, 2), keepdims=True) + 1e-5)
    np.testing.assert_allclose(out.array, ref, rtol=1e-4, atol=1e-4)


def test_rms_norm_matches_numpy():
    raw = _data(3)
    norm = nn.RmsNorm.init(E, eps=1e-6, use_bias=False)
    assert norm.bias is None
    out = norm(hax.named(raw, (B, P, E)))
    ref = raw / np.sqrt((raw**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(out.array, ref, rtol=1e-5, atol=1e-5)


def test_norm_keeps_input_dtype_and_uses_compute_dtype():
    raw = _data(4)
    x = hax.named(jnp.asarray(raw, jnp.bfloat16), (B, P, E))
    out = nn.LayerNorm.init(E, dtype=jnp.float32, use_weight=False, use_bias=False)(x)
    assert out.dtype == jnp.bfloat16
    x32 = raw.astype(np.float64)
    ref = (x32 - x32.mean(-1, keepdims=True)) / np.sqrt(x32.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(out.array, np.float32), ref, atol=0.1)


def test_missing_axis_is_named():
    with pytest.raises(ValueError, match="'embed'"):
        nn.RmsNorm.init(E)(hax.ones({"b": 2, "model": 5}))
