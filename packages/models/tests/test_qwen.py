"""Qwen2: logits vs transformers (Q/K/V biases, GQA, tying, sliding window), the ``qwen2`` alias, HF round trips,
training, config errors. A window on some layers only: ``test_qwen_sliding.py``."""

from __future__ import annotations

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
from ponente.models import QwenConfig, QwenLMHeadModel, config_for_type, registered_types
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4
VOCAB = 61


def _ids(seq: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    return random_ids(seq, batch, vocab=VOCAB, seed=seed)


def _hf_qwen2(**overrides: Any) -> Any:
    """A transformers Qwen2 with tiny sizes and random weights (biases included, which HF initializes to zero)."""
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model


CASES = [
    ({}, 12),  # GQA 4/2, untied, full attention
    ({"tie_word_embeddings": True, "num_key_value_heads": 1}, 5),  # MQA, tied
    (
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 50.0},
        },
        9,
    ),
    ({"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}, 12),  # every layer slides
    ({"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2}, 12),  # no layer slides (2 layers)
    ({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "num_hidden_layers": 1}, 7),
]


@pytest.mark.parametrize(("overrides", "seq"), CASES)
def test_logits_match_transformers(overrides: dict[str, Any], seq: int, port: Any, hf_logits: Any) -> None:
    hf = _hf_qwen2(**overrides)
    assert hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # the biases matter in this comparison
    model = port(hf)
    assert isinstance(model, QwenLMHeadModel)
    assert model.config.resolved_layer_types() == tuple(hf.config.layer_types)
    assert model.config.sliding_window == hf.config.sliding_window
    ids = _ids(seq)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_state_dict_has_qkv_biases_only() -> None:
    cfg = QwenConfig(seq_len=32, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2)
    state = cfg.build(hax.Axis("vocab", VOCAB), key=jax.random.key(0)).to_hf_state_dict()
    hf = _hf_qwen2()
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert {k: v.shape for k, v in state.items()} == expected
    assert "model.layers.0.self_attn.o_proj.bias" not in state
    assert not state["model.layers.1.self_attn.v_proj.bias"].any()  # zero-initialized, like transformers


def test_qwen2_model_type_is_an_alias_of_qwen(tmp_path: Path, hf_logits: Any) -> None:
    assert config_for_type("qwen") is config_for_type("qwen2") is QwenConfig
    assert QwenConfig.model_type == "qwen"
    assert "qwen" in registered_types()
    assert "qwen2" not in registered_types()
    hf = _hf_qwen2(tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    assert isinstance(model, QwenLMHeadModel)
    ids = _ids(12)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_hf_export_and_import_round_trip(tmp_path: Path, window: int | None, hf_logits: Any) -> None:
    cfg = QwenConfig(
        seq_len=16,
        hidden_dim=32,
        intermediate_dim=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        sliding_window=window,
        tie_word_embeddings=True,
    )
    assert QwenConfig.from_hf_config(cfg.to_hf_config(VOCAB)) == cfg
    model = cfg.build(hax.Axis("vocab", VOCAB), key=jax.random.key(1))
    # non-zero biases, so the export of each bias is checked
    state = {k: v + (0.1 if k.endswith("bias") else 0.0) for k, v in model.to_hf_state_dict().items()}
    model = model.from_hf_state_dict(state)
    save_pretrained(model, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert isinstance(hf, transformers.Qwen2ForCausalLM)
    assert hf.config.sliding_window == window
    ids = _ids(16)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)
    hf.save_pretrained(tmp_path / "hf")
    again = load_pretrained(tmp_path / "hf")
    assert isinstance(again, QwenLMHeadModel)
    assert again.config == cfg
    for name, value in again.to_hf_state_dict().items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)


def test_config_errors() -> None:
    mixed = _hf_qwen2(use_sliding_window=True, sliding_window=3, max_window_layers=1).config.to_dict()
    assert QwenConfig.from_hf_config(mixed).layer_types == ("full_attention", "sliding_attention")  # supported
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        QwenConfig.from_hf_config({**mixed, "layer_types": ["sliding_attention", "chunked_attention"]})
    with pytest.raises(ValueError, match="qk_norm=True cannot be exported"):
        QwenConfig(hidden_dim=16, num_heads=4, num_kv_heads=2, qk_norm=True).to_hf_config(10)


def test_training_reduces_loss(train_losses: Any) -> None:
    cfg = QwenConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2)
    model = cfg.build(hax.Axis("vocab", VOCAB), key=jax.random.key(0))
    losses = train_losses(model, _ids(16, batch=4))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses
