"""GPT-2 options vs transformers (inverse-layer-index scaling, upcast, unscaled scores), dropout, training."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models import Gpt2Config

TOL = 1e-4


def _ids(seq: int = 16, batch: int = 2, vocab: int = 97, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, size=(batch, seq))


@eqx.filter_jit
def _forward(model: Any, ids: jax.Array, key: jax.Array | None) -> jax.Array:
    return model(hax.named(ids, ("batch", "position")), key=key).array


def _logits(model: Any, ids: np.ndarray, key: jax.Array | None = None) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(ids), key))


OPTION_CASES = [
    {"scale_attn_by_inverse_layer_idx": True, "n_layer": 3},
    {"reorder_and_upcast_attn": True},
    {"scale_attn_weights": False},
    {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True, "n_layer": 4, "n_head": 2},
]


@pytest.mark.parametrize("overrides", OPTION_CASES)
def test_options_match_transformers(overrides: dict[str, Any], tiny_gpt2: Any, hf_logits: Any, port: Any) -> None:
    hf = tiny_gpt2(initializer_range=0.3, **overrides)  # large weights: scores far from uniform, options matter
    model = port(hf)
    assert model.config.scale_attn_by_inverse_layer_idx == overrides.get("scale_attn_by_inverse_layer_idx", False)
    assert model.config.upcast_attn == overrides.get("reorder_and_upcast_attn", False)
    ids = _ids()
    ours = _logits(model, ids)
    np.testing.assert_allclose(ours, hf_logits(hf, ids), atol=TOL, rtol=0)
    # the option changes the model: the same weights without it give other logits
    if "reorder_and_upcast_attn" not in overrides:  # upcasting is a no-op in float32
        plain = port(hf, scale_attn_by_inverse_layer_idx=False, scale_attn_weights=True)
        assert np.abs(_logits(plain, ids) - ours).max() > 1e-3


def test_hf_config_round_trip_with_options() -> None:
    cfg = Gpt2Config(
        seq_len=16,
        hidden_dim=32,
        intermediate_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        embed_pdrop=0.1,
        resid_pdrop=0.2,
        attn_pdrop=0.3,
        scale_attn_weights=False,
        scale_attn_by_inverse_layer_idx=True,
        upcast_attn=True,
    )
    hf = cfg.to_hf_config(97)
    assert (hf["embd_pdrop"], hf["resid_pdrop"], hf["attn_pdrop"]) == (0.1, 0.2, 0.3)
    assert hf["scale_attn_by_inverse_layer_idx"]
    assert hf["reorder_and_upcast_attn"]
    assert not hf["scale_attn_weights"]
    assert Gpt2Config.from_hf_config(hf) == cfg


def _dropout_model(**pdrops: float) -> Any:
    cfg = Gpt2Config(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2, num_kv_heads=2)
    return dataclasses.replace(cfg, **pdrops).build(hax.Axis("vocab", 13), key=jax.random.key(0))


@pytest.mark.parametrize("which", ["embed_pdrop", "resid_pdrop", "attn_pdrop"])
def test_each_dropout_is_applied_only_with_a_key(which: str) -> None:
    ids = _ids(8, vocab=13)
    model = _dropout_model(**{which: 0.3})
    assert np.abs(_logits(model, ids, jax.random.key(1)) - _logits(model, ids)).max() > 1e-3


def test_dropout_keys_and_zero_rates() -> None:
    ids = _ids(8, vocab=13)
    rates = {"embed_pdrop": 0.2, "resid_pdrop": 0.2, "attn_pdrop": 0.2}
    model = _dropout_model(**rates)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    dropped = _logits(model, ids, k1)
    np.testing.assert_array_equal(_logits(model, ids, k1), dropped)  # same key, same masks
    assert np.abs(_logits(model, ids, k2) - dropped).max() > 1e-3  # another key, other masks
    # with p = 0 a key changes nothing (the rates do not change the initialization)
    np.testing.assert_array_equal(_logits(_dropout_model(), ids, k1), _logits(model, ids))


def test_flash_backend_is_wired_and_matches_transformers(tiny_gpt2: Any, hf_logits: Any, port: Any) -> None:
    hf = tiny_gpt2(scale_attn_by_inverse_layer_idx=True, n_layer=3)
    model = port(hf, attn_backend="flash", flash_attention_block_size=4, attn_pdrop=0.0)
    assert model.transformer.h.stacked.attn.config.attn_backend == "flash"
    ids = _ids()
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_config_errors() -> None:
    base = {"seq_len": 8, "hidden_dim": 16, "intermediate_dim": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2}
    with pytest.raises(ValueError, match="attn_pdrop"):
        Gpt2Config(**base, attn_backend="flash", attn_pdrop=0.1)
    with pytest.raises(ValueError, match="resid_pdrop"):
        Gpt2Config(**base, resid_pdrop=1.0)
    with pytest.raises(ValueError, match="attn_backend 'fast'"):
        Gpt2Config(**base, attn_backend="fast")
    with pytest.raises(ValueError, match="more than seq_len=8"):
        Gpt2Config(**base).build(hax.Axis("vocab", 5), key=jax.random.key(0))(hax.zeros({"position": 9}, dtype=int))


def test_gpt2_trains(train_losses: Any) -> None:
    cfg = Gpt2Config(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=4)
    model = cfg.build(hax.Axis("vocab", 50), key=jax.random.key(0))
    losses = train_losses(model, _ids(16, batch=4, vocab=50))
    assert losses[0] == pytest.approx(np.log(50), rel=0.05)  # a fresh model is near uniform
    assert losses[-1] < losses[0] - 0.2, losses
