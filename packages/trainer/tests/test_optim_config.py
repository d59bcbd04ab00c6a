"""The optimizer registry, config validation, metrics, update-norm clipping, and steps on real tiny models."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models import LlamaConfig, LmExample, compute_next_token_loss
from ponente.trainer.config import config_to_dict, load_config
from ponente.trainer.optim import (
    AdamConfig,
    LionConfig,
    MuonConfig,
    OptimizerConfig,
    SophiaHConfig,
    optimizer_metrics,
    param_paths,
)


@dataclasses.dataclass(frozen=True)
class Section:
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)


def test_registry():
    assert OptimizerConfig.get_choice_class("lion") is LionConfig
    assert OptimizerConfig.get_choice_class("adam") is AdamConfig
    assert OptimizerConfig.get_choice_class("sophia-h") is SophiaHConfig
    assert OptimizerConfig.get_choice_class("muon") is MuonConfig
    assert set(OptimizerConfig.choice_names()) >= {"adam", "lion", "sophia-h", "muon"}
    assert OptimizerConfig.default_choice == "adam"
    assert LionConfig.choice_name == "lion"
    with pytest.raises(KeyError, match="known types"):
        OptimizerConfig.get_choice_class("adamax")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr_schedule": "cosin"}, "unknown schedule 'cosin'"),
        ({"warmup": 2.5}, r"optimizer\.warmup"),
        ({"decay": -0.1}, r"optimizer\.decay"),
        ({"learning_rate": -1.0}, r"optimizer\.learning_rate"),
        ({"weight_decay_modules": ("ok", "(bad")}, r"optimizer\.weight_decay_modules: invalid regular expression"),
        ({"adamw_modules": ("[",)}, r"optimizer\.adamw_modules: invalid regular expression"),
    ],
)
def test_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MuonConfig(**kwargs)


def test_yaml_section_selects_the_type(tmp_path):
    path = tmp_path / "opt.yaml"
    path.write_text(
        "optimizer:\n  type: lion\n  learning_rate: 3e-5\n  cycles: [30, 60]\n  weight_decay_modules: [c_fc, wte]\n"
    )
    cfg = load_config(Section, [str(path)], ["optimizer.skip_bad_steps=true"])
    assert cfg.optimizer == LionConfig(
        learning_rate=3e-5, cycles=(30, 60), weight_decay_modules=("c_fc", "wte"), skip_bad_steps=True
    )
    assert load_config(Section).optimizer == AdamConfig()
    assert config_to_dict(cfg)["optimizer"]["type"] == "lion"


def test_metrics_report_the_scheduled_learning_rate():
    cfg = AdamConfig(learning_rate=1.0, warmup=4, lr_schedule="linear", min_lr_ratio=0.0)
    schedule = cfg.lr_scheduler(8)
    opt = cfg.build(8)
    params = {"w": jnp.ones(2)}
    state = opt.init(params)
    for step in range(6):
        _, state = opt.update({"w": jnp.array([3.0, 4.0])}, state, params, loss=jnp.float32(1.0))
        metrics = optimizer_metrics(state)
        # hand-written: warmup step/4 over 4 steps, then linear from 1 to 0 over 4 steps
        want = step / 4 if step < 4 else 1 - (step - 4) / 4
        assert float(metrics["optim/learning_rate"]) == pytest.approx(want)
        assert float(schedule(step)) == pytest.approx(want)
        assert float(metrics["optim/grad_norm"]) == pytest.approx(5.0)


def test_update_norm_clipping():
    grads = {"w": jnp.array([3.0, -4.0, 1.0])}
    params = {"w": jnp.ones(3)}
    base = {"learning_rate": 0.5, "warmup": 0.0, "lr_schedule": "constant", "weight_decay": 0.0, "max_grad_norm": None}
    free, _ = (opt := AdamConfig(**base).build(4)).update(grads, opt.init(params), params)
    clipped, state = (opt := AdamConfig(**base, max_update_norm=0.1).build(4)).update(grads, opt.init(params), params)
    free_norm = float(np.linalg.norm(np.asarray(free["w"])))
    assert free_norm > 0.1
    np.testing.assert_allclose(np.asarray(clipped["w"]), np.asarray(free["w"]) * 0.1 / free_norm, rtol=1e-5)
    assert float(optimizer_metrics(state)["optim/update_norm"]) == pytest.approx(0.1, rel=1e-5)


@pytest.fixture(scope="module")
def llama():
    """A real tiny Llama (built abstractly, then filled with small deterministic values: fast on CPU)."""
    cfg = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2, num_kv_heads=1)
    shapes = eqx.filter_eval_shape(cfg.build, hax.Axis("vocab", 11), key=jax.random.key(0))
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(treedef, [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def test_adamw_decays_exactly_the_masked_params_of_a_real_model(llama):
    params = eqx.filter(llama, eqx.is_inexact_array)
    opt = AdamConfig(learning_rate=0.5, weight_decay=0.1, warmup=0.0, lr_schedule="constant").build(4)
    zeros = jax.tree.map(jnp.zeros_like, params)
    upd, _ = eqx.filter_jit(opt.update)(zeros, opt.init(params), params, loss=jnp.float32(1.0))
    for path, u, p in zip(param_paths(params), jax.tree.leaves(upd), jax.tree.leaves(params)):
        decayed = path.endswith("_proj.weight") or path == "lm_head.weight"
        want = -0.5 * 0.1 * np.asarray(p) if decayed else np.zeros(p.shape)
        np.testing.assert_allclose(np.asarray(u), want, rtol=1e-5, atol=1e-8, err_msg=path)


@pytest.mark.integration  # compiles a model's forward/backward (and Sophia's Hessian product) per optimizer
@pytest.mark.parametrize("name", ["adam", "lion", "sophia-h", "muon"])
def test_every_optimizer_steps_a_real_model_under_jit(llama, name):
    cls = OptimizerConfig.get_choice_class(name)
    opt = cls(warmup=0.0, skip_bad_steps=True, max_update_norm=10.0).build(10)
    params, static = eqx.partition(llama, eqx.is_inexact_array)
    example = LmExample.causal(hax.arange(hax.Axis("position", 8)) % 11)

    def obj_fn(p):
        return compute_next_token_loss(eqx.combine(p, static), example).scalar()

    @eqx.filter_jit
    def step(params, state, key):
        loss, grads = eqx.filter_value_and_grad(obj_fn)(params)
        upd, state = opt.update(grads, state, params, loss=loss, obj_fn=obj_fn, key=key)
        return eqx.apply_updates(params, upd), state, loss

    state = opt.init(params)
    new_params, state, loss = step(params, state, jax.random.key(0))
    assert jax.tree.structure(new_params) == jax.tree.structure(params)
    metrics = optimizer_metrics(state)
    assert float(metrics["optim/skipped"]) == 0.0
    assert 0.0 < float(metrics["optim/update_norm"]) <= 10.0 + 1e-4
    assert np.isfinite(float(loss))
    moved = [
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params))
    ]
    assert all(moved)
