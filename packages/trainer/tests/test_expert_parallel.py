"""Expert parallelism is a config change: a tiny Mixtral trained on 8 simulated devices with ``expert_axis_size`` 4
(and expert 2 x model 2 x data 2) gives the losses and parameters of 1 device; bad expert keys fail naming the key.

Run in the multidevice session (8 simulated CPU devices), except the config checks.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ponente.namedtensor as hax
from ponente.models import LmExample, MixtralConfig, compute_next_token_loss_and_aux
from ponente.trainer.trainer import Trainer, TrainerConfig

BATCH = 16
STEPS = 3
MODEL = MixtralConfig(
    seq_len=8,
    hidden_dim=16,
    intermediate_dim=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.01,
)
Vocab = hax.Axis("vocab", 16)

LAYOUTS = {
    "expert4": {"expert_axis_size": 4},
    "data2_expert2_model2": {
        "expert_axis_size": 2,
        "model_axis_size": 2,
        "tensor_parallel_axes": ["mlp", "heads"],
    },
}


def lm_loss(model, example, *, key):
    loss, aux = compute_next_token_loss_and_aux(model, example, key=key)
    return loss, aux


def batches():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        ids = hax.named(
            jnp.asarray(rng.integers(0, Vocab.size, (BATCH, MODEL.seq_len)), jnp.int32), ("batch", "position")
        )
        out.append(LmExample.causal(ids))
    return out


def train(devices, model=MODEL, **layout):
    config = TrainerConfig(
        train_batch_size=BATCH, num_train_steps=STEPS, compilation_cache_dir=None, progress_bar=False, **layout
    )
    trainer = Trainer(config, optax.adam(1e-2), lm_loss, devices=devices)
    state = trainer.initial_state(lambda key: model.build(Vocab, key=key))
    data = batches()
    # the program train_step then runs (compiled once)
    trainer.hlo = trainer.compile_step(state, trainer.shard_batch(data[0])).as_text()
    losses, metrics = [], []
    for batch in data:
        state, m = trainer.train_step(state, trainer.shard_batch(batch))
        losses.append(float(m["loss"]))
        metrics.append({k: float(v) for k, v in m.items()})
    return trainer, state, losses, metrics


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def reference():
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    _, state, losses, metrics = train(jax.devices()[:1])
    return losses, leaves(state.model), metrics


@pytest.mark.multidevice
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_trains_like_one_device(name, reference):
    trainer, state, losses, metrics = train(jax.devices(), **LAYOUTS[name])
    ref_losses, ref_params, ref_metrics = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-4)
    for got, want in zip(leaves(state.model), ref_params, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)
    expert = LAYOUTS[name]["expert_axis_size"]
    assert trainer.mesh.shape["expert"] == expert
    assert "all-to-all" in trainer.hlo
    assert trainer.data_axis_size == 8 // LAYOUTS[name].get("model_axis_size", 1)
    # the experts' weights are stored split over the expert mesh axis
    w1 = state.model.transformer.layers.stacked.block_sparse_moe.gate_proj
    assert w1.array.sharding.spec[w1.axis_names.index("experts")] == "expert"
    for step, ref in zip(metrics, ref_metrics, strict=True):
        for key in ("router/load_balancing_loss", "router/z_loss", "router/expert_load_max", "router_aux_loss"):
            np.testing.assert_allclose(step[key], ref[key], rtol=1e-4, atol=1e-5)
        assert step["router/dropped_fraction"] == 0.0


@pytest.mark.multidevice
def test_qwen3_moe_with_expert_parallelism_trains_like_one_device():
    from ponente.models import Qwen3MoeConfig

    model = Qwen3MoeConfig(
        seq_len=8,
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_dim=8,
        norm_topk_prob=True,
    )
    _, ref_state, ref_losses, _ = train(jax.devices()[:1], model)
    trainer, state, losses, _ = train(jax.devices(), model, expert_axis_size=4)
    assert "all-to-all" in trainer.hlo
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-4)
    for got, want in zip(leaves(state.model), leaves(ref_state.model), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_expert_axis_size_must_divide_the_devices():
    with pytest.raises(ValueError, match=r"expert_axis_size=3.*does not divide the 8 devices"):
        Trainer(
            TrainerConfig(expert_axis_size=3, compilation_cache_dir=None),
            optax.sgd(0.1),
            lm_loss,
            devices=[jax.devices()[0]] * 8,
        )
    with pytest.raises(ValueError, match=r"trainer\.expert_axis_size must be >= 1"):
        TrainerConfig(expert_axis_size=0)


def test_router_bias_update_moves_the_bias_against_the_load():
    """One step of DeepSeek-V3's bias update vs NumPy: the loads are those of the initial model's routing (counted
    over 4 accumulated microbatches)."""
    from ponente.models.decoder import EXPERT_LOAD
    from ponente.models.moe import balance_bias_frozen, update_balance_bias

    rate = 0.05
    model_config = dataclasses.replace(MODEL, router_bias_update_rate=rate)
    config = TrainerConfig(
        train_batch_size=BATCH,
        per_device_parallelism=4,
        num_train_steps=2,
        compilation_cache_dir=None,
        progress_bar=False,
    )
    trainer = Trainer(
        config,
        optax.adamw(1e-2, weight_decay=0.1),
        lm_loss,
        devices=jax.devices()[:1],
        after_update=lambda model, extra: update_balance_bias(model, extra[EXPERT_LOAD], rate),
    )
    build = lambda key: model_config.build(Vocab, key=key)  # noqa: E731
    mask = balance_bias_frozen(jax.tree_util.tree_map(lambda _: True, eqx.filter_eval_shape(build, jax.random.key(0))))
    state = trainer.initial_state(build, is_trainable=mask)
    batch = batches()[0]
    routing = state.model.routing(batch.tokens)
    indices = np.asarray(routing.indices.rearrange(("layers", "batch", "position", "top_k")).array)
    loads = np.stack([np.bincount(layer.reshape(-1), minlength=MODEL.num_experts) for layer in indices])
    expected = rate * np.sign(loads.mean(-1, keepdims=True) - loads)
    assert (expected != 0).any()
    state, metrics = trainer.train_step(state, trainer.shard_batch(batch))
    bias = state.model.transformer.layers.stacked.block_sparse_moe.balance_bias
    np.testing.assert_allclose(np.asarray(bias.rearrange(("layers", "experts")).array), expected, atol=1e-7)
    np.testing.assert_allclose(metrics["router/balance_bias_abs_mean"], 0.0)  # logged before the update
    assert "router/expert_load" not in metrics  # not a scalar: read by after_update only


def test_moe_keys_on_a_dense_model_or_uneven_experts_fail_naming_the_key():
    from ponente.models import LlamaConfig
    from ponente.trainer.run import check_expert_parallel

    with pytest.raises(ValueError, match=r"trainer.expert_axis_size=2: model type LlamaConfig has no experts"):
        check_expert_parallel(LlamaConfig(), TrainerConfig(expert_axis_size=2))
    with pytest.raises(ValueError, match=r"trainer.expert_axis_size=8 does not divide model.num_experts=4"):
        check_expert_parallel(MODEL, TrainerConfig(expert_axis_size=8))
    check_expert_parallel(MODEL, TrainerConfig(expert_axis_size=4))
    with pytest.raises(ValueError, match="router_bias_update_rate must be >= 0"):
        dataclasses.replace(MODEL, router_bias_update_rate=-0.1)
    with pytest.raises(ValueError, match="moe_capacity_factor must be positive"):
        dataclasses.replace(MODEL, moe_capacity_factor=0.0)


def _bytes(tree):
    out = []
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array):
            out.append(np.asarray(leaf).tobytes())
    return out


@pytest.mark.multidevice
def test_resume_with_expert_parallelism_and_the_balancing_bias_is_bitwise(tmp_path):
    """3 steps straight vs 1 step, a checkpoint, a fresh load and 2 steps: the same bits (the bias included)."""
    from ponente.models.decoder import EXPERT_LOAD
    from ponente.models.moe import balance_bias_frozen, update_balance_bias
    from ponente.trainer.checkpoint import load_checkpoint, save_checkpoint

    rate = 0.05
    model_config = dataclasses.replace(MODEL, router_bias_update_rate=rate, moe_capacity_factor=1.0)
    config = TrainerConfig(
        train_batch_size=BATCH,
        num_train_steps=STEPS,
        expert_axis_size=4,
        compilation_cache_dir=None,
        progress_bar=False,
    )
    trainer = Trainer(
        config,
        optax.adamw(1e-2, weight_decay=0.1),
        lm_loss,
        devices=jax.devices(),
        after_update=lambda model, extra: update_balance_bias(model, extra[EXPERT_LOAD], rate),
    )

    def build(key):
        return model_config.build(Vocab, key=key)

    mask = balance_bias_frozen(jax.tree_util.tree_map(lambda _: True, eqx.filter_eval_shape(build, jax.random.key(0))))
    data = [trainer.shard_batch(b) for b in batches()]

    straight = trainer.initial_state(build, is_trainable=mask)
    straight_losses = []
    for batch in data:
        straight, metrics = trainer.train_step(straight, batch)
        straight_losses.append(float(metrics["loss"]))
    assert metrics["router/balance_bias_abs_mean"] > 0
    assert 0 <= metrics["router/dropped_fraction"] < 1

    resumed = trainer.initial_state(build, is_trainable=mask)
    resumed, metrics = trainer.train_step(resumed, data[0])
    losses = [float(metrics["loss"])]
    save_checkpoint(resumed, tmp_path / "step-1", step=1)
    resumed = load_checkpoint(trainer.initial_state(build, is_trainable=mask), tmp_path / "step-1")
    for batch in data[1:]:
        resumed, metrics = trainer.train_step(resumed, batch)
        losses.append(float(metrics["loss"]))
    assert losses == straight_losses
    assert _bytes(resumed) == _bytes(straight)


def _mixtral_overrides(overrides):
    return [o for o in overrides if not o.startswith("model.")] + [
        "model.type=mixtral",
        "model.seq_len=32",
        "model.hidden_dim=32",
        "model.intermediate_dim=32",
        "model.num_layers=2",
        "model.num_heads=2",
        "model.num_kv_heads=2",
        "model.num_experts=4",
    ]


def test_train_lm_refuses_moe_keys_on_a_dense_model(tiny_lm_overrides):
    from ponente.trainer.config import ConfigError, load_config
    from ponente.trainer.main import train_lm
    from ponente.trainer.main.train_lm import TrainLmConfig

    overrides = tiny_lm_overrides(2)  # a gpt2 model
    with pytest.raises(ConfigError, match=r"model\.router_bias_update_rate: not a field of type 'gpt2'"):
        load_config(TrainLmConfig, overrides=[*overrides, "model.router_bias_update_rate=0.1"])
    cfg = load_config(TrainLmConfig, overrides=[*overrides, "trainer.expert_axis_size=2"])
    with pytest.raises(ValueError, match=r"trainer\.expert_axis_size=2: model type Gpt2Config has no experts"):
        train_lm.train(cfg)


@pytest.mark.integration
def test_train_lm_logs_router_metrics_and_updates_the_bias(tmp_path, tiny_lm_overrides):
    import json

    from ponente.trainer.config import load_config
    from ponente.trainer.main import train_lm
    from ponente.trainer.main.train_lm import TrainLmConfig

    overrides = [*_mixtral_overrides(tiny_lm_overrides(3)), "model.router_bias_update_rate=0.01"]
    train_lm.train(load_config(TrainLmConfig, overrides=overrides))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 3
    for key in ("router/load_balancing_loss", "router/z_loss", "router/expert_load_max", "router/dropped_fraction"):
        assert all(np.isfinite(r[key]) for r in steps), key  # names with a "/" are logged as they are
    bias = [r["router/balance_bias_abs_mean"] for r in steps]
    assert bias[0] == 0.0  # logged by the step, before its update
    assert bias[1] == pytest.approx(0.01, abs=1e-6)  # after one update every expert moved by the rate (or 0)


@pytest.mark.integration
def test_train_lm_balances_deepseek_v3_with_its_correction_bias(tmp_path, tiny_lm_overrides):
    """DeepSeek-V3's own balancing through ``ponente-train-lm``: the correction bias moves by the rate after each
    step (the optimizer never touches it), and the router metrics are logged without a z-loss or an aux loss."""
    import json

    from ponente.trainer.config import load_config
    from ponente.trainer.main import train_lm
    from ponente.trainer.main.train_lm import TrainLmConfig

    overrides = [o for o in tiny_lm_overrides(3) if not o.startswith("model.")] + [
        "model.type=deepseek_v3",
        "model.seq_len=32",
        "model.hidden_dim=32",
        "model.intermediate_dim=32",
        "model.num_layers=3",
        "model.num_heads=2",
        "model.num_kv_heads=2",
        "model.num_experts=4",
        "model.num_experts_per_tok=2",
        "model.moe_intermediate_dim=16",
        "model.n_group=2",
        "model.topk_group=1",
        "model.first_k_dense_replace=1",
        "model.q_lora_rank=16",
        "model.kv_lora_rank=8",
        "model.qk_rope_head_dim=4",
        "model.qk_nope_head_dim=4",
        "model.v_head_dim=8",
        "model.router_bias_update_rate=0.01",
    ]
    train_lm.train(load_config(TrainLmConfig, overrides=overrides))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 3
    for key in ("router/load_balancing_loss", "router/expert_load_max", "router/dropped_fraction"):
        assert all(np.isfinite(r[key]) for r in steps), key
    assert not [k for k in steps[0] if k.endswith(("z_loss", "router_aux_loss"))]
    bias = [r["router/balance_bias_abs_mean"] for r in steps]
    assert bias[0] == 0.0  # logged by the step, before its update
    assert bias[1] == pytest.approx(0.01, abs=1e-6)  # every expert moved by the rate (or not at all: 0)
