"""Mixtral: logits, routing and aux loss vs transformers, HF import/export, training, expert parallelism."""

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

import ponente.namedtensor as hax
from ponente.models import LmExample, compute_next_token_loss, compute_next_token_loss_and_aux, config_for_type
from ponente.models.hf import load_pretrained, save_pretrained
from ponente.models.mixtral import MixtralConfig, MixtralLMHeadModel
from ponente.models.moe import load_balancing_loss

TOL = 1e-4
VOCAB = 61


def _tiny_mixtral(**overrides: Any) -> Any:
    """A random transformers Mixtral (float32, eager attention) with non-trivial norm scales."""
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 16,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "initializer_range": 0.2,
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kwargs)).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a misplaced norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def _ids(seq: int = 16, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, size=(batch, seq))


def _named(ids: np.ndarray) -> hax.NamedArray:
    return hax.named(jnp.asarray(ids), ("batch", "position"))


# (transformers config overrides, sequence length)
CASES: list[tuple[dict[str, Any], int]] = [
    ({}, 16),  # GQA, untied, 4 experts top-2
    ({"num_key_value_heads": 4, "tie_word_embeddings": True, "num_experts_per_tok": 1, "sliding_window": 3}, 7),
    ({"num_key_value_heads": 1, "num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 3}, 12),
    ({"sliding_window": 5, "head_dim": 16, "num_hidden_layers": 1, "num_local_experts": 2}, 16),
]


def _port(hf: Any, **overrides: Any) -> MixtralLMHeadModel:
    """Our model with the config and weights of a transformers Mixtral (its fused transformers-5 state dict)."""
    hf_config = hf.config.to_dict()
    config = config_for_type(hf_config["model_type"]).from_hf_config(hf_config)
    assert isinstance(config, MixtralConfig)
    config = dataclasses.replace(config, **overrides)
    template = eqx.filter_eval_shape(config.build, hax.Axis("vocab", VOCAB), key=jax.random.key(0))
    return template.from_hf_state_dict({k: v.detach().numpy() for k, v in hf.state_dict().items()})


@pytest.fixture(scope="module", params=range(len(CASES)), ids=lambda i: f"case{i}")
def pair(request: pytest.FixtureRequest) -> tuple[Any, MixtralLMHeadModel, int]:
    """A transformers Mixtral, our port of it, and the sequence length to test."""
    torch.manual_seed(request.param)
    overrides, seq = CASES[request.param]
    hf = _tiny_mixtral(**overrides)
    return hf, _port(hf), seq


def test_logits_match_transformers(pair: tuple[Any, MixtralLMHeadModel, int]) -> None:
    hf, model, seq = pair
    ids = _ids(seq)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(_named(ids)).array), expected, atol=TOL, rtol=0)
    sorted_dispatch = _port(hf, moe_dispatch="sorted")
    np.testing.assert_allclose(np.asarray(sorted_dispatch(_named(ids)).array), expected, atol=TOL, rtol=0)


def test_routing_and_aux_loss_match_transformers(pair: tuple[Any, MixtralLMHeadModel, int]) -> None:
    hf, model, seq = pair
    ids = _ids(seq, seed=1)
    with torch.no_grad():
        out = hf(torch.tensor(ids), output_router_logits=True)
    k, layers = hf.config.num_experts_per_tok, hf.config.num_hidden_layers
    routing = model.routing(_named(ids))
    assert routing.indices.axis_names == ("layers", "batch", "position", "top_k")
    for layer in range(layers):
        probs = torch.softmax(out.router_logits[layer].float(), -1)
        top, chosen = torch.topk(probs, k, dim=-1)
        np.testing.assert_array_equal(np.asarray(routing.indices.array[layer]).reshape(-1, k), chosen.numpy())
        np.testing.assert_allclose(
            np.asarray(routing.weights.array[layer]).reshape(-1, k),
            (top / top.sum(-1, keepdim=True)).numpy(),
            atol=1e-5,
        )
    _, aux = model.logits_and_aux(_named(ids))
    expected = float(out.aux_loss) * hf.config.router_aux_loss_coef
    np.testing.assert_allclose(float(aux["router_aux_loss"].scalar()), expected, rtol=1e-5)


def _np_router_metrics(logits: np.ndarray, k: int) -> dict[str, float]:
    """NumPy router metrics of router logits ``(layers, tokens, experts)`` (Mixtral's top-k of the softmax)."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    counts = np.zeros_like(probs)
    np.put_along_axis(counts, chosen, 1.0, axis=-1)
    experts = logits.shape[-1]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    load = counts.sum(1)  # (layers, experts)
    return {
        "load_balancing_loss": experts * float((counts.mean((0, 1)) * probs.mean((0, 1))).sum()),
        "z_loss": float((lse**2).mean()),
        "expert_load_max": float((load.max(-1) / load.mean(-1)).max()),
        "dropped_fraction": 0.0,
    }


def test_router_metrics_per_layer_group_match_numpy(pair: tuple[Any, MixtralLMHeadModel, int]) -> None:
    hf, _, seq = pair
    model = _port(hf, router_metrics_groups=2)
    ids = _ids(seq, seed=2)
    with torch.no_grad():
        router_logits = hf(torch.tensor(ids), output_router_logits=True).router_logits
    logits = np.stack([r.float().numpy() for r in router_logits])  # (layers, tokens, experts)
    layers, k = logits.shape[0], hf.config.num_experts_per_tok
    _, aux = model.logits_and_aux(_named(ids))
    # groups of consecutive layers: 1 layer -> none (the overall metrics), 2 -> [0] [1], 3 -> [0, 1] [2]
    bounds = {1: [], 2: [(0, 1), (1, 2)], 3: [(0, 2), (2, 3)]}[layers]
    expected = {f"router/{n}": v for n, v in _np_router_metrics(logits, k).items()}
    for g, (lo, hi) in enumerate(bounds):
        expected.update({f"router/group_{g}/{n}": v for n, v in _np_router_metrics(logits[lo:hi], k).items()})
    got = {name: float(value.scalar()) for name, value in aux.items() if name.startswith("router/")}
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("case", [0, 1])
def test_hf_file_round_trips(case: int, tmp_path: Path) -> None:
    torch.manual_seed(10 + case)
    overrides, seq = CASES[case]
    hf = _tiny_mixtral(**overrides)
    model = _port(hf)
    ids = _ids(seq, seed=2)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    # transformers writes per-expert files (the transformers-4 layout); we read them
    hf.save_pretrained(tmp_path / "from_hf")
    loaded = load_pretrained(tmp_path / "from_hf")
    assert isinstance(loaded, MixtralLMHeadModel)
    assert loaded.config == model.config
    np.testing.assert_allclose(np.asarray(loaded(_named(ids)).array), expected, atol=TOL, rtol=0)
    # we write a checkpoint that transformers loads
    save_pretrained(model, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager")
    assert isinstance(reloaded, transformers.MixtralForCausalLM)
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.tensor(ids)).logits.numpy(), expected, atol=TOL, rtol=0)
    assert MixtralConfig.from_hf_config(model.config.to_hf_config(VOCAB)) == model.config


def test_state_dict_layouts_and_errors() -> None:
    # ported from transformers rather than built here: a random init costs more compilation than a load
    model = _port(_tiny_mixtral(hidden_size=16, intermediate_size=8, num_local_experts=3))
    state = model.to_hf_state_dict()
    assert state["model.layers.1.block_sparse_moe.experts.2.w1.weight"].shape == (8, 16)
    assert state["model.layers.0.block_sparse_moe.experts.0.w2.weight"].shape == (16, 8)
    assert state["model.layers.0.block_sparse_moe.gate.weight"].shape == (3, 16)
    perturbed = {k: v + 0.25 for k, v in state.items()}
    for name, value in model.from_hf_state_dict(perturbed).to_hf_state_dict().items():
        np.testing.assert_array_equal(value, perturbed[name], err_msg=name)
    # the fused transformers-5 in-memory layout
    fused = {k: v for k, v in perturbed.items() if ".experts." not in k and ".gate." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe"
        w = {n: np.stack([perturbed[f"{p}.experts.{e}.{n}.weight"] for e in range(3)]) for n in ("w1", "w2", "w3")}
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.concatenate([w["w1"], w["w3"]], axis=1)
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = w["w2"]
        fused[f"model.layers.{layer}.mlp.gate.weight"] = perturbed[f"{p}.gate.weight"]
    for name, value in model.from_hf_state_dict(fused).to_hf_state_dict().items():
        np.testing.assert_array_equal(value, perturbed[name], err_msg=name)
    del perturbed["model.layers.1.block_sparse_moe.experts.1.w3.weight"]
    with pytest.raises(KeyError, match=r"layers\.1\.block_sparse_moe\.experts\.1\.w3"):
        model.from_hf_state_dict(perturbed)


def test_config_validation_and_flops() -> None:
    base = {"seq_len": 8, "hidden_dim": 16, "intermediate_dim": 8, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MixtralConfig(**base, num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="sliding_window"):
        MixtralConfig(**base, sliding_window=0)
    with pytest.raises(ValueError, match="qk_norm"):
        MixtralConfig(**base, qk_norm=True)
    with pytest.raises(ValueError, match="moe_dispatch"):
        MixtralConfig(**base, moe_dispatch="gather")
    with pytest.raises(ValueError, match="router_jitter_noise"):
        MixtralConfig.from_hf_config({**MixtralConfig(**base).to_hf_config(11), "router_jitter_noise": 0.1})
    cfg = MixtralConfig(**base, num_experts=4, num_experts_per_tok=2)
    # per layer: q,k,v,o projections + scores/values over 8 positions + router + 2 active SwiGLU experts; + output
    per_layer = 2 * 16 * (16 + 2 * 8) + 2 * 16 * 16 + 4 * 8 * 16 + 2 * 16 * 4 + 2 * 3 * 16 * 8 * 2
    assert cfg.flops_per_token(11) == 2 * per_layer + 2 * 16 * 11
    assert config_for_type("mixtral") is MixtralConfig
    # transformers-4 spelling: rope_theta at the top level, no sliding_window key (full attention)
    tf4 = {k: v for k, v in cfg.to_hf_config(11).items() if k not in ("rope_parameters", "sliding_window")}
    read = MixtralConfig.from_hf_config({**tf4, "rope_theta": 1e6, "torch_dtype": "float32"})
    assert read.rope.theta == 1e6
    assert read.sliding_window is None
    assert dataclasses.replace(read, rope=cfg.rope) == cfg


def test_loss_includes_the_router_aux_loss_and_training_reduces_it(train_losses: Any) -> None:
    model = _port(_tiny_mixtral(initializer_range=0.05), router_aux_loss_coef=0.5)
    cfg = model.config
    ids = np.random.RandomState(0).randint(0, 50, size=(4, 16))
    example = LmExample.causal(_named(ids))
    logits, aux = model.logits_and_aux(example.tokens)
    routing = model.routing(example.tokens)
    balance = load_balancing_loss(routing.probs, routing.indices, cfg.Experts)
    np.testing.assert_allclose(float(aux["router_aux_loss"].scalar()), 0.5 * float(balance.scalar()), rtol=1e-6)
    # cross-entropy from the logits by hand, plus the weighted aux loss
    logp = jax.nn.log_softmax(np.asarray(logits.array), -1)
    ce = -np.take_along_axis(np.asarray(logp)[:, :-1], ids[:, 1:, None], -1).mean()
    total = float(compute_next_token_loss(model, example).scalar())
    np.testing.assert_allclose(total, ce + float(aux["router_aux_loss"].scalar()), rtol=1e-5)
    blockwise, aux_blockwise = compute_next_token_loss_and_aux(model, example, block_size=16)
    np.testing.assert_allclose(float(blockwise.scalar()), total, rtol=1e-5)
    # the diagnostics are logged, not added: the totals above would differ otherwise
    assert set(aux_blockwise) == {
        "router_aux_loss",
        "router/load_balancing_loss",
        "router/z_loss",
        "router/expert_load_max",
        "router/dropped_fraction",
        *(f"router/group_{g}/{n}" for g in (0, 1) for n in ("load_balancing_loss", "z_loss", "expert_load_max")),
        *(f"router/group_{g}/dropped_fraction" for g in (0, 1)),
    }
    losses = train_losses(model, ids)
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.multidevice
def test_experts_shard_over_a_mesh_axis() -> None:
    import ponente.namedtensor.partitioning as P

    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    cfg = MixtralConfig(
        seq_len=8,
        hidden_dim=16,
        intermediate_dim=8,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
    )
    model = cfg.build(hax.Axis("vocab", 32), key=jax.random.key(0))
    ids = _named(np.random.RandomState(0).randint(0, 32, size=(2, 8)))
    expected = np.asarray(jax.jit(lambda m, x: m(x).array)(model, ids))
    mapping = {"experts": "data"}
    mesh = P.make_mesh({"data": 8})
    with jax.set_mesh(mesh):
        sharded = hax.shard(model, mapping, mesh)
        moe = sharded.transformer.layers.stacked.block_sparse_moe
        for weight in (moe.gate_proj, moe.up_proj, moe.down_proj):
            spec = weight.array.sharding.spec
            assert spec[weight.axis_names.index("experts")] == "data", (weight.axis_names, spec)
            assert weight.array.addressable_shards[0].data.shape[weight.axis_names.index("experts")] == 1
        logits = hax.named_jit(lambda m, x: m(x), axis_resources=mapping)(sharded, ids)
    np.testing.assert_allclose(np.asarray(logits.array), expected, atol=1e-5, rtol=0)
