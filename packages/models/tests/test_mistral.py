"""Mistral: logits vs transformers (sliding windows, GQA, tying), HF round trips, masks, training, config errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
import transformers
from parity_support import logits as _logits
from parity_support import random_ids

import ponente.namedtensor as hax
from ponente.models import AttentionMask, MistralConfig, MistralLMHeadModel, config_for_type
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4
VOCAB = 61


def _ids(seq: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    return random_ids(seq, batch, vocab=VOCAB, seed=seed)


def _hf_mistral(**overrides: Any) -> Any:
    """A transformers Mistral with tiny sizes and random (not default-initialized) weights."""
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 4,
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model


CASES = [
    ({}, 16),  # GQA 4/2, window 4 < seq
    ({"sliding_window": None, "tie_word_embeddings": True}, 9),  # full attention, tied
    ({"sliding_window": 1, "num_key_value_heads": 1, "num_hidden_layers": 1}, 8),  # each token sees itself; MQA
    ({"sliding_window": 7, "num_key_value_heads": 4, "num_hidden_layers": 3, "head_dim": 4}, 13),  # MHA, narrow heads
    ({"sliding_window": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}, 11),  # window > seq
]


@pytest.mark.parametrize(("overrides", "seq"), CASES)
def test_logits_match_transformers(overrides: dict[str, Any], seq: int, port: Any, hf_logits: Any) -> None:
    hf = _hf_mistral(**overrides)
    model = port(hf)
    assert isinstance(model, MistralLMHeadModel)
    assert model.config.sliding_window == overrides.get("sliding_window", 4)
    ids = _ids(seq)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_flash_backend_matches_transformers(port: Any, hf_logits: Any) -> None:
    hf = _hf_mistral(sliding_window=3)
    model = port(hf, attn_backend="flash", flash_attention_block_size=4)
    ids = _ids(16)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_window_changes_logits_only_beyond_the_window(port: Any) -> None:
    # with a window of w, the first w positions see exactly what full attention sees; later ones differ
    hf = _hf_mistral(sliding_window=5)
    windowed = port(hf)
    full = dataclasses.replace(windowed, config=dataclasses.replace(windowed.config, sliding_window=None))
    ids = _ids(12)
    a, b = _logits(windowed, ids), _logits(full, ids)
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-5, rtol=0)
    assert np.abs(a[:, 5:] - b[:, 5:]).max(axis=-1).min() > 1e-3


def test_caller_masks_are_intersected_with_the_window(port: Any) -> None:
    model = port(_hf_mistral(sliding_window=3))
    ids = _ids(12, batch=1)
    # segment ids: each segment must give the logits of running it alone (a second code path)
    segments = np.array([[0] * 5 + [1] * 7])
    mask = AttentionMask.causal().with_segment_ids(hax.named(segments, ("batch", "position")))
    packed = _logits(model, ids, mask)
    np.testing.assert_allclose(packed[:, :5], _logits(model, ids[:, :5]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[:, 5:], _logits(model, ids[:, 5:]), atol=1e-5, rtol=0)
    # an explicit boolean causal mask gets the window too, so it equals the default mask
    causal = hax.named(np.tril(np.ones((12, 12), bool)), ("position", "key_position"))
    np.testing.assert_allclose(_logits(model, ids, causal), _logits(model, ids), atol=1e-6, rtol=0)
    # a narrower window in the caller's mask wins
    narrow = _logits(model, ids, AttentionMask.causal(sliding_window=2))
    reference = dataclasses.replace(model, config=dataclasses.replace(model.config, sliding_window=2))
    np.testing.assert_allclose(narrow, _logits(reference, ids), atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 6])
def test_hf_export_and_import_round_trip(tmp_path: Path, window: int | None, hf_logits: Any) -> None:
    cfg = MistralConfig(
        seq_len=16,
        hidden_dim=32,
        intermediate_dim=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        sliding_window=window,
    )
    assert MistralConfig.from_hf_config(cfg.to_hf_config(VOCAB)) == cfg
    model = cfg.build(hax.Axis("vocab", VOCAB), key=jax.random.key(1))
    save_pretrained(model, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert isinstance(hf, transformers.MistralForCausalLM)
    assert hf.config.sliding_window == window
    ids = _ids(16)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)
    hf.save_pretrained(tmp_path / "hf")
    again = load_pretrained(tmp_path / "hf")
    assert isinstance(again, MistralLMHeadModel)
    assert again.config == cfg
    for name, value in model.to_hf_state_dict().items():
        np.testing.assert_array_equal(again.to_hf_state_dict()[name], value, err_msg=name)


def test_missing_sliding_window_key_means_transformers_default() -> None:
    hf = _hf_mistral().config.to_dict()
    del hf["sliding_window"]
    assert MistralConfig.from_hf_config(hf).sliding_window == transformers.MistralConfig().sliding_window == 4096


def test_selected_by_type_and_config_errors() -> None:
    assert config_for_type("mistral") is MistralConfig
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        MistralConfig(num_heads=4, num_kv_heads=2, hidden_dim=16, sliding_window=0)
    with pytest.raises(ValueError, match="qk_norm=True cannot be exported"):
        MistralConfig(num_heads=4, num_kv_heads=2, hidden_dim=16, qk_norm=True).to_hf_config(10)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        MistralConfig.from_hf_config({**_hf_mistral().config.to_dict(), "hidden_act": "gelu"})


def test_training_reduces_loss(train_losses: Any) -> None:
    cfg = MistralConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, sliding_window=4
    )
    model = cfg.build(hax.Axis("vocab", VOCAB), key=jax.random.key(0))
    losses = train_losses(model, _ids(16, batch=4))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses
