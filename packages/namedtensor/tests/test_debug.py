"""Tests for ``debug.describe_array``."""

import jax
import jax.numpy as jnp
import numpy as np

from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.debug import describe_array


def test_named_array_statistics_match_numpy():
    raw = np.array([[1.0, -2.0, 5.0], [np.nan, np.inf, 0.5]], dtype=np.float32)
    text = describe_array(NamedArray(jnp.asarray(raw), (Axis("batch", 2), Axis("embed", 3))))
    finite = raw[np.isfinite(raw)].astype(np.float64)
    assert text.startswith("NamedArray(batch=2, embed=3, dtype=float32")
    for stat in ("min", "max", "mean", "std"):
        assert f"{stat}={getattr(finite, stat)():.4g}" in text
    assert "nan=1" in text
    assert "inf=1" in text


def test_plain_empty_and_traced():
    assert describe_array(np.zeros((2, 0))).endswith("shape=(2, 0), dtype=float64, empty)")
    assert "shape=(), dtype=int32, min=3, max=3" in describe_array(jnp.asarray(3))
    seen = []
    jax.jit(lambda x: seen.append(describe_array(x)) or x)(NamedArray(jnp.ones(2), (Axis("b", 2),)))
    assert seen == ["NamedArray(b=2, dtype=float32, traced)"]
    assert "dtype=bool" in describe_array(np.array([True, False]))
