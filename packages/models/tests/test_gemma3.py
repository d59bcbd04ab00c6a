"""Gemma 3 (text): logits vs transformers (QK-norm, local/global rotary, 5:1 pattern), HF import/export via
``model_type: gemma3_text``, transformers-4 config spelling, the flash backend, training."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
import transformers
from parity_support import logits as _logits
from parity_support import port as _port
from parity_support import random_ids as _ids

import ponente.namedtensor as hax
from ponente.models import Gemma3Config, GemmaLMHeadModel, RotaryConfig, config_for_type
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4
S, F = "sliding_attention", "full_attention"
LINEAR_GLOBAL = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
}

CASES = [
    {},  # 7 layers: the default 5:1 pattern (s s s s s f s), GQA, window 5, distinct rotary bases
    {"rope_parameters": LINEAR_GLOBAL, "num_hidden_layers": 3, "layer_types": [S, F, S]},  # scaled global rope
    {"num_key_value_heads": 1, "tie_word_embeddings": False, "num_hidden_layers": 2, "final_logit_softcapping": 4.0},
    {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1, "sliding_window": 2},
]


def _tiny_gemma3(**overrides: Any) -> Any:
    """A random transformers Gemma 3 text model (eager) with random norm weights (transformers zeroes them)."""
    kwargs: dict[str, Any] = {
        "vocab_size": 97,
        "max_position_embeddings": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "initializer_range": 0.2,
        "sliding_window": 5,
        "query_pre_attn_scalar": 12,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
        },
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize(("overrides", "seq"), [(case, 16 - 3 * i) for i, case in enumerate(CASES)])
def test_logits_match_transformers(overrides: dict[str, Any], seq: int, hf_logits: Any) -> None:
    hf = _tiny_gemma3(**overrides)
    model = _port(hf)
    assert isinstance(model, GemmaLMHeadModel)
    assert isinstance(model.config, Gemma3Config)
    assert model.config.layout().layer_types == tuple(hf.config.layer_types)
    ids = _ids(seq)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_default_pattern_and_features_matter(hf_logits: Any) -> None:
    hf = _tiny_gemma3()
    assert list(hf.config.layer_types) == [S] * 5 + [F, S]
    model = _port(hf)
    assert model.config.layer_types is None  # the default pattern stays implicit
    assert model.config.layout().layer_types == (S,) * 5 + (F, S)
    ids = _ids()
    expected = hf_logits(hf, ids)
    for change in (
        {"rope_local": RotaryConfig(theta=1000.0)},
        {"sliding_window_pattern": 2},
        {"sliding_window": None},
    ):
        assert np.abs(_logits(_port(hf, **change), ids) - expected).max() > 1e-2, change
    # resetting the QK-norm scales to the identity changes the logits too
    layers = model.transformer.layers
    attn = layers.stacked.self_attn
    zeroed = dataclasses.replace(
        attn,
        q_norm=dataclasses.replace(attn.q_norm, weight=attn.q_norm.weight * 0.0),
        k_norm=dataclasses.replace(attn.k_norm, weight=attn.k_norm.weight * 0.0),
    )
    changed = dataclasses.replace(
        model,
        transformer=dataclasses.replace(
            model.transformer,
            layers=dataclasses.replace(layers, stacked=dataclasses.replace(layers.stacked, self_attn=zeroed)),
        ),
    )
    assert np.abs(_logits(changed, ids) - expected).max() > 1e-2


def test_hf_import_and_export_round_trip(tmp_path: Path, hf_logits: Any) -> None:
    hf = _tiny_gemma3(rope_parameters=LINEAR_GLOBAL, num_hidden_layers=3, layer_types=[S, F, S])
    hf.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    assert isinstance(model, GemmaLMHeadModel)
    assert type(model.config) is Gemma3Config
    ids = _ids()
    expected = hf_logits(hf, ids)
    np.testing.assert_allclose(_logits(model, ids), expected, atol=TOL, rtol=0)
    assert set(model.to_hf_state_dict()) >= {
        "model.layers.2.self_attn.q_norm.weight",
        "model.layers.0.pre_feedforward_layernorm.weight",
    }

    save_pretrained(model, tmp_path / "ours")
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    assert type(reloaded_hf).__name__ == "Gemma3ForCausalLM"
    assert reloaded_hf.config.rope_parameters["full_attention"]["rope_type"] == "linear"
    np.testing.assert_allclose(hf_logits(reloaded_hf, ids), expected, atol=TOL, rtol=0)


def test_registry_type_and_hf_model_type() -> None:
    assert config_for_type("gemma3") is Gemma3Config
    assert config_for_type("gemma3_text") is Gemma3Config
    assert Gemma3Config.model_type == "gemma3"
    cfg = Gemma3Config(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2, num_kv_heads=1)
    assert cfg.to_hf_config(11)["model_type"] == "gemma3_text"


def test_reads_transformers4_spelling(caplog: pytest.LogCaptureFixture) -> None:
    old = {
        "model_type": "gemma3_text",
        "max_position_embeddings": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 4,
        "sliding_window": 16,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 20.0,
    }
    with caplog.at_level(logging.WARNING):
        cfg = Gemma3Config.from_hf_config(old)
    assert "attn_logit_softcapping" in caplog.text
    assert cfg.attn_logit_softcapping is None
    assert cfg.rope == RotaryConfig(theta=1_000_000.0, rope_type="linear", factor=8.0)
    assert cfg.rope_local == RotaryConfig(theta=10_000.0)
    assert cfg.resolved_layer_types() == (S, S, S, F, S, S, S, F)
    # transformers 5 reads the same dict to the same model
    new = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    assert list(new.layer_types) == list(cfg.resolved_layer_types())
    assert Gemma3Config.from_hf_config(new.to_dict()).layout() == cfg.layout()


def test_attention_cap_cannot_be_exported() -> None:
    cfg = Gemma3Config(
        seq_len=8,
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        attn_logit_softcapping=10.0,
    )
    with pytest.raises(ValueError, match="transformers' Gemma 3 ignores it"):
        cfg.to_hf_config(11)


def test_flash_backend_matches_reference_with_mixed_layers() -> None:
    cfg = Gemma3Config(
        seq_len=8,
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        sliding_window=4,
        sliding_window_pattern=2,
    )
    model = cfg.build(hax.Axis("vocab", 31), key=jax.random.key(3))
    flash = dataclasses.replace(cfg, attn_backend="flash", flash_attention_block_size=4).build(
        hax.Axis("vocab", 31), key=jax.random.key(3)
    )
    ids = _ids(8, vocab=31)
    np.testing.assert_allclose(_logits(flash, ids), _logits(model, ids), atol=1e-5)


def test_gemma3_trains(train_losses: Any) -> None:
    cfg = Gemma3Config(
        seq_len=16,
        hidden_dim=32,
        intermediate_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        sliding_window=4,
        sliding_window_pattern=2,
    )
    model = cfg.build(hax.Axis("vocab", 50), key=jax.random.key(0))
    losses = train_losses(model, _ids(16, batch=4, vocab=50))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses
