"""Rotary embeddings vs NumPy and transformers' frequency initializers (default, linear, Llama-3, YaRN)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

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


YARN_CASES = [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0},
    {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.5},
    {"factor": 16.0, "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 4.0, "original_max_position_embeddings": 64, "truncate": False},
]


def _hf_init(rope_type: str, params: dict[str, Any], head_size: int = 64, theta: float = 10000.0) -> Any:
    full = {"rope_type": rope_type, "rope_theta": theta, **params}
    hf_cfg = transformers.LlamaConfig(
        hidden_size=2 * head_size, num_attention_heads=2, max_position_embeddings=256, rope_parameters=full
    )
    emb = LlamaRotaryEmbedding(hf_cfg)  # the module transformers' Llama uses, for every rope type
    return full, emb.inv_freq.double().numpy(), emb.attention_scaling


@pytest.mark.parametrize("factor", [2.0, 4.0, 32.0])
def test_linear_inv_freq_matches_transformers(factor: float) -> None:
    params, expected, scale = _hf_init("linear", {"factor": factor})
    rot = RotaryConfig.from_hf({"rope_parameters": params})
    np.testing.assert_allclose(rot.inv_freq(64), expected, rtol=1e-6)
    np.testing.assert_allclose(rot.inv_freq(64) * factor, RotaryConfig().inv_freq(64), rtol=1e-12)
    assert rot.attention_scaling() == scale == 1.0


@pytest.mark.parametrize("params", YARN_CASES)
def test_yarn_inv_freq_and_scaling_match_transformers(params: dict[str, Any]) -> None:
    full, expected, scale = _hf_init("yarn", params)
    rot = RotaryConfig.from_hf({"rope_parameters": full, "max_position_embeddings": 256})
    assert rot.rope_type == "yarn"
    np.testing.assert_allclose(rot.inv_freq(64), expected, rtol=1e-6)
    assert rot.attention_scaling() == pytest.approx(scale, rel=1e-12)
    base = RotaryConfig().inv_freq(64)
    # high frequencies are kept, the lowest are interpolated by the factor
    assert rot.inv_freq(64)[0] == pytest.approx(base[0])
    assert rot.inv_freq(64)[-1] == pytest.approx(base[-1] / params["factor"])


def test_yarn_defaults_follow_transformers() -> None:
    # original_max_position_embeddings defaults to max_position_embeddings, as in transformers
    rot = RotaryConfig.from_hf(
        {"max_position_embeddings": 48, "rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0}}
    )
    assert (rot.original_max_position_embeddings, rot.beta_fast, rot.beta_slow) == (48, 32.0, 1.0)
    assert rot.attention_scaling() == pytest.approx(0.1 * np.log(2.0) + 1.0)


ROUND_TRIP = [
    RotaryConfig(theta=1234.0),
    RotaryConfig(theta=500.0, rope_type="linear", factor=3.0),
    RotaryConfig(theta=5e5, rope_type="llama3", factor=8.0, original_max_position_embeddings=1024),
    RotaryConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048, beta_fast=16.0),
    RotaryConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=1.25),
    RotaryConfig(rope_type="yarn", factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5),
    RotaryConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, truncate=False),
]


@pytest.mark.parametrize("rot", ROUND_TRIP)
def test_hf_round_trip(rot: RotaryConfig) -> None:
    hf = rot.to_hf()
    assert RotaryConfig.from_hf({"rope_parameters": hf}) == rot
    # and transformers accepts and computes the same frequencies from what we write
    _, expected, scale = _hf_init(hf["rope_type"], {k: v for k, v in hf.items() if k != "rope_type"}, theta=rot.theta)
    np.testing.assert_allclose(rot.inv_freq(64), expected, rtol=1e-6)
    assert rot.attention_scaling() == pytest.approx(scale, rel=1e-12)


def test_reads_transformers4_rope_scaling() -> None:
    rot = RotaryConfig.from_hf({"rope_theta": 77.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert rot == RotaryConfig(theta=77.0, rope_type="linear", factor=2.0)


def test_yarn_scales_cos_and_sin() -> None:
    Pos, HeadSize = hax.Axis("position", 4), hax.Axis("head_size", 8)
    x = hax.named(np.random.RandomState(1).randn(4, 8).astype(np.float32), (Pos, HeadSize))
    rot = RotaryConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=2.0)
    plain = dataclasses.replace(rot, attention_factor=1.0)
    out, ref = apply_rotary(x, Pos, HeadSize, rot), apply_rotary(x, Pos, HeadSize, plain)
    np.testing.assert_allclose(np.asarray(out.array), 2.0 * np.asarray(ref.array), rtol=1e-6)


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
    with pytest.raises(ValueError, match="dynamic"):
        RotaryConfig.from_hf({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(KeyError, match="factor"):
        RotaryConfig.from_hf({"rope_parameters": {"rope_type": "linear"}})
    with pytest.raises(KeyError, match="original_max_position_embeddings"):
        RotaryConfig.from_hf({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="factor"):
        RotaryConfig(rope_type="linear", factor=0.0)
    with pytest.raises(ValueError, match="even"):
        RotaryConfig().inv_freq(5)
