"""Qwen3: logits vs transformers (QK-norm, explicit head_dim, attention biases, sliding window), HF round trips,
training, config errors."""

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
from ponente.models import QkNormAttention, Qwen3Config, Qwen3LMHeadModel, config_for_type
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4
VOCAB = 61


def _ids(seq: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    return random_ids(seq, batch, vocab=VOCAB, seed=seed)


def _hf_qwen3(**overrides: Any) -> Any:
    """A transformers Qwen3 with tiny sizes and random weights (norm scales and biases included)."""
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model


CASES = [
    ({}, 12),  # head_dim 16 != 32 / 4, GQA 4/2
    ({"head_dim": 8, "tie_word_embeddings": True, "num_key_value_heads": 1}, 6),  # the default head size, MQA, tied
    ({"attention_bias": True, "num_hidden_layers": 3, "num_key_value_heads": 4}, 9),  # biases on q, k, v and o
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0, "head_dim": 4}, 12),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}, "rms_norm_eps": 1e-5}, 7),
]


@pytest.mark.parametrize(("overrides", "seq"), CASES)
def test_logits_match_transformers(overrides: dict[str, Any], seq: int, port: Any, hf_logits: Any) -> None:
    hf = _hf_qwen3(**overrides)
    model = port(hf)
    assert isinstance(model, Qwen3LMHeadModel)
    assert isinstance(model.transformer.layers.stacked.self_attn, QkNormAttention)
    assert model.config.HeadSize.size == overrides.get("head_dim", 16)
    assert model.config.attention_bias == overrides.get("attention_bias", False)
    ids = _ids(seq)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_state_dict_names_and_shapes_match_transformers(bias: bool) -> None:
    cfg = Qwen3Config(
        seq_len=32, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        attention_bias=bias,
    )  # fmt: skip
    state = cfg.build(hax.Axis("vocab", VOCAB), key=jax.random.key(0)).to_hf_state_dict()
    hf = _hf_qwen3(attention_bias=bias)
    assert {k: v.shape for k, v in state.items()} == {k: tuple(v.shape) for k, v in hf.state_dict().items()}


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True, "sliding_window": 5, "tie_word_embeddings": True}])
def test_hf_export_and_import_round_trip(tmp_path: Path, variant: dict[str, Any], hf_logits: Any) -> None:
    cfg = Qwen3Config(
        seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        **variant,
    )  # fmt: skip
    assert Qwen3Config.from_hf_config(cfg.to_hf_config(VOCAB)) == cfg
    model = cfg.build(hax.Axis("vocab", VOCAB), key=jax.random.key(1))
    # perturb every parameter (norm scales start at 1, biases at 0), so each export is checked
    rng = np.random.RandomState(0)
    state = {k: v + 0.1 * rng.randn(*v.shape).astype(v.dtype) for k, v in model.to_hf_state_dict().items()}
    model = model.from_hf_state_dict(state)
    save_pretrained(model, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert isinstance(hf, transformers.Qwen3ForCausalLM)
    ids = _ids(16)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)
    hf.save_pretrained(tmp_path / "hf")
    again = load_pretrained(tmp_path / "hf")
    assert isinstance(again, Qwen3LMHeadModel)
    assert again.config == cfg
    for name, value in again.to_hf_state_dict().items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)


def test_missing_head_dim_means_transformers_default() -> None:
    hf = _hf_qwen3().config.to_dict()
    del hf["head_dim"]
    assert Qwen3Config.from_hf_config(hf).HeadSize.size == transformers.Qwen3Config().head_dim == 128


def test_selected_by_type_and_config_errors() -> None:
    assert config_for_type("qwen3") is Qwen3Config
    with pytest.raises(ValueError, match="qk_norm=False cannot be exported, Hugging Face qwen3 always has QK-norm"):
        Qwen3Config(hidden_dim=16, num_heads=4, num_kv_heads=2, qk_norm=False).to_hf_config(10)
    mixed = _hf_qwen3(use_sliding_window=True, sliding_window=3, max_window_layers=1).config.to_dict()
    assert Qwen3Config.from_hf_config(mixed).layer_types == ("full_attention", "sliding_attention")  # supported
    with pytest.raises(ValueError, match=r"Qwen3Config.from_hf_config: layer_types has 3 entries"):
        Qwen3Config.from_hf_config({**mixed, "layer_types": ["full_attention"] * 3})


def test_training_reduces_loss(train_losses: Any) -> None:
    cfg = Qwen3Config(
        seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    model = cfg.build(hax.Axis("vocab", VOCAB), key=jax.random.key(0))
    losses = train_losses(model, _ids(16, batch=4))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses
