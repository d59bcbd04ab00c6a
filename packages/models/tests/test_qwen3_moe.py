"""Qwen3-MoE: logits, routing and aux loss vs transformers, HF files both ways, greedy decoding through the KV
cache vs ``generate``, LoRA, and the config's checks; with experts in every block, or dense MLPs in some
(``mlp_only_layers``, ``decoder_sparse_step``)."""

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
from parity_support import port

import ponente.namedtensor as hax
from ponente.models import Qwen3MoeConfig, Qwen3MoeLMHeadModel, config_for_type
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4
VOCAB = 61


def _tiny(**overrides: Any) -> Any:
    """A random transformers Qwen3-MoE (float32, eager attention) with perturbed norm scales."""
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
        "hidden_size": 32,
        "intermediate_size": 40,
        "moe_intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "initializer_range": 0.2,
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def _ids(seq: int = 12, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, size=(batch, seq))


def _named(ids: np.ndarray, axes: tuple[str, ...] = ("batch", "position")) -> hax.NamedArray:
    return hax.named(jnp.asarray(ids), axes)


CASES: list[dict[str, Any]] = [
    {},  # norm_topk_prob false (transformers' default), untied
    {"norm_topk_prob": True, "tie_word_embeddings": True, "num_experts_per_tok": 1, "num_key_value_heads": 4},
    {"norm_topk_prob": True, "num_experts": 8, "num_experts_per_tok": 3, "num_hidden_layers": 3},
    {"use_sliding_window": True, "sliding_window": 4},
    {"num_hidden_layers": 5, "mlp_only_layers": [0, 3]},  # dense, moe, moe, dense, moe
]


@pytest.fixture(scope="module", params=range(len(CASES)), ids=lambda i: f"case{i}")
def pair(request: pytest.FixtureRequest) -> tuple[Any, Qwen3MoeLMHeadModel]:
    torch.manual_seed(request.param)
    hf = _tiny(**CASES[request.param])
    return hf, port(hf)


def test_logits_routing_and_aux_loss_match_transformers(pair: tuple[Any, Qwen3MoeLMHeadModel]) -> None:
    hf, model = pair
    assert isinstance(model, Qwen3MoeLMHeadModel)
    ids = _ids()
    with torch.no_grad():
        out = hf(torch.tensor(ids), output_router_logits=True)
    np.testing.assert_allclose(np.asarray(model(_named(ids)).array), out.logits.numpy(), atol=TOL, rtol=0)
    sparse = port(hf, moe_dispatch="sorted")
    np.testing.assert_allclose(np.asarray(sparse(_named(ids)).array), out.logits.numpy(), atol=TOL, rtol=0)
    k = hf.config.num_experts_per_tok
    routing = model.routing(_named(ids))
    assert routing.indices.resolve_axis("layers").size == len(out.router_logits)  # the MoE blocks only
    for layer in range(len(out.router_logits)):
        probs = torch.softmax(out.router_logits[layer].float(), -1)
        top, chosen = torch.topk(probs, k, dim=-1)
        if hf.config.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        np.testing.assert_array_equal(np.asarray(routing.indices.array[layer]).reshape(-1, k), chosen.numpy())
        np.testing.assert_allclose(np.asarray(routing.weights.array[layer]).reshape(-1, k), top.numpy(), atol=1e-5)
    _, aux = model.logits_and_aux(_named(ids))
    expected = float(out.aux_loss) * hf.config.router_aux_loss_coef
    np.testing.assert_allclose(float(aux["router_aux_loss"].scalar()), expected, rtol=1e-5)


def test_greedy_decoding_through_the_cache_equals_transformers_generate(
    pair: tuple[Any, Qwen3MoeLMHeadModel],
) -> None:
    hf, model = pair
    prompts = np.random.RandomState(1).randint(0, VOCAB, size=(2, 5))
    hf.generation_config.eos_token_id = None
    new = 8
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            do_sample=False,
            max_new_tokens=new,
            pad_token_id=0,
        )[:, prompts.shape[1] :].numpy()
    decode = jax.jit(lambda m, t, c, p: m.decode(t, c, p))
    cache = model.init_cache(hax.Axis("batch", 2), prompts.shape[1] + new)
    logits, cache = decode(model, _named(prompts), cache, _named(np.arange(5), ("position",)))
    got = []
    token = np.asarray(jnp.argmax(logits.array[:, -1], axis=-1))
    for step in range(new):
        got.append(token)
        logits, cache = decode(model, _named(token[:, None]), cache, _named(np.array([5 + step]), ("position",)))
        token = np.asarray(jnp.argmax(logits.array[:, 0], axis=-1))
    np.testing.assert_array_equal(np.stack(got, axis=1), expected)


# decoder_sparse_step 2 over 3 layers: dense, moe, dense
@pytest.mark.parametrize("overrides", [{}, {"num_hidden_layers": 3, "decoder_sparse_step": 2}], ids=["moe", "mixed"])
def test_hf_files_both_ways(tmp_path: Path, overrides: dict[str, Any]) -> None:
    torch.manual_seed(7)
    hf = _tiny(norm_topk_prob=True, **overrides)
    ids = _ids(seed=2)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    hf.save_pretrained(tmp_path / "from_hf")  # per-expert checkpoint files
    loaded = load_pretrained(tmp_path / "from_hf")
    assert isinstance(loaded, Qwen3MoeLMHeadModel)
    np.testing.assert_allclose(np.asarray(loaded(_named(ids)).array), expected, atol=TOL, rtol=0)
    save_pretrained(loaded, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager")
    assert isinstance(reloaded, transformers.Qwen3MoeForCausalLM)
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.tensor(ids)).logits.numpy(), expected, atol=TOL, rtol=0)
    assert Qwen3MoeConfig.from_hf_config(loaded.config.to_hf_config(VOCAB)) == loaded.config
    state = loaded.to_hf_state_dict()
    assert set(state) == set(hf.state_dict()) - {k for k in hf.state_dict() if ".mlp.experts." in k} | {
        k for k in state if ".mlp.experts." in k
    }
    assert state["model.layers.1.mlp.experts.3.gate_proj.weight"].shape == (24, 32)
    assert state["model.layers.1.mlp.gate.weight"].shape == (4, 32)
    if overrides:
        assert state["model.layers.2.mlp.gate_proj.weight"].shape == (40, 32)  # a dense block
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(KeyError, match=r"layers\.1\.mlp\.experts\.2\.up_proj"):
        loaded.from_hf_state_dict(state)


def test_lora_adapts_the_attention_and_starts_as_the_base(pair: tuple[Any, Qwen3MoeLMHeadModel]) -> None:
    from ponente.models.lora import LoraConfig, lora_trainable_filter, loraize, merge_lora

    _, model = pair
    adapted = loraize(model, LoraConfig(r=4), key=jax.random.key(0))
    trainable = lora_trainable_filter(adapted)
    n = sum(
        int(np.size(x))
        for x in jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda t, x: x if t else None, trainable, adapted))
    )
    assert 0 < n < sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(model))
    ids = _named(_ids(seed=3))
    np.testing.assert_allclose(np.asarray(adapted(ids).array), np.asarray(model(ids).array), atol=1e-5)
    np.testing.assert_allclose(np.asarray(merge_lora(adapted)(ids).array), np.asarray(model(ids).array), atol=1e-5)


def test_config_checks_and_flops() -> None:
    base = {
        "seq_len": 8,
        "hidden_dim": 16,
        "intermediate_dim": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 4,
    }
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3MoeConfig(**base, num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match=r"mlp_only_layers must be in 0\.\.num_layers - 1 \(1\), got \[2\]"):
        Qwen3MoeConfig(**base, mlp_only_layers=(2,))
    with pytest.raises(ValueError, match=r"decoder_sparse_step=3, mlp_only_layers=\[\] leave no block with experts"):
        Qwen3MoeConfig.from_hf_config({**Qwen3MoeConfig(**base).to_hf_config(11), "decoder_sparse_step": 3})
    with pytest.raises(ValueError, match="decoder_sparse_step must be >= 1"):
        Qwen3MoeConfig(**base, decoder_sparse_step=0)
    with pytest.raises(ValueError, match="moe_dispatch"):
        Qwen3MoeConfig(**base, moe_dispatch="gather")
    assert config_for_type("qwen3_moe") is Qwen3MoeConfig
    cfg = Qwen3MoeConfig(**base, num_experts=4, num_experts_per_tok=2, moe_intermediate_dim=8)
    # per layer: q (16 -> 4x4), k and v (16 -> 2x4), o; scores and values over 8 positions; router; 2 experts
    per_layer = 2 * 16 * 16 + 2 * 2 * 16 * 8 + 2 * 16 * 16 + 4 * 8 * 16 + 2 * 16 * 4 + 2 * 3 * 16 * 8 * 2
    assert cfg.flops_per_token(11) == 2 * per_layer + 2 * 16 * 11
    # a dense block instead: the SwiGLU of intermediate_dim 32, no router
    mixed = dataclasses.replace(cfg, mlp_only_layers=(0,))
    assert mixed.dense_layers() == (True, False)
    dense_layer = per_layer - 2 * 16 * 4 - 2 * 3 * 16 * 8 * 2 + 2 * 3 * 16 * 32
    assert mixed.flops_per_token(11) == per_layer + dense_layer + 2 * 16 * 11
    assert dataclasses.replace(cfg, num_layers=4, decoder_sparse_step=2).dense_layers() == (True, False, True, False)
    assert dataclasses.replace(cfg, norm_topk_prob=True) != cfg
