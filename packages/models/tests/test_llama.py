"""Llama: rope scalings vs transformers, QK-norm vs NumPy, flash backend wiring, padded-vocab losses, training."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models import (
    AttentionMask,
    LlamaConfig,
    LlamaLMHeadModel,
    LmExample,
    QkNormAttention,
    RotaryConfig,
    compute_next_token_loss,
)
from ponente.namedtensor.state_dict import to_torch_compatible_state_dict

TOL = 1e-4

ROPE_CASES = [
    {"rope_type": "default", "rope_theta": 500.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8},
    {
        "rope_type": "yarn",
        "rope_theta": 100.0,
        "factor": 2.0,
        "original_max_position_embeddings": 4,
        "beta_fast": 8.0,
        "beta_slow": 2.0,
        "attention_factor": 1.3,
    },
]


def _ids(seq: int = 16, batch: int = 2, vocab: int = 97, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, size=(batch, seq))


def _logits(model: Any, ids: np.ndarray) -> np.ndarray:
    return np.asarray(model(hax.named(ids, ("batch", "position"))).array)


MQA_TIED = {"num_key_value_heads": 1, "tie_word_embeddings": True, "head_dim": 16}


@pytest.mark.parametrize(
    ("rope", "arch"),
    [(rope, {}) for rope in ROPE_CASES] + [(ROPE_CASES[1], MQA_TIED), (ROPE_CASES[3], MQA_TIED)],
    ids=[r["rope_type"] for r in ROPE_CASES] + ["linear-mqa-tied", "yarn-mqa-tied"],
)
def test_rope_types_match_transformers(
    rope: dict[str, Any], arch: dict[str, Any], tiny_llama: Any, hf_logits: Any, port: Any
) -> None:
    hf = tiny_llama(rope_parameters=dict(rope), initializer_range=0.2, **arch)
    model = port(hf)
    assert model.config.rope.rope_type == rope["rope_type"]
    assert model.config.rope == RotaryConfig.from_hf({"rope_parameters": model.config.rope.to_hf()})
    ids = _ids()
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_flash_backend_is_wired_and_matches_transformers(tiny_llama: Any, hf_logits: Any, port: Any) -> None:
    hf = tiny_llama(initializer_range=0.2)
    model = port(hf, attn_backend="flash", flash_attention_block_size=4)
    attn = model.transformer.layers.stacked.self_attn
    assert (attn.backend, attn.block_size) == ("flash", 4)
    ids = _ids()
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


# --- QK-norm ----------------------------------------------------------------------------------------


def _np_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _np_rotate(x: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotary "rotate half" on (position, heads, head_size)."""
    angle = np.arange(x.shape[0])[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angle, angle], -1))[:, None], np.sin(np.concatenate([angle, angle], -1))[:, None]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _np_qk_norm_attention(x: np.ndarray, sd: dict[str, np.ndarray], cfg: LlamaConfig) -> np.ndarray:
    """One QK-norm attention layer in NumPy from Hugging Face-layout weights; x is (position, hidden)."""
    n_heads, n_kv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.HeadSize.size, cfg.layer_norm_epsilon
    seq = x.shape[0]
    q = (x @ sd["q_proj.weight"].T).reshape(seq, n_heads, d)
    k = (x @ sd["k_proj.weight"].T).reshape(seq, n_kv, d)
    v = (x @ sd["v_proj.weight"].T).reshape(seq, n_kv, d)
    q, k = _np_rms(q, sd["q_norm.weight"], eps), _np_rms(k, sd["k_norm.weight"], eps)
    inv = cfg.rope.inv_freq(d)
    q, k = _np_rotate(q, inv), _np_rotate(k, inv)
    group = n_heads // n_kv
    out = np.zeros((seq, n_heads, d))
    for h in range(n_heads):
        scores = q[:, h] @ k[:, h // group].T / np.sqrt(d)
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // group]
    return out.reshape(seq, n_heads * d) @ sd["o_proj.weight"].T


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_qk_norm_attention_matches_numpy(kv_heads: int) -> None:
    cfg = LlamaConfig(
        seq_len=6,
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=kv_heads,
        qk_norm=True,
        rope=RotaryConfig(theta=100.0),
    )
    layer = LlamaLMHeadModel.init(cfg, hax.Axis("vocab", 7), key=jax.random.key(0)).transformer.layers.get_layer(0)
    attn = layer.self_attn
    assert isinstance(attn, QkNormAttention)
    rng = np.random.RandomState(kv_heads)
    # non-trivial norm scales, so a wrong norm axis or a missing norm shows
    attn = dataclasses.replace(
        attn,
        q_norm=dataclasses.replace(attn.q_norm, weight=hax.named(rng.rand(4).astype(np.float32) + 0.5, "head_size")),
        k_norm=dataclasses.replace(attn.k_norm, weight=hax.named(rng.rand(4).astype(np.float32) + 0.5, "head_size")),
    )
    sd = {k: np.asarray(v, np.float64) for k, v in to_torch_compatible_state_dict(attn).items()}
    assert set(sd) == {f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    x = rng.randn(6, 16).astype(np.float32)
    ours = np.asarray(attn(hax.named(x, ("position", "embed")), AttentionMask.causal()).array)
    np.testing.assert_allclose(ours, _np_qk_norm_attention(x.astype(np.float64), sd, cfg), atol=1e-5)


def test_qk_norm_state_dict_round_trip_and_no_hf_llama_export() -> None:
    cfg = LlamaConfig(
        seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True
    )
    model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
    state = model.to_hf_state_dict()
    assert state["model.layers.1.self_attn.q_norm.weight"].shape == (4,)
    assert state["model.layers.0.self_attn.k_norm.weight"].shape == (4,)
    perturbed = {k: v + 0.25 for k, v in state.items()}
    loaded = model.from_hf_state_dict(perturbed)
    for name, value in loaded.to_hf_state_dict().items():
        np.testing.assert_array_equal(value, perturbed[name], err_msg=name)
    with pytest.raises(ValueError, match="qk_norm"):
        cfg.to_hf_config(11)


# --- vocabulary padding ----------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_padded_vocab_full_and_blockwise_losses_agree(tied: bool) -> None:
    cfg = LlamaConfig(
        seq_len=8,
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        tie_word_embeddings=tied,
        vocab_padding_multiple=16,
    )
    model = cfg.build(hax.Axis("vocab", 37), key=jax.random.key(0))
    assert (model.Vocab.size, model.vocab_size) == (48, 37)
    assert model.get_lm_head().resolve_axis("vocab").size == 37
    ids = _ids(8, vocab=37)
    example = LmExample.causal(hax.named(jnp.asarray(ids), ("batch", "position")))
    full = float(compute_next_token_loss(model, example).scalar())
    # reference: NumPy cross-entropy over the real vocabulary only, from the model's own logits
    logits = np.asarray(model(hax.named(ids, ("batch", "position"))).array, np.float64)[..., :37]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    target = np.take_along_axis(logits, np.roll(ids, -1, axis=1)[..., None], -1)[..., 0]
    expected = (lse - target)[:, :-1].mean()
    assert full == pytest.approx(expected, rel=1e-5)
    blockwise = float(compute_next_token_loss(model, example, block_size=8).scalar())
    assert blockwise == pytest.approx(expected, rel=1e-5)


# --- training --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", [{}, {"tie_word_embeddings": True, "qk_norm": True, "num_kv_heads": 1}])
def test_llama_trains(variant: dict[str, Any], train_losses: Any) -> None:
    cfg = LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = dataclasses.replace(cfg, **variant).build(hax.Axis("vocab", 50), key=jax.random.key(0))
    losses = train_losses(model, _ids(16, batch=4, vocab=50))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses
