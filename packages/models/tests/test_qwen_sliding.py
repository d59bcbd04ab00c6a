"""Qwen2/Qwen3 with a sliding window on some layers only: logits vs transformers (eager, float32), the window matters,
both ``config.json`` spellings (``layer_types``, ``max_window_layers``), HF round trips, flash vs reference, errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from parity_support import logits as _logits
from parity_support import random_ids

import ponente.namedtensor as hax
from ponente.models import AttentionMask, Qwen3Config, Qwen3LMHeadModel, QwenConfig, QwenLMHeadModel
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4
VOCAB = 53
S, F = "sliding_attention", "full_attention"

# per family: our config class, our model class, transformers' config and model classes
FAMILIES: dict[str, tuple[Any, Any, Any, Any]] = {
    "qwen2": (QwenConfig, QwenLMHeadModel, transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3LMHeadModel, transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def _hf(family: str, **overrides: Any) -> Any:
    """A tiny transformers Qwen2/Qwen3 (eager attention) with random weights, biases and norm scales included."""
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attn_implementation": "eager",
    }
    if family == "qwen3":
        kwargs["head_dim"] = 8
    kwargs.update(overrides)
    _, _, hf_config_cls, hf_model_cls = FAMILIES[family]
    model = hf_model_cls(hf_config_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model


def _random_model(cfg: Any) -> Any:
    """A model of ``cfg`` with random weights everywhere (biases and norm scales are not left at 0 and 1)."""
    model = cfg.build(hax.Axis("vocab", VOCAB), key=jax.random.key(5))
    rng = np.random.RandomState(0)
    state = {k: v + 0.1 * rng.randn(*v.shape).astype(v.dtype) for k, v in model.to_hf_state_dict().items()}
    return model.from_hf_state_dict(state)


# (family, transformers overrides): some but not all layers slide; the sequences (14) are longer than the windows
MIXED = [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "layer_types": [F, S, F]}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),  # transformers-4 spelling
    ("qwen3", {"use_sliding_window": True, "sliding_window": 3, "layer_types": [S, F, S]}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2, "attention_bias": True}),
]


@pytest.mark.parametrize(("family", "overrides"), MIXED)
def test_mixed_layers_match_transformers_and_the_window_matters(
    family: str, overrides: dict[str, Any], port: Any, hf_logits: Any
) -> None:
    hf = _hf(family, **overrides)
    kinds = list(hf.config.layer_types)
    assert set(kinds) == {S, F}  # really mixed
    model = port(hf)
    assert isinstance(model, FAMILIES[family][1])
    assert model.config.layer_types == tuple(kinds)
    assert model.config.sliding_window == overrides["sliding_window"]
    ids = random_ids(14, 2, vocab=VOCAB, seed=1)
    expected = hf_logits(hf, ids)
    np.testing.assert_allclose(_logits(model, ids), expected, atol=TOL, rtol=0)
    # the same weights with every layer sliding, or none: the per-layer choice is what the match above checks
    every_layer_slides = port(hf, layer_types=None)
    no_layer_slides = port(hf, layer_types=None, sliding_window=None)
    assert np.abs(_logits(every_layer_slides, ids) - expected).max() > 1e-2
    assert np.abs(_logits(no_layer_slides, ids) - expected).max() > 1e-2


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_flash_backend_matches_reference_with_mixed_layers(family: str, port: Any) -> None:
    hf = _hf(family, use_sliding_window=True, sliding_window=3, layer_types=[S, F, S])
    reference = port(hf)
    flash = port(hf, attn_backend="flash", flash_attention_block_size=4)
    attn = flash.transformer.layers.stacked.self_attn
    assert getattr(attn, "attn", attn).backend == "flash"  # Qwen3's QK-norm attention wraps an Attention
    ids = random_ids(16, 2, vocab=VOCAB, seed=2)
    np.testing.assert_allclose(_logits(flash, ids), _logits(reference, ids), atol=1e-5, rtol=0)
    # packed documents: segment ids combine with the window on sliding layers
    seg = hax.named(jnp.asarray([[0] * 7 + [1] * 9, [0] * 16]), ("batch", "position"))
    mask = AttentionMask.causal().with_segment_ids(seg)
    np.testing.assert_allclose(_logits(flash, ids, mask), _logits(reference, ids, mask), atol=1e-5, rtol=0)


def test_explicit_boolean_mask_equals_structured_mask(port: Any) -> None:
    hf = _hf("qwen2", use_sliding_window=True, sliding_window=3, layer_types=[S, S, F])
    model = port(hf)
    Pos = hax.Axis("position", 12)
    seg = hax.named(jnp.asarray([[0] * 5 + [1] * 7, [0] * 12]), ("batch", "position"))
    structured = AttentionMask.causal().with_segment_ids(seg)
    explicit = structured.materialize(Pos, Pos.alias("key_position"))
    ids = random_ids(12, 2, vocab=VOCAB, seed=3)
    # an independent reference: each document alone through transformers
    first = _logits(model, ids, structured)
    np.testing.assert_allclose(_logits(model, ids, explicit), first, atol=1e-5, rtol=0)
    with torch.no_grad():
        alone = hf(torch.tensor(ids[:1, 5:])).logits.float().numpy()
    np.testing.assert_allclose(first[:1, 5:], alone, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hf_round_trip_keeps_layer_types(family: str, tmp_path: Path, hf_logits: Any) -> None:
    config_cls, model_cls, _, hf_model_cls = FAMILIES[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}  # not hidden_dim / num_heads, so it is kept
    cfg = config_cls(
        seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=3, num_heads=4, num_kv_heads=2,
        sliding_window=3, layer_types=(S, F, S), **extra,
    )  # fmt: skip
    model = _random_model(cfg)
    save_pretrained(model, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert isinstance(hf, hf_model_cls)
    assert list(hf.config.layer_types) == [S, F, S]
    assert hf.config.sliding_window == 3
    ids = random_ids(16, 2, vocab=VOCAB, seed=4)
    np.testing.assert_allclose(_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)
    hf.save_pretrained(tmp_path / "hf")
    again = load_pretrained(tmp_path / "hf")
    assert isinstance(again, model_cls)
    assert again.config == cfg


def _hf_reading(family: str, hf_dict: dict[str, Any]) -> tuple[int | None, list[str]]:
    """How transformers itself reads a ``config.json`` dict: (window, layer types)."""
    hf_config_cls = FAMILIES[family][2]
    keys = {k: v for k, v in hf_dict.items() if k not in ("architectures", "model_type")}
    cfg = hf_config_cls(**keys)
    return cfg.sliding_window, list(cfg.layer_types)


@settings(max_examples=40, deadline=None)
@given(
    family=st.sampled_from(["qwen2", "qwen3"]),
    kinds=st.lists(st.sampled_from([S, F]), min_size=1, max_size=5),
    window=st.integers(1, 9),
    implicit=st.booleans(),
)
def test_config_round_trips_and_agrees_with_transformers(
    family: str, kinds: list[str], window: int, implicit: bool
) -> None:
    config_cls = FAMILIES[family][0]
    n = len(kinds)
    if implicit:  # layer_types=None: every layer slides (with a window) or none (without)
        cases = [config_cls(num_layers=n, sliding_window=window), config_cls(num_layers=n)]
    else:
        cases = [config_cls(num_layers=n, sliding_window=window, layer_types=tuple(kinds))]
    for cfg in cases:
        hf = cfg.to_hf_config(VOCAB)
        # comes back exactly, but for an explicit all-sliding layer_types, which reads as its implicit spelling
        all_slide = set(cfg.resolved_layer_types()) == {S}
        assert config_cls.from_hf_config(hf) == (dataclasses.replace(cfg, layer_types=None) if all_slide else cfg)
        assert _hf_reading(family, hf) == (cfg.sliding_window, list(cfg.resolved_layer_types()))
        # the transformers-4 spelling (no layer_types) is exact when the sliding layers are the last ones
        types = cfg.resolved_layer_types()
        tf4 = {k: v for k, v in hf.items() if k != "layer_types"}
        if list(types) == sorted(types, key=lambda t: t == S):
            assert config_cls.from_hf_config(tf4).resolved_layer_types() == types
            assert _hf_reading(family, tf4)[1] == list(types)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_layer_types_take_precedence_and_defaults_follow_transformers(family: str) -> None:
    config_cls = FAMILIES[family][0]
    hf = config_cls(num_layers=4).to_hf_config(VOCAB)
    # layer_types wins over max_window_layers
    both = {**hf, "use_sliding_window": True, "sliding_window": 2, "max_window_layers": 3, "layer_types": [S, F, F, S]}
    assert config_cls.from_hf_config(both).resolved_layer_types() == (S, F, F, S)
    assert _hf_reading(family, both)[1] == [S, F, F, S]
    # transformers-4 spelling without max_window_layers: the default 28 keeps all 4 layers full
    tf4 = {k: v for k, v in hf.items() if k not in ("layer_types", "max_window_layers")}
    tf4.update(use_sliding_window=True, sliding_window=2)
    assert config_cls.from_hf_config(tf4).resolved_layer_types() == (F,) * 4 == tuple(_hf_reading(family, tf4)[1])
    # no use_sliding_window: no window, whatever sliding_window and max_window_layers say
    off = {**tf4, "use_sliding_window": False, "max_window_layers": 0}
    read = config_cls.from_hf_config(off)
    assert (read.sliding_window, read.layer_types) == (None, None)
    assert _hf_reading(family, off) == (None, [F] * 4)
    # a missing sliding_window means transformers' default, 4096
    default_window = {k: v for k, v in tf4.items() if k != "sliding_window"}
    assert config_cls.from_hf_config({**default_window, "max_window_layers": 0}).sliding_window == 4096


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_errors_name_the_key(family: str) -> None:
    config_cls = FAMILIES[family][0]
    name = config_cls.__name__
    with pytest.raises(ValueError, match=f"{name}: layer_types has 2 entries but num_layers is 3"):
        config_cls(num_layers=3, sliding_window=4, layer_types=(S, F))
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        config_cls(num_layers=2, sliding_window=4, layer_types=(S, "chunked_attention"))
    with pytest.raises(ValueError, match=r"layer_types marks layers \[1\] as 'sliding_attention' but sliding_window"):
        config_cls(num_layers=2, layer_types=(F, S))
    hf = config_cls(num_layers=2, sliding_window=4, layer_types=(F, S)).to_hf_config(VOCAB)
    where = f"{name}.from_hf_config"
    with pytest.raises(ValueError, match=f"{where}: layer_types has 3 entries but num_layers is 2"):
        config_cls.from_hf_config({**hf, "layer_types": [S, F, S]})
    with pytest.raises(ValueError, match=rf"{where}: layer_types \['global'\] are not supported"):
        config_cls.from_hf_config({**hf, "layer_types": [S, "global"]})
    with pytest.raises(ValueError, match=r"marks layers \[1\] .* no window \(use_sliding_window=False"):
        config_cls.from_hf_config({**hf, "use_sliding_window": False})


def test_mixed_stack_equals_its_layers_run_one_by_one() -> None:
    base = QwenConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
    assert dataclasses.replace(base, sliding_window=3).resolved_layer_types() == (S, S)  # implicit: all slide
    assert base.resolved_layer_types() == (F, F)
    model = _random_model(dataclasses.replace(base, sliding_window=3, layer_types=(F, S)))
    ids = random_ids(8, 2, vocab=VOCAB, seed=6)

    @eqx.filter_jit
    def one_by_one(model: Any, ids: hax.NamedArray) -> hax.NamedArray:
        # a second code path: no scan, no per-layer flag, each layer given its own mask
        first, second = model.transformer.layers.unstacked()
        full, window = AttentionMask.causal(), AttentionMask.causal(3)
        x, _, _ = first(model.transformer.embed_tokens.embed(ids), full, full, False, window=None)
        x, _, _ = second(x, window, window, True, window=3)
        return model.lm_head(model.transformer.norm(x))

    expected = one_by_one(model, hax.named(jnp.asarray(ids), ("batch", "position")))
    np.testing.assert_allclose(_logits(model, ids), np.asarray(expected.array), atol=1e-5, rtol=0)
