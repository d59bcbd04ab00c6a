"""Dropout: the kept/scaled pattern equals jax.random.bernoulli's mask; broadcast axes share it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn

B, P, E = Axis("b", 3), Axis("pos", 4), Axis("embed", 5)


def test_dropout_matches_bernoulli_mask():
    key = jax.random.key(0)
    raw = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    out = nn.dropout(hax.named(raw, (B, P, E)), 0.3, inference=False, key=key)
    keep = np.asarray(jax.random.bernoulli(key, 0.7, (3, 4, 5)))
    np.testing.assert_allclose(out.array, np.where(keep, raw / 0.7, 0), rtol=1e-6)


def test_broadcast_axes_share_the_mask():
    key = jax.random.key(1)
    x = hax.ones((B, P, E))
    out = nn.dropout(x, 0.5, broadcast_axes=P, inference=False, key=key)
    keep = np.asarray(jax.random.bernoulli(key, 0.5, (3, 5)))
    np.testing.assert_allclose(out.array, np.broadcast_to(np.where(keep, 2.0, 0.0)[:, None, :], (3, 4, 5)))


def test_inference_and_edge_rates():
    x = hax.ones((B, E))
    assert nn.dropout(x, 0.9, inference=True) is x
    assert nn.dropout(x, 0.0, inference=False) is x
    np.testing.assert_array_equal(nn.dropout(x, 1.0, inference=False, key=jax.random.key(0)).array, 0)
    layer = nn.Dropout(0.5, inference=True)
    assert layer(x) is x
    y = layer(x, inference=False, key=jax.random.key(2))
    assert set(np.unique(np.asarray(y.array)).tolist()) <= {0.0, 2.0}


def test_dropout_rate_statistics():
    x = hax.ones((Axis("n", 20000),))
    out = nn.Dropout(0.25)(x, key=jax.random.key(3))
    assert abs(float(jnp.mean(out.array == 0)) - 0.25) < 0.02


def test_errors():
    x = hax.ones((B, E))
    with pytest.raises(ValueError, match="key"):
        nn.dropout(x, 0.5, inference=False)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        nn.dropout(x, 1.5, inference=False, key=jax.random.key(0))
    with pytest.raises(ValueError, match="'pos'"):
        nn.dropout(x, 0.5, broadcast_axes=P, inference=False, key=jax.random.key(0))
