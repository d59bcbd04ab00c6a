"""OLMo 2: logits vs transformers, full-width QK-norm vs NumPy, HF import/export, training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import ponente.namedtensor as hax
from ponente.models import AttentionMask, config_for_type
from ponente.models.hf import load_pretrained, save_pretrained
from ponente.models.olmo2 import Olmo2Config, Olmo2LMHeadModel

TOL = 1e-4
VOCAB = 61


def _tiny_olmo2(**overrides: Any) -> Any:
    """A random transformers OLMo 2 (float32, eager attention) with non-trivial norm scales and biases."""
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 16,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": 0.2,
        "attn_implementation": "eager",
        "eos_token_id": 0,
        "pad_token_id": 1,
    }
    kwargs.update(overrides)
    model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**kwargs)).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb them so a misplaced one shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.3 * torch.randn_like(param))
    return model


def _port(hf: Any) -> Olmo2LMHeadModel:
    """Our model with the config and weights of a transformers OLMo 2 (cheaper than a random init here)."""
    hf_config = hf.config.to_dict()
    config = config_for_type(hf_config["model_type"]).from_hf_config(hf_config)
    assert isinstance(config, Olmo2Config)
    template = eqx.filter_eval_shape(config.build, hax.Axis("vocab", VOCAB), key=jax.random.key(0))
    return template.from_hf_state_dict({k: v.detach().numpy() for k, v in hf.state_dict().items()})


def _ids(seq: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, size=(batch, seq))


def _named(ids: np.ndarray) -> hax.NamedArray:
    return hax.named(jnp.asarray(ids), ("batch", "position"))


# (transformers config overrides, sequence length)
CASES: list[tuple[dict[str, Any], int]] = [
    ({}, 16),  # GQA, untied
    ({"num_key_value_heads": 4, "tie_word_embeddings": True, "attention_bias": True}, 9),
    ({"num_key_value_heads": 1, "num_hidden_layers": 3, "num_attention_heads": 8}, 12),
    ({"head_dim": 16, "num_hidden_layers": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, 16),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_logits_match_transformers(case: int) -> None:
    torch.manual_seed(case)
    overrides, seq = CASES[case]
    hf = _tiny_olmo2(**overrides)
    model = _port(hf)
    ids = _ids(seq)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(_named(ids)).array), expected, atol=TOL, rtol=0)


def _np_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_qk_norm_spans_all_heads() -> None:
    """q and k are normalized over the whole projection (heads * head_size), not per head."""
    model = _port(_tiny_olmo2(hidden_size=16, intermediate_size=8, num_hidden_layers=1))
    cfg = model.config
    state = {k: np.asarray(v, np.float64) for k, v in model.to_hf_state_dict().items()}
    p = "model.layers.0.self_attn"
    assert state[f"{p}.q_norm.weight"].shape == (16,)
    assert state[f"{p}.k_norm.weight"].shape == (8,)
    rng = np.random.RandomState(0)
    state[f"{p}.q_norm.weight"] = rng.rand(16) + 0.5
    state[f"{p}.k_norm.weight"] = rng.rand(8) + 0.5
    model = model.from_hf_state_dict(state)
    attn = model.transformer.layers.get_layer(0).self_attn
    x = rng.randn(4, 16)
    q = attn.q_norm(attn.attn.q_proj(hax.named(jnp.asarray(x, jnp.float32), ("position", "embed"))))
    q_flat = np.asarray(q.rearrange(("position", "kv_heads", "q_heads_per_group", "head_size")).array).reshape(4, 16)
    expected = _np_rms(x @ state[f"{p}.q_proj.weight"].T, state[f"{p}.q_norm.weight"], cfg.layer_norm_epsilon)
    np.testing.assert_allclose(q_flat, expected, atol=1e-5)
    k = attn.k_norm(attn.attn.k_proj(hax.named(jnp.asarray(x, jnp.float32), ("position", "embed"))))
    k_flat = np.asarray(k.rearrange(("position", "kv_heads", "head_size")).array).reshape(4, 8)
    expected_k = _np_rms(x @ state[f"{p}.k_proj.weight"].T, state[f"{p}.k_norm.weight"], cfg.layer_norm_epsilon)
    np.testing.assert_allclose(k_flat, expected_k, atol=1e-5)
    # and the attention output is still causal: the first position only sees itself
    out = attn(hax.named(jnp.asarray(x, jnp.float32), ("position", "embed")), AttentionMask.causal())
    out_short = attn(hax.named(jnp.asarray(x[:1], jnp.float32), ("position", "embed")), AttentionMask.causal())
    np.testing.assert_allclose(np.asarray(out.array)[0], np.asarray(out_short.array)[0], atol=1e-5)


@pytest.mark.parametrize("case", [0, 1])
def test_hf_file_round_trips(case: int, tmp_path: Path) -> None:
    torch.manual_seed(10 + case)
    overrides, seq = CASES[case]
    hf = _tiny_olmo2(**overrides)
    ids = _ids(seq, seed=1)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    hf.save_pretrained(tmp_path / "from_hf")
    model = load_pretrained(tmp_path / "from_hf")
    assert isinstance(model, Olmo2LMHeadModel)
    assert model.config.attention_bias == bool(overrides.get("attention_bias", False))
    np.testing.assert_allclose(np.asarray(model(_named(ids)).array), expected, atol=TOL, rtol=0)
    save_pretrained(model, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager")
    assert isinstance(reloaded, transformers.Olmo2ForCausalLM)
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.tensor(ids)).logits.numpy(), expected, atol=TOL, rtol=0)
    assert Olmo2Config.from_hf_config(model.config.to_hf_config(VOCAB)) == model.config


def test_config_errors_and_registry() -> None:
    base = {"seq_len": 8, "hidden_dim": 16, "intermediate_dim": 8, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2}
    with pytest.raises(ValueError, match="qk_norm"):
        Olmo2Config(**base, qk_norm=True)
    model = _port(_tiny_olmo2(hidden_size=16, intermediate_size=8, num_hidden_layers=1))
    state = model.to_hf_state_dict()
    state["model.layers.0.self_attn.k_norm.weight"] = np.ones(5, np.float32)
    with pytest.raises(ValueError, match="k_norm"):
        model.from_hf_state_dict(state)
    assert config_for_type("olmo2") is Olmo2Config


@pytest.mark.parametrize(
    "variant", [{}, {"tie_word_embeddings": True, "attention_bias": True, "num_key_value_heads": 1}]
)
def test_olmo2_trains(variant: dict[str, Any], train_losses: Any) -> None:
    model = _port(_tiny_olmo2(initializer_range=0.05, **variant))
    losses = train_losses(model, np.random.RandomState(0).randint(0, 50, size=(4, 16)))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses
