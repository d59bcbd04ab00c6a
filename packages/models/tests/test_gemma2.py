"""Gemma 2: logits vs transformers (soft-capping, sliding/global layers, sandwich norms), HF import/export,
packed documents vs separate runs, errors, training."""

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
from ponente.models import Gemma2Config, GemmaLMHeadModel, LmExample, compute_next_token_loss
from ponente.models.hf import load_pretrained, save_pretrained
from ponente.namedtensor.nn import attention as hattn

TOL = 1e-4
S, F = "sliding_attention", "full_attention"

CASES = [
    {},  # sliding (window 5), full, sliding; GQA; both soft caps; query_pre_attn_scalar 12
    {"num_key_value_heads": 1, "tie_word_embeddings": False, "layer_types": [F, S, S]},  # MQA, untied, custom types
    {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 2},  # MHA, tiny window
    # no capping, every layer slides
    {"attn_logit_softcapping": None, "final_logit_softcapping": None, "num_hidden_layers": 2, "layer_types": [S, S]},
    {"attn_logit_softcapping": 0.5, "sliding_window": 3, "query_pre_attn_scalar": 16},  # hard cap
]


def _tiny_gemma2(**overrides: Any) -> Any:
    """A random transformers Gemma 2 (eager attention) with random norm weights (transformers zeroes them)."""
    kwargs: dict[str, Any] = {
        "vocab_size": 97,
        "max_position_embeddings": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "initializer_range": 0.2,
        "sliding_window": 5,
        "query_pre_attn_scalar": 12,
        "attn_logit_softcapping": 1.5,  # small caps, so that capping changes the logits a lot
        "final_logit_softcapping": 3.0,
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize(("overrides", "seq"), [(case, 16 - 3 * i) for i, case in enumerate(CASES)])
def test_logits_match_transformers(overrides: dict[str, Any], seq: int, hf_logits: Any) -> None:
    hf = _tiny_gemma2(**overrides)
    model = _port(hf)
    assert isinstance(model, GemmaLMHeadModel)
    assert isinstance(model.config, Gemma2Config)
    assert model.config.layout().layer_types == tuple(hf.config.layer_types)
    ids = _ids(seq)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_each_feature_changes_the_logits(hf_logits: Any) -> None:
    """Parity is not vacuous: dropping a cap, the window, or the pattern moves the logits away from transformers."""
    hf = _tiny_gemma2()
    ids = _ids()
    expected = hf_logits(hf, ids)
    for change in (
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"sliding_window": None},
        {"layer_types": (F, S, F)},
        {"query_pre_attn_scalar": None},
    ):
        assert np.abs(_logits(_port(hf, **change), ids) - expected).max() > 1e-2, change


def test_hf_import_and_export_round_trip(tmp_path: Path, hf_logits: Any) -> None:
    hf = _tiny_gemma2(layer_types=[F, S, S], tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    assert isinstance(model, GemmaLMHeadModel)
    assert type(model.config) is Gemma2Config
    ids = _ids()
    expected = hf_logits(hf, ids)
    np.testing.assert_allclose(_logits(model, ids), expected, atol=TOL, rtol=0)

    save_pretrained(model, tmp_path / "ours")
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    assert type(reloaded_hf).__name__ == "Gemma2ForCausalLM"
    assert list(reloaded_hf.config.layer_types) == [F, S, S]
    np.testing.assert_allclose(hf_logits(reloaded_hf, ids), expected, atol=TOL, rtol=0)


def test_config_round_trips_and_reads_transformers4_spelling() -> None:
    cfg = Gemma2Config(
        seq_len=32, hidden_dim=32, intermediate_dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16
    )
    hf = cfg.to_hf_config(50)
    assert hf["layer_types"] == [S, F, S, F]
    assert hf["query_pre_attn_scalar"] == 16
    back = Gemma2Config.from_hf_config(hf)
    assert back == dataclasses.replace(cfg, query_pre_attn_scalar=16)
    custom = dataclasses.replace(cfg, layer_types=(F, F, S, S), sliding_window=None, final_logit_softcapping=None)
    read_custom = Gemma2Config.from_hf_config(custom.to_hf_config(50))
    assert read_custom.layout() == dataclasses.replace(custom, sliding_window=32).layout()
    # transformers 4: no layer_types (even layers slide), rope_theta at the top level
    old = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    old["rope_theta"] = 500.0
    read = Gemma2Config.from_hf_config(old)
    assert read.resolved_layer_types() == (S, F, S, F)
    assert read.rope.theta == 500.0


def test_packed_documents_match_separate_runs() -> None:
    """With segment ids, each document's logits equal those of the document alone (window and segments combine)."""
    cfg = Gemma2Config(
        seq_len=12,
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        sliding_window=3,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    )
    model = cfg.build(hax.Axis("vocab", 31), key=jax.random.key(0))
    ids = _ids(12, batch=1, vocab=31)
    segments = hax.named(jnp.asarray([[0] * 5 + [1] * 7]), ("batch", "position"))
    example = LmExample.causal(hax.named(jnp.asarray(ids), ("batch", "position")), segment_ids=segments)
    packed = _logits(model, ids, example.attn_mask)
    np.testing.assert_allclose(packed[:, :5], _logits(model, ids[:, :5]), atol=1e-5)
    np.testing.assert_allclose(packed[:, 5:], _logits(model, ids[:, 5:]), atol=1e-5)
    # an explicit boolean causal mask is restricted to the window of sliding layers as well
    Pos = hax.Axis("position", 12)
    explicit = hattn.causal_mask(Pos, Pos.alias("key_position"))
    np.testing.assert_allclose(_logits(model, ids, explicit), _logits(model, ids), atol=1e-6)


def test_errors() -> None:
    base: dict[str, Any] = {
        "seq_len": 8,
        "hidden_dim": 16,
        "intermediate_dim": 32,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 1,
    }
    with pytest.raises(ValueError, match=r"'xla' attention backend has no logit soft-capping.*'reference', 'flash'"):
        Gemma2Config(**base, attn_backend="xla")
    assert Gemma2Config(**base).attn_backend == "auto"  # resolves per call to a backend that soft-caps
    with pytest.raises(ValueError, match="layer_types has 1 entries but num_layers is 2"):
        Gemma2Config(**base, layer_types=(S,))
    with pytest.raises(ValueError, match="'global'"):
        Gemma2Config(**base, layer_types=(S, "global"))
    with pytest.raises(ValueError, match="final_logit_softcapping must be positive"):
        Gemma2Config(**base, final_logit_softcapping=0.0)
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        Gemma2Config(**base, sliding_window=0)
    model = Gemma2Config(**base).build(hax.Axis("vocab", 11), key=jax.random.key(0))
    example = LmExample.causal(hax.named(jnp.zeros(8, dtype=jnp.int32), "position"))
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        compute_next_token_loss(model, example, block_size=4)


def test_gemma2_trains(train_losses: Any) -> None:
    cfg = Gemma2Config(
        seq_len=16,
        hidden_dim=32,
        intermediate_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
    )
    model = cfg.build(hax.Axis("vocab", 50), key=jax.random.key(0))
    losses = train_losses(model, _ids(16, batch=4, vocab=50))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses
