"""Rotary embeddings vs NumPy and transformers' frequency initializers."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import ponente.namedtensor as hax
from ponente.models import RotaryConfig, apply_rotary


def test_default_inv_freq_matches_formula() -> None:
    inv = RotaryConfig(theta=500.0).inv_freq(8)
    np.testing.assert_allclose(inv, [500.0 ** (-i / 8) for i in (0, 2, 4, 6)], rtol=1e-12)


def test_llama3_inv_freq_matches_transformers() -> None:
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf_cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = RotaryConfig.from_hf({"rope_parameters": params}).inv_freq(128)
    np.testing.assert_allclose(ours, expected.double().numpy(), rtol=1e-6)
    assert not np.allclose(ours, RotaryConfig(theta=500000.0).inv_freq(128))


def test_apply_rotary_is_a_complex_rotation() -> None:
    Pos, Heads, HeadSize = hax.Axis("position", 5), hax.Axis("heads", 2), hax.Axis("head_size", 6)
    x = np.random.RandomState(0).randn(5, 2, 6).astype(np.float32)
    rot = RotaryConfig(theta=100.0)
    out = np.asarray(apply_rotary(hax.named(x, (Pos, Heads, HeadSize)), Pos, HeadSize, rot).array)
    half = 3
    z = x[..., :half] + 1j * x[..., half:]  # "rotate half" pairs dimension i with i + half
    angle = np.arange(5)[:, None, None] * rot.inv_freq(6)[None, None, :]
    rz = z * np.exp(1j * angle)
    np.testing.assert_allclose(out, np.concatenate([rz.real, rz.imag], -1), atol=1e-5)


def test_errors() -> None:
    with pytest.raises(ValueError, match="rope_type"):
        RotaryConfig(rope_type="yarn_unknown")
    with pytest.raises(ValueError, match="even"):
        RotaryConfig().inv_freq(5)
