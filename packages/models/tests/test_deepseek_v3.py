"""DeepSeek-V3: logits vs transformers over varied MLA/MoE configs, the router vs transformers', HF files both ways,
greedy decoding through the latent KV cache vs ``generate``, LoRA, and the config's checks."""

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
from parity_support import port

import ponente.namedtensor as hax
from ponente.models import DeepseekV3Config, DeepseekV3LMHeadModel, config_for_type
from ponente.models.deepseek_v3 import _absorb_pays, route_grouped_sigmoid
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4
VOCAB = 61

BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 12,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 12,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 6,
    "initializer_range": 0.2,
    "num_nextn_predict_layers": 0,
}

CASES: list[dict[str, Any]] = [
    {},  # q and kv ranks, 8 experts in 2 groups (1 chosen), top-2, one dense block first, default rope, interleaved
    {  # no query rank, 2 heads, 4 experts in 1 group, top-1, 2 shared experts, no dense block, YaRN with mscale
        # (softmax scale), rotate-half rope, tied embeddings, unnormalized weights, attention biases
        "q_lora_rank": None,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
        "kv_lora_rank": 8,
        "rope_interleave": False,
        "tie_word_embeddings": True,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    },
    {  # 3 heads, 6 experts in 3 groups (2 chosen), top-3, two dense blocks of four, small ranks, linear rope
        "num_hidden_layers": 4,
        "num_attention_heads": 3,
        "num_key_value_heads": 3,
        "n_routed_experts": 6,
        "num_experts_per_tok": 3,
        "n_group": 3,
        "topk_group": 2,
        "first_k_dense_replace": 2,
        "q_lora_rank": 6,
        "kv_lora_rank": 5,
        "qk_rope_head_dim": 6,
        "qk_nope_head_dim": 2,
        "v_head_dim": 4,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    },
]


def _tiny(**overrides: Any) -> Any:
    """A random transformers DeepSeek-V3 (float32, eager) with perturbed norms, biases and correction biases."""
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**BASE, **overrides}, attn_implementation="eager")
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.5 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.add_(0.2 * torch.randn_like(buffer))
    return model


def _ids(seq: int = 12, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, size=(batch, seq))


def _named(ids: np.ndarray, axes: tuple[str, ...] = ("batch", "position")) -> hax.NamedArray:
    return hax.named(jnp.asarray(ids), axes)


@eqx.filter_jit
def _forward(model: DeepseekV3LMHeadModel, ids: hax.NamedArray) -> Any:
    return model(ids)


@eqx.filter_jit
def _decode(model: DeepseekV3LMHeadModel, tokens: hax.NamedArray, cache: Any, pos: hax.NamedArray) -> Any:
    return model.decode(tokens, cache, pos)


@pytest.fixture(scope="module", params=range(len(CASES)), ids=lambda i: f"case{i}")
def pair(request: pytest.FixtureRequest) -> tuple[Any, DeepseekV3LMHeadModel]:
    torch.manual_seed(request.param)
    hf = _tiny(**CASES[request.param])
    return hf, port(hf)


def test_logits_match_transformers(pair: tuple[Any, DeepseekV3LMHeadModel]) -> None:
    hf, model = pair
    assert isinstance(model, DeepseekV3LMHeadModel)
    ids = _ids()
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(_forward(model, _named(ids)).array)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)


def test_greedy_decoding_through_the_latent_cache_equals_generate(pair: tuple[Any, DeepseekV3LMHeadModel]) -> None:
    hf, model = pair
    prompts = np.random.RandomState(1).randint(0, VOCAB, size=(2, 5))
    hf.generation_config.eos_token_id = None
    new = 6
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            do_sample=False,
            max_new_tokens=new,
            pad_token_id=0,
        )[:, prompts.shape[1] :].numpy()
    cache = model.init_cache(hax.Axis("batch", 2), prompts.shape[1] + new).for_prefill()
    # the cache holds the latent and the shared rotary key, not the heads' keys and values
    config = model.config
    assert cache.keys.axis_names == ("layers", "batch", "cache_position", "latent")
    assert cache.keys.shape["latent"] == config.kv_lora_rank
    assert cache.values.shape["rope_head_size"] == config.qk_rope_head_dim
    logits, cache = _decode(model, _named(prompts), cache, _named(np.arange(5), ("position",)))
    got = []
    token = np.asarray(jnp.argmax(logits.array[:, -1], axis=-1))
    for step in range(new):
        got.append(token)
        logits, cache = _decode(model, _named(token[:, None]), cache, _named(np.array([5 + step]), ("position",)))
        token = np.asarray(jnp.argmax(logits.array[:, 0], axis=-1))
    np.testing.assert_array_equal(np.stack(got, axis=1), expected)


def test_blockwise_attention_and_the_latent_space_decode_match_transformers(
    pair: tuple[Any, DeepseekV3LMHeadModel],
) -> None:
    """MLA through the blockwise kernel (``attn_backend: flash``, values padded to the keys' head size), and the
    cache path both ways: a 24-token prefill that expands the cached latents per head (``mla_absorb: auto``; with
    ``always``, it attends in the latent space), then decoding steps that attend in the latent space (``kv_b_proj``
    absorbed), all against transformers' logits."""
    hf, model = pair
    ids = _ids(seq=28)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    flash = port(hf, attn_backend="flash", flash_attention_block_size=8)
    np.testing.assert_allclose(np.asarray(_forward(flash, _named(ids)).array), expected, atol=TOL, rtol=0)
    config = model.config
    dims = (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank)
    assert not _absorb_pays(24, dims)
    assert _absorb_pays(1, dims)
    cache = model.init_cache(hax.Axis("batch", 2), 28).for_prefill()
    logits, cache = _decode(model, _named(ids[:, :24]), cache, _named(np.arange(24), ("position",)))
    np.testing.assert_allclose(np.asarray(logits.array), expected[:, :24], atol=TOL, rtol=0)
    for step in range(24, 28):
        position = _named(np.array([step]), ("position",))
        logits, cache = _decode(model, _named(ids[:, step : step + 1]), cache, position)
        np.testing.assert_allclose(np.asarray(logits.array[:, 0]), expected[:, step], atol=TOL, rtol=0)
    latent = port(hf, mla_absorb="always")
    cache = latent.init_cache(hax.Axis("batch", 2), 28).for_prefill()
    logits, _ = _decode(latent, _named(ids[:, :24]), cache, _named(np.arange(24), ("position",)))
    np.testing.assert_allclose(np.asarray(logits.array), expected[:, :24], atol=TOL, rtol=0)


def test_router_matches_transformers() -> None:
    torch.manual_seed(3)
    config = transformers.DeepseekV3Config(**{**BASE, **CASES[2]})
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
        x = torch.randn(40, config.hidden_size)
        _, weights, indices = router(x)
        logits = (x @ router.weight.T).numpy()
    E = hax.Axis("experts", config.n_routed_experts)
    ours = route_grouped_sigmoid(
        hax.named(jnp.asarray(logits), ("token", "experts")),
        hax.named(jnp.asarray(router.e_score_correction_bias.numpy()), "experts"),
        E,
        config.num_experts_per_tok,
        n_group=config.n_group,
        topk_group=config.topk_group,
        normalize=config.norm_topk_prob,
        scaling=config.routed_scaling_factor,
    )
    # transformers leaves the chosen experts unsorted: compare per token, sorted by expert
    order_hf, order_ours = np.argsort(indices.numpy(), -1), np.argsort(np.asarray(ours.indices.array), -1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(ours.indices.array), order_ours, -1),
        np.take_along_axis(indices.numpy(), order_hf, -1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(ours.weights.array), order_ours, -1),
        np.take_along_axis(weights.numpy(), order_hf, -1),
        atol=1e-6,
    )


def test_hf_files_both_ways_and_sorted_dispatch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = _tiny()  # case0's architecture: its forward is already compiled
    ids = _ids(seed=2)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    hf.save_pretrained(tmp_path / "from_hf")
    loaded = load_pretrained(tmp_path / "from_hf")
    assert isinstance(loaded, DeepseekV3LMHeadModel)
    np.testing.assert_allclose(np.asarray(_forward(loaded, _named(ids)).array), expected, atol=TOL, rtol=0)
    save_pretrained(loaded, tmp_path / "ours")
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager", output_loading_info=True
    )
    assert isinstance(reloaded, transformers.DeepseekV3ForCausalLM)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    with torch.no_grad():
        ref = reloaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ref, expected, atol=1e-5, rtol=0)
    assert DeepseekV3Config.from_hf_config(loaded.config.to_hf_config(VOCAB)) == loaded.config
    state = loaded.to_hf_state_dict()
    assert state["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (32, 12)
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].shape == (8,)
    assert state["model.layers.0.mlp.gate_proj.weight"].shape == (48, 32)
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(KeyError, match=r"layers\.2\.mlp\.experts\.5\.up_proj"):
        loaded.from_hf_state_dict(state)
    sparse = port(hf, moe_dispatch="sorted")
    np.testing.assert_allclose(np.asarray(_forward(sparse, _named(ids)).array), expected, atol=TOL, rtol=0)


def test_lora_sites_cover_mla_and_adapters_start_as_the_base() -> None:
    from ponente.models.lora import LoraConfig, lora_sites, loraize, merge_lora

    torch.manual_seed(0)
    hf = _tiny()  # case0's architecture
    model = port(hf)
    available = {n for site in lora_sites(model) for n in site.short_names}
    mla = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert mla | {"gate_proj", "up_proj", "down_proj"} <= available, available
    # two targets keep the test fast (each adapter's random init runs eagerly)
    adapted = loraize(model, LoraConfig(r=2, target_modules=["q_b_proj", "kv_b_proj"]), key=jax.random.key(0))
    sites = lora_sites(adapted, adapted=True)
    assert {n for site in sites for n in site.short_names} == {"q_b_proj", "kv_b_proj"}
    assert len(sites) == 4  # both stacks: the dense first block and the MoE blocks
    ids = _ids(seed=3)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(_forward(adapted, _named(ids)).array), expected, atol=TOL, rtol=0)
    merged = merge_lora(adapted)
    np.testing.assert_allclose(np.asarray(_forward(merged, _named(ids)).array), expected, atol=TOL, rtol=0)


def _error(fn: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)


def test_config_checks_defaults_and_round_trip() -> None:
    hf = transformers.DeepseekV3Config(**BASE).to_dict()
    cfg = DeepseekV3Config.from_hf_config(hf)
    assert config_for_type("deepseek_v3") is DeepseekV3Config
    assert DeepseekV3Config.from_hf_config(cfg.to_hf_config(VOCAB)) == cfg
    # per layer: q (32 -> 16 -> 4x12), kv (32 -> 12+4, 12 -> 4x(8+6)), o (4x6 -> 32), scores and values over 64
    # positions; one dense MLP (48), two MoE blocks (2 routed + 1 shared expert of 12, router over 8); the head
    attn = 2 * (16 * (32 + 4 * 12) + 32 * 16 + 12 * 4 * 14 + 4 * 6 * 32) + 2 * 64 * 4 * (12 + 6)
    mlp = 6 * 32 * 48 + 2 * (6 * 32 * 12 * 3 + 2 * 32 * 8)
    assert cfg.flops_per_token(VOCAB) == 3 * attn + mlp + 2 * 32 * VOCAB
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "num_key_value_heads": 2}), "num_kv_heads")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "n_group": 3}), "n_group")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "topk_group": 3}), "topk_group")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "num_experts_per_tok": 9}), "num_experts_per_tok")
    few = {**hf, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}  # 2 experts in the one chosen group
    _error(lambda: DeepseekV3Config.from_hf_config(few), "num_experts_per_tok")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "first_k_dense_replace": 3}), "first_k_dense_replace")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "qk_rope_head_dim": 3}), "qk_rope_head_dim")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "q_lora_rank": 0}), "q_lora_rank")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "kv_lora_rank": 0}), "kv_lora_rank")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "n_shared_experts": 0}), "n_shared_experts")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "hidden_act": "gelu"}), "hidden_act")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "v_head_dim": 13}), "v_head_dim")
    _error(lambda: dataclasses.replace(cfg, mla_absorb="sometimes"), "mla_absorb")
    _error(lambda: DeepseekV3Config.from_hf_config({**hf, "attention_dropout": 0.1}), "attention_dropout")
    # transformers' defaults (DeepSeek-V3's published shape)
    default = DeepseekV3Config.from_hf_config(transformers.DeepseekV3Config().to_dict())
    assert (default.num_layers, default.num_experts, default.n_group, default.topk_group) == (61, 256, 8, 4)
    assert (default.q_lora_rank, default.kv_lora_rank, default.first_k_dense_replace) == (1536, 512, 3)
    assert default.routed_scaling_factor == 2.5
    assert default.rope_interleave


def test_router_metrics_and_the_balancing_bias_update_against_numpy() -> None:
    """The ``router/*`` diagnostics and the expert loads of a forward pass vs NumPy over transformers' own routing
    (the gate's inputs and chosen experts, caught by hooks); then DeepSeek-V3's bias update moves every MoE block's
    ``e_score_correction_bias`` by ``rate * sign(mean load - load)``."""
    from ponente.models.decoder import EXPERT_LOAD
    from ponente.models.moe import balance_bias_frozen, update_balance_bias

    torch.manual_seed(5)
    hf = _tiny(num_hidden_layers=4)  # one dense block, then three MoE blocks
    model = port(hf)
    model = dataclasses.replace(model, config=dataclasses.replace(model.config, router_metrics_groups=2))
    ids = _ids(seq=10, batch=3, seed=4)
    caught: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    gates = [layer.mlp.gate for layer in hf.model.layers[1:]]

    def hook(module: Any, inputs: Any, output: Any) -> None:
        x = inputs[0].reshape(-1, module.hidden_dim).detach().numpy()
        caught.append((x, module.weight.detach().numpy(), output[2].detach().numpy()))

    handles = [gate.register_forward_hook(hook) for gate in gates]
    with torch.no_grad():
        hf(torch.as_tensor(ids))
    for handle in handles:
        handle.remove()
    E, k = 8, 2
    scores = [1 / (1 + np.exp(-(x.astype(np.float64) @ w.T))) for x, w, _ in caught]
    counts = np.stack([np.bincount(idx.reshape(-1), minlength=E) for _, _, idx in caught])  # (layers, experts)

    def expected(layers: slice) -> dict[str, float]:
        s = np.concatenate(scores[layers])
        p = (s / s.sum(-1, keepdims=True)).mean(0)  # normalized scores, averaged over tokens and layers
        f = counts[layers].sum(0) / s.shape[0]  # assignments per token, averaged likewise
        per_layer = counts[layers].max(-1) / counts[layers].mean(-1)
        return {"load_balancing_loss": E * float(f @ p), "expert_load_max": float(per_layer.max())}

    _, aux = eqx.filter_jit(model.activations_and_aux)(_named(ids))
    want = {f"router/{n}": v for n, v in expected(slice(None)).items()}
    want.update({f"router/group_0/{n}": v for n, v in expected(slice(0, 2)).items()})
    want.update({f"router/group_1/{n}": v for n, v in expected(slice(2, 3)).items()})
    for name, value in want.items():
        np.testing.assert_allclose(float(aux[name].scalar()), value, rtol=1e-5, err_msg=name)
    assert float(aux["router/dropped_fraction"].scalar()) == 0.0
    assert "router_aux_loss" not in aux
    assert not [n for n in aux if n.endswith("z_loss")]
    assert counts.sum() == 3 * 3 * 10 * k
    loads = np.asarray(aux[EXPERT_LOAD].rearrange(("layers", "experts")).array)
    np.testing.assert_array_equal(loads, counts)
    bias_before = np.asarray(model.transformer.layers.stacked.block_sparse_moe.e_score_correction_bias.array)
    np.testing.assert_allclose(float(aux["router/balance_bias_abs_mean"].scalar()), np.abs(bias_before).mean(), 1e-6)

    rate = 0.01
    moved = update_balance_bias(model, aux[EXPERT_LOAD], rate)
    bias = np.asarray(moved.transformer.layers.stacked.block_sparse_moe.e_score_correction_bias.array)
    step = rate * np.sign(counts.mean(-1, keepdims=True) - counts)
    assert (step != 0).any()
    np.testing.assert_allclose(bias - bias_before, step, atol=1e-6)
    mask = balance_bias_frozen(jax.tree_util.tree_map(lambda _: True, model))
    assert mask.transformer.layers.stacked.block_sparse_moe.e_score_correction_bias is False
    assert mask.transformer.layers.stacked.block_sparse_moe.router.weight.array is True
