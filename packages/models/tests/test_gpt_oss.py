"""gpt-oss: logits, routing and aux loss vs transformers, HF files both ways, greedy decoding through the KV cache
vs ``generate``, LoRA, attention sinks on the backends, and the config's checks."""

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
from parity_support import port

import ponente.namedtensor as hax
from ponente.models import GptOssConfig, GptOssLMHeadModel, config_for_type
from ponente.models.attention import AttentionMask, attention
from ponente.models.attention.backends import AttentionCall, auto_backend
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4
VOCAB = 61


def _yarn(**overrides: Any) -> dict[str, Any]:
    """YaRN rope parameters scaled for tiny sequences (the ramp falls inside a small head)."""
    params = {
        "rope_type": "yarn",
        "rope_theta": 1000.0,
        "factor": 4.0,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 16,
        "truncate": False,
    }
    return {**params, **overrides}


def _tiny(**overrides: Any) -> Any:
    """A random transformers gpt-oss (float32, eager attention) with perturbed norm scales, biases and sinks."""
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "initializer_range": 0.2,
        "rope_parameters": _yarn(),
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name:
                param.add_(0.5 * torch.randn_like(param))
    return model


def _ids(seq: int = 12, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, size=(batch, seq))


def _named(ids: np.ndarray, axes: tuple[str, ...] = ("batch", "position")) -> hax.NamedArray:
    return hax.named(jnp.asarray(ids), axes)


CASES: list[dict[str, Any]] = [
    {},  # alternating sliding/full layers, GQA, YaRN without truncation, untied
    {  # MHA, 8 experts, top-3, head size 16, truncated YaRN, mixed layer types, tied embeddings
        "num_key_value_heads": 4,
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 3,
        "num_hidden_layers": 3,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "sliding_window": 3,
        "rope_parameters": _yarn(truncate=True, beta_fast=4.0, factor=2.0, original_max_position_embeddings=32),
        "tie_word_embeddings": True,
    },
    {  # groups of 3 query heads, head size 4, top-1 of 5 experts, full attention only, default rope, no biases
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "num_local_experts": 5,
        "num_experts_per_tok": 1,
        "layer_types": ["full_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
    },
]


@eqx.filter_jit
def _forward(model: GptOssLMHeadModel, ids: hax.NamedArray) -> Any:
    logits, aux = model.logits_and_aux(ids)
    return logits, aux, model.routing(ids)


@eqx.filter_jit
def _decode(model: GptOssLMHeadModel, tokens: hax.NamedArray, cache: Any, pos: hax.NamedArray) -> Any:
    return model.decode(tokens, cache, pos)


@pytest.fixture(scope="module", params=range(len(CASES)), ids=lambda i: f"case{i}")
def pair(request: pytest.FixtureRequest) -> tuple[Any, GptOssLMHeadModel]:
    torch.manual_seed(request.param)
    hf = _tiny(**CASES[request.param])
    return hf, port(hf)


def test_logits_routing_and_aux_loss_match_transformers(pair: tuple[Any, GptOssLMHeadModel]) -> None:
    hf, model = pair
    assert isinstance(model, GptOssLMHeadModel)
    ids = _ids()
    with torch.no_grad():
        out = hf(torch.tensor(ids), output_router_logits=True)
    logits, aux, routing = _forward(model, _named(ids))
    np.testing.assert_allclose(np.asarray(logits.array), out.logits.numpy(), atol=TOL, rtol=0)
    k = hf.config.num_experts_per_tok
    for layer in range(hf.config.num_hidden_layers):
        top, chosen = torch.topk(out.router_logits[layer].float(), k, dim=-1)
        np.testing.assert_array_equal(np.asarray(routing.indices.array[layer]).reshape(-1, k), chosen.numpy())
        weights = torch.softmax(top, dim=-1).numpy()
        np.testing.assert_allclose(np.asarray(routing.weights.array[layer]).reshape(-1, k), weights, atol=1e-5)
    expected = float(out.aux_loss) * hf.config.router_aux_loss_coef
    np.testing.assert_allclose(float(aux["router_aux_loss"].scalar()), expected, rtol=1e-5)
    # the sinks (and sliding windows) through the blockwise kernel, tiles of 4
    flash = port(hf, attn_backend="flash", flash_attention_block_size=4)
    np.testing.assert_allclose(np.asarray(_forward(flash, _named(ids))[0].array), out.logits.numpy(), atol=TOL, rtol=0)


def test_sorted_dispatch_matches_transformers() -> None:
    torch.manual_seed(11)
    hf = _tiny(num_local_experts=6, num_experts_per_tok=3)
    ids = _ids(seed=4)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    sparse = port(hf, moe_dispatch="sorted")
    np.testing.assert_allclose(np.asarray(_forward(sparse, _named(ids))[0].array), expected, atol=TOL, rtol=0)


def test_greedy_decoding_through_the_cache_equals_transformers_generate(
    pair: tuple[Any, GptOssLMHeadModel],
) -> None:
    hf, model = pair
    prompts = np.random.RandomState(1).randint(0, VOCAB, size=(2, 5))
    hf.generation_config.eos_token_id = None
    new = 8  # 13 positions: past every sliding window
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            do_sample=False,
            max_new_tokens=new,
            pad_token_id=0,
        )[:, prompts.shape[1] :].numpy()
    # the prefill goes through the forward's attention (with sinks), the steps through the cache's
    cache = model.init_cache(hax.Axis("batch", 2), prompts.shape[1] + new).for_prefill()
    logits, cache = _decode(model, _named(prompts), cache, _named(np.arange(5), ("position",)))
    got = []
    token = np.asarray(jnp.argmax(logits.array[:, -1], axis=-1))
    for step in range(new):
        got.append(token)
        logits, cache = _decode(model, _named(token[:, None]), cache, _named(np.array([5 + step]), ("position",)))
        token = np.asarray(jnp.argmax(logits.array[:, 0], axis=-1))
    np.testing.assert_array_equal(np.stack(got, axis=1), expected)


def test_hf_files_both_ways(tmp_path: Path) -> None:
    torch.manual_seed(7)
    hf = _tiny()
    ids = _ids(seed=2)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    hf.save_pretrained(tmp_path / "from_hf")
    loaded = load_pretrained(tmp_path / "from_hf")
    assert isinstance(loaded, GptOssLMHeadModel)
    np.testing.assert_allclose(np.asarray(_forward(loaded, _named(ids))[0].array), expected, atol=TOL, rtol=0)
    save_pretrained(loaded, tmp_path / "ours")
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(reloaded, transformers.GptOssForCausalLM)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.tensor(ids)).logits.numpy(), expected, atol=1e-5, rtol=0)
    assert GptOssConfig.from_hf_config(loaded.config.to_hf_config(VOCAB)) == loaded.config
    state = loaded.to_hf_state_dict()
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 32, 48)
    assert state["model.layers.0.mlp.router.bias"].shape == (4,)
    assert state["model.layers.0.self_attn.sinks"].shape == (4,)
    del state["model.layers.1.self_attn.sinks"]
    with pytest.raises(KeyError, match=r"layers\.1\.self_attn\.sinks"):
        loaded.from_hf_state_dict(state)
    quantized = {k.replace("gate_up_proj", "gate_up_proj_blocks"): v for k, v in loaded.to_hf_state_dict().items()}
    with pytest.raises(ValueError, match="MXFP4"):
        loaded.from_hf_state_dict(quantized)


def test_lora_adapts_the_attention_and_starts_as_the_base() -> None:
    from ponente.models.lora import LoraConfig, lora_sites, lora_trainable_filter, loraize, merge_lora

    torch.manual_seed(0)
    hf = _tiny(**CASES[0])  # case0's architecture: its forward is already compiled
    model = port(hf)
    adapted = loraize(model, LoraConfig(r=4), key=jax.random.key(0))
    names = {n for site in lora_sites(adapted, adapted=True) for n in site.short_names}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj"}  # not the router; the experts are no linear layers
    trainable = lora_trainable_filter(adapted)
    n = sum(
        int(np.size(x))
        for x in jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda t, x: x if t else None, trainable, adapted))
    )
    assert 0 < n < sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(model))
    ids = _ids(seed=3)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(_forward(adapted, _named(ids))[0].array), expected, atol=TOL, rtol=0)
    merged = merge_lora(adapted)
    np.testing.assert_allclose(np.asarray(_forward(merged, _named(ids))[0].array), expected, atol=TOL, rtol=0)
    only_o = loraize(model, LoraConfig(r=2, target_modules=["o_proj"]), key=jax.random.key(1))
    assert [s.short_names for s in lora_sites(only_o, adapted=True)] == [("o_proj",)]


def test_attention_sinks_only_on_backends_that_compute_them() -> None:
    Pos, Heads, Hd = hax.make_axes(position=6, heads=2, head_size=4)
    q = hax.random.normal(jax.random.key(0), (Pos, Heads, Hd))
    sinks = hax.named(jnp.array([0.5, -1.0]), "heads")
    with pytest.raises(ValueError, match="attention sinks"):
        attention(Pos, Hd, q, q, q, AttentionMask.causal(), backend="xla", sinks=sinks)
    # only the reference and the blockwise kernel compute sinks: auto takes the kernel where it would anyway
    for platform, dtype, seq_len, want in (
        ("cpu", "float32", 4096, "flash"),
        ("cpu", "float32", 128, "reference"),
        ("gpu", "bfloat16", 4096, "reference"),
        ("gpu", "bfloat16", 16384, "flash"),
        ("tpu", "bfloat16", 4096, "reference"),
    ):
        call = AttentionCall(platform, dtype, seq_len=seq_len, head_size=64, sinks=True)
        assert auto_backend(call) == want, (platform, seq_len)
    # a sink of -inf is no sink at all
    plain = attention(Pos, Hd, q, q, q, AttentionMask.causal(), backend="reference")
    none = attention(Pos, Hd, q, q, q, AttentionMask.causal(), sinks=hax.full(Heads, -jnp.inf))
    np.testing.assert_allclose(np.asarray(none.array), np.asarray(plain.array), atol=1e-6)


def _error(fn: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)


def test_config_checks_flops_and_round_trip() -> None:
    base = {
        "seq_len": 8,
        "hidden_dim": 16,
        "intermediate_dim": 8,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "sliding_window": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    cfg = GptOssConfig(**base)
    hf = cfg.to_hf_config(11)
    assert GptOssConfig.from_hf_config(hf) == cfg
    assert config_for_type("gpt_oss") is GptOssConfig
    _error(lambda: GptOssConfig(**base, attn_backend="xla"), "attn_backend")
    _error(lambda: GptOssConfig(**{**base, "num_experts_per_tok": 5}), "num_experts_per_tok")
    _error(lambda: GptOssConfig(**{**base, "sliding_window": None}), "sliding_window")
    _error(lambda: GptOssConfig(**base, qk_norm=True), "qk_norm")
    _error(lambda: GptOssConfig(**base, swiglu_limit=0.0), "swiglu_limit")
    _error(lambda: GptOssConfig(**base, moe_dispatch="gather"), "moe_dispatch")
    _error(lambda: GptOssConfig(**base, router_bias_update_rate=-1.0), "router_bias_update_rate")
    _error(lambda: GptOssConfig(**base, router_metrics_groups=-1), "router_metrics_groups")
    biased = GptOssConfig(**base, router_bias_update_rate=0.01).build(hax.Axis("vocab", 11), key=jax.random.key(0))
    assert biased.transformer.layers.stacked.block_sparse_moe.balance_bias.axis_names == ("layers", "experts")
    _error(lambda: GptOssConfig.from_hf_config({**hf, "attention_dropout": 0.1}), "attention_dropout")
    _error(lambda: GptOssConfig.from_hf_config({**hf, "layer_types": ["full_attention"]}), "layer_types")
    _error(lambda: GptOssConfig.from_hf_config({**hf, "layer_types": ["full_attention", "chunked"]}), "layer_types")
    rope = {**hf["rope_parameters"], "partial_rotary_factor": 0.5}
    _error(lambda: GptOssConfig.from_hf_config({**hf, "rope_parameters": rope}), "partial_rotary_factor")
    rope = {**hf["rope_parameters"], "rope_type": "dynamic"}
    _error(lambda: GptOssConfig.from_hf_config({**hf, "rope_parameters": rope}), "rope_type")
    # transformers' defaults: YaRN (factor 32, theta 150000, no truncation) and alternating layers
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    minimal = {k: hf[k] for k in keys}
    default = GptOssConfig.from_hf_config(minimal)
    hf_default = transformers.GptOssConfig(**minimal)
    assert default.rope.to_hf() == {k: v for k, v in hf_default.rope_parameters.items() if v is not None}
    assert default.resolved_layer_types() == tuple(hf_default.layer_types)
    assert (default.sliding_window, default.num_experts, default.intermediate_dim) == (128, 128, 2880)
    assert (default.HeadSize.size, default.seq_len, default.layer_norm_epsilon) == (64, 131072, 1e-5)
    # per layer: q (16 -> 4x4), k and v (16 -> 2x4), o; scores and values over 8 positions (4 on the sliding
    # layer); router; 2 experts
    attn = 2 * 16 * 16 + 2 * 2 * 16 * 8 + 2 * 16 * 16
    experts = 2 * 16 * 4 + 2 * 3 * 16 * 8 * 2
    per_layer = [attn + 4 * window * 16 + experts for window in (4, 8)]
    assert cfg.flops_per_token(11) == sum(per_layer) + 2 * 16 * 11
