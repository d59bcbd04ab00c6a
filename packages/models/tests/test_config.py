"""Config registry, axes, parameter count (vs transformers) and FLOPs per token (vs a jaxpr count)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.models import (
    Gpt2Config,
    LlamaConfig,
    LmConfig,
    config_for_type,
    padded_vocab_size,
    register_config,
    registered_types,
)


def test_registry() -> None:
    assert config_for_type("gpt2") is Gpt2Config
    assert config_for_type("llama") is LlamaConfig
    assert {"gpt2", "llama"} <= set(registered_types())
    with pytest.raises(KeyError, match=r"mamba.*known types"):
        config_for_type("mamba")
    with pytest.raises(ValueError, match="already registered"):
        register_config("gpt2")(dataclasses.make_dataclass("Other", [], bases=(Gpt2Config,), frozen=True))


def test_axes_and_validation() -> None:
    cfg = LlamaConfig(seq_len=8, hidden_dim=32, intermediate_dim=64, num_layers=3, num_heads=4, num_kv_heads=2)
    assert (cfg.Pos, cfg.KeyPos) == (hax.Axis("position", 8), hax.Axis("key_position", 8))
    assert (cfg.Embed.size, cfg.Heads.size, cfg.KVHeads.size, cfg.HeadSize.size) == (32, 4, 2, 8)
    assert (cfg.Mlp.size, cfg.Layers.size, cfg.QHeadsPerGroup.size) == (64, 3, 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        Gpt2Config(num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize(
    "cfg",
    [
        Gpt2Config(seq_len=16, hidden_dim=32, intermediate_dim=128, num_layers=2, num_heads=4, num_kv_heads=4),
        LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2),
        LlamaConfig(
            seq_len=16,
            hidden_dim=32,
            intermediate_dim=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=1,
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ],
)
def test_param_count_and_hf_config_round_trip(cfg: LmConfig, tiny_gpt2: Any, tiny_llama: Any) -> None:
    import transformers

    hf_dict = cfg.to_hf_config(97)
    assert type(cfg).from_hf_config(hf_dict) == cfg
    hf_cls = transformers.GPT2Config if isinstance(cfg, Gpt2Config) else transformers.LlamaConfig
    keys = {k: v for k, v in hf_dict.items() if k not in ("architectures", "model_type")}
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_cls(**keys))
    unique = {id(p): p.numel() for p in hf_model.parameters()}  # tied weights counted once
    assert cfg.param_count(97) == sum(unique.values())


def _dot_flops(jaxpr: Any) -> float:
    """2 * (output elements) * (contracted elements) over every dot_general, recursing into scans (times length)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * np.prod(out) * np.prod([lhs[d] for d in lhs_contract])
        if eqn.primitive.name == "scan":
            total += eqn.params["length"] * _dot_flops(eqn.params["jaxpr"].jaxpr)
        elif "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            total += _dot_flops(getattr(inner, "jaxpr", inner))
        elif "call_jaxpr" in eqn.params:
            inner = eqn.params["call_jaxpr"]
            total += _dot_flops(getattr(inner, "jaxpr", inner))
    return total


@pytest.mark.parametrize(
    "cfg",
    [
        Gpt2Config(seq_len=16, hidden_dim=32, intermediate_dim=128, num_layers=3, num_heads=4, num_kv_heads=4),
        LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2),
        LlamaConfig(
            seq_len=16,
            hidden_dim=32,
            intermediate_dim=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            vocab_padding_multiple=64,
            qk_norm=True,
        ),
    ],
)
def test_flops_per_token_matches_counted_matmuls(cfg: LmConfig) -> None:
    Vocab = hax.Axis("vocab", 97)
    model = cfg.build(Vocab, key=jax.random.key(0))
    ids = hax.zeros(cfg.Pos, dtype=int)
    jaxpr = jax.make_jaxpr(lambda m: m(ids).array)(model)
    counted = _dot_flops(jaxpr.jaxpr) / cfg.seq_len
    assert cfg.flops_per_token(97) == pytest.approx(counted, rel=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 4096))
def test_padded_vocab_size_is_the_next_multiple(vocab_size: int, multiple: int) -> None:
    padded = padded_vocab_size(vocab_size, multiple)
    assert padded % multiple == 0
    assert vocab_size <= padded < vocab_size + multiple
    # naive reference: count up
    naive = vocab_size
    while naive % multiple:
        naive += 1
    assert padded == naive


def test_padding_and_backend_fields() -> None:
    base = {"seq_len": 8, "hidden_dim": 16, "intermediate_dim": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2}
    cfg = LlamaConfig(**base, vocab_padding_multiple=8)
    assert cfg.padded_vocab(hax.Axis("vocab", 11)) == hax.Axis("vocab", 16)
    assert cfg.param_count(11) == LlamaConfig(**base).param_count(16)
    assert cfg.flops_per_token(11) == LlamaConfig(**base).flops_per_token(16)
    assert (LlamaConfig(**base).attn_backend, LlamaConfig(**base).flash_attention_block_size) == ("auto", 128)
    with pytest.raises(ValueError, match="vocab_padding_multiple"):
        LlamaConfig(**base, vocab_padding_multiple=0)
    with pytest.raises(ValueError, match=r"attn_backend 'splash'.*reference"):
        LlamaConfig(**base, attn_backend="splash")
    with pytest.raises(ValueError, match="flash_attention_block_size"):
        Gpt2Config(**base, flash_attention_block_size=0)
    with pytest.raises(ValueError, match="multiple=0"):
        padded_vocab_size(5, 0)


def test_register_aliases() -> None:
    @register_config("m2_test_primary", aliases=("m2_test_alias",))
    @dataclasses.dataclass(frozen=True)
    class AliasConfig(LlamaConfig):
        pass

    assert config_for_type("m2_test_alias") is AliasConfig
    assert config_for_type("m2_test_primary") is AliasConfig
    assert AliasConfig.model_type == "m2_test_primary"
    assert "m2_test_primary" in registered_types()
    assert "m2_test_alias" not in registered_types()
    other = dataclasses.make_dataclass("OtherAlias", [], bases=(LlamaConfig,), frozen=True)
    with pytest.raises(ValueError, match=r"'m2_test_alias' is already registered to .*AliasConfig"):
        register_config("m2_test_fresh", aliases=("m2_test_alias",))(other)
    with pytest.raises(KeyError, match="m2_test_fresh"):
        config_for_type("m2_test_fresh")  # a failed registration registers nothing


def test_flops_per_token_honours_sliding_windows() -> None:
    from ponente.models import Gemma2Config, MistralConfig, QwenConfig

    sizes = {"seq_len": 16, "hidden_dim": 16, "intermediate_dim": 32, "num_layers": 2, "num_heads": 2}
    # counted by hand, per token: Q/K/V/O 2*16*(16+2*8) + 2*16*16 = 1536; gated MLP 2*16*32*3 = 3072 (both per
    # layer); attention 2*2*keys*16 per layer, keys = 4 in a window of 4, 16 for full attention; head 2*16*10 = 320
    gemma = Gemma2Config(**sizes, num_kv_heads=1, head_dim=8, sliding_window=4)  # layers: sliding, full
    assert gemma.attention_windows() == (4, None)
    assert gemma.flops_per_token(10) == 2 * (1536 + 3072) + 4 * 4 * 16 + 4 * 16 * 16 + 320
    assert Gemma2Config(**sizes, num_kv_heads=1, head_dim=8, sliding_window=None).flops_per_token(10) == (
        2 * (1536 + 3072) + 2 * 4 * 16 * 16 + 320
    )
    mistral = MistralConfig(**sizes, num_kv_heads=1, sliding_window=4)
    assert mistral.flops_per_token(10) == 2 * (1536 + 3072) + 2 * 4 * 4 * 16 + 320
    # a window longer than the sequence counts the sequence
    assert MistralConfig(**sizes, num_kv_heads=1, sliding_window=64).flops_per_token(10) == (
        MistralConfig(**sizes, num_kv_heads=1, sliding_window=None).flops_per_token(10)
    )
    qwen = QwenConfig(**sizes, num_kv_heads=1, sliding_window=2, layer_types=("full_attention", "sliding_attention"))
    assert qwen.attention_windows() == (None, 2)
    assert qwen.flops_per_token(10) == 2 * (1536 + 3072) + 4 * 16 * 16 + 4 * 2 * 16 + 320
