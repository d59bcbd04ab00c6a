"""Gemma 1: logits vs transformers, HF import/export, the (1 + w) norm vs NumPy, the blockwise loss, training."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from parity_support import logits as _logits
from parity_support import port as _port
from parity_support import random_ids as _ids

import ponente.namedtensor as hax
from ponente.models import (
    GemmaConfig,
    GemmaLMHeadModel,
    GemmaRmsNorm,
    LmExample,
    compute_next_token_loss,
)
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4

CASES = [
    {},  # GQA 4 query heads / 2 kv heads, head_dim 16 != hidden / heads, tied
    {"num_key_value_heads": 1, "num_hidden_layers": 1, "tie_word_embeddings": False},  # MQA, untied
    {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 3},  # MHA, small heads
    {"hidden_act": "gelu", "rope_parameters": {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0}},
]


def _tiny_gemma(**overrides: Any) -> Any:
    """A random transformers Gemma (eager attention) whose norm weights are random too (transformers zeroes them)."""
    kwargs: dict[str, Any] = {
        "vocab_size": 97,
        "max_position_embeddings": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "initializer_range": 0.2,
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize(("overrides", "seq"), [(case, 16 - 3 * i) for i, case in enumerate(CASES)])
def test_logits_match_transformers(overrides: dict[str, Any], seq: int, hf_logits: Any) -> None:
    hf = _tiny_gemma(**overrides)
    model = _port(hf)
    assert isinstance(model, GemmaLMHeadModel)
    assert (model.lm_head is None) == hf.config.tie_word_embeddings
    ids = _ids(seq)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_flash_backend_matches_transformers(hf_logits: Any) -> None:
    hf = _tiny_gemma()
    model = _port(hf, attn_backend="flash", flash_attention_block_size=4)
    assert model.transformer.layers.stacked.self_attn.attn.backend == "flash"
    ids = _ids()
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_import_and_export_round_trip(tmp_path: Path, tied: bool, hf_logits: Any) -> None:
    hf = _tiny_gemma(tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    assert isinstance(model, GemmaLMHeadModel)
    assert type(model.config) is GemmaConfig
    ids = _ids()
    expected = hf_logits(hf, ids)
    np.testing.assert_allclose(_logits(model, ids), expected, atol=TOL, rtol=0)

    save_pretrained(model, tmp_path / "ours")
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(reloaded_hf).__name__ == "GemmaForCausalLM"
    np.testing.assert_allclose(hf_logits(reloaded_hf, ids), expected, atol=TOL, rtol=0)
    again = load_pretrained(tmp_path / "ours")
    for name, value in again.to_hf_state_dict().items():
        np.testing.assert_array_equal(value, model.to_hf_state_dict()[name], err_msg=name)


def test_config_round_trips_through_hf_dict() -> None:
    cfg = GemmaConfig(seq_len=32, hidden_dim=24, intermediate_dim=40, num_layers=3, num_heads=6, num_kv_heads=3)
    assert GemmaConfig.from_hf_config(cfg.to_hf_config(50)) == cfg
    explicit = dataclasses.replace(cfg, head_dim=12, tie_word_embeddings=False)
    assert GemmaConfig.from_hf_config(explicit.to_hf_config(50)) == explicit
    # transformers reads our dict and agrees on the sizes
    hf_cfg = transformers.GemmaConfig(**explicit.to_hf_config(50))
    assert (hf_cfg.head_dim, hf_cfg.num_key_value_heads, hf_cfg.tie_word_embeddings) == (12, 3, False)
    with pytest.raises(ValueError, match="tanh approximation"):
        dataclasses.replace(cfg, hidden_act="gelu").to_hf_config(50)


def test_legacy_gelu_means_tanh_and_errors() -> None:
    base = GemmaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2, num_kv_heads=1)
    legacy = dict(base.to_hf_config(11), hidden_act="gelu")
    assert GemmaConfig.from_hf_config(legacy).hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        GemmaConfig.from_hf_config(dict(legacy, hidden_act="relu"))
    with pytest.raises(ValueError, match="attention_bias"):
        GemmaConfig.from_hf_config(dict(legacy, attention_bias=True))
    with pytest.raises(KeyError, match="num_hidden_layers"):
        GemmaConfig.from_hf_config({k: v for k, v in legacy.items() if k != "num_hidden_layers"})


def test_rms_norm_matches_numpy() -> None:
    rng = np.random.RandomState(0)
    x, w = rng.randn(3, 5).astype(np.float32), rng.randn(5).astype(np.float32)
    norm = dataclasses.replace(GemmaRmsNorm.init(hax.Axis("embed", 5), eps=1e-3), weight=hax.named(w, "embed"))
    ours = norm(hax.named(jnp.asarray(x, jnp.bfloat16), ("batch", "embed")))
    assert ours.dtype == jnp.bfloat16
    xf = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    expected = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + 1e-3) * (1 + w)
    np.testing.assert_allclose(np.asarray(ours.array, np.float64), expected, rtol=1e-2, atol=1e-2)
    assert np.array_equal(np.asarray(GemmaRmsNorm.init(hax.Axis("embed", 5), eps=1e-6).weight.array), np.zeros(5))


def test_blockwise_loss_matches_full_loss() -> None:
    cfg = GemmaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2, num_kv_heads=1)
    model = cfg.build(hax.Axis("vocab", 37), key=jax.random.key(1))
    example = LmExample.causal(hax.named(jnp.asarray(_ids(8, vocab=37)), ("batch", "position")))
    full = compute_next_token_loss(model, example).scalar()
    blockwise = compute_next_token_loss(model, example, block_size=8).scalar()
    np.testing.assert_allclose(float(blockwise), float(full), rtol=1e-5)


def test_blockwise_loss_matches_full_loss_with_a_padded_vocabulary() -> None:
    cfg = GemmaConfig(
        seq_len=8,
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        vocab_padding_multiple=16,
    )
    model = cfg.build(hax.Axis("vocab", 37), key=jax.random.key(1))
    example = LmExample.causal(hax.named(jnp.asarray(_ids(8, vocab=37)), ("batch", "position")))
    full = compute_next_token_loss(model, example, block_size=None).scalar()
    blockwise = compute_next_token_loss(model, example, block_size=8).scalar()
    np.testing.assert_allclose(float(blockwise), float(full), rtol=1e-5)


def test_gemma_trains(train_losses: Any) -> None:
    cfg = GemmaConfig(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = cfg.build(hax.Axis("vocab", 50), key=jax.random.key(0))
    losses = train_losses(model, _ids(16, batch=4, vocab=50))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses
