"""``trainer.quantization``: FP8/int8 products in the Trainer's step, checked against the namedtensor recipe and NumPy.

The reference of a quantized step is the recipe documented in :mod:`ponente.namedtensor.quantization`, written out
here by hand (``eqx.filter_grad``, ``partition_for_grad_overwrite``, optax, ``apply_updates``); the FP8 state after a
step is checked against absolute maxima computed with NumPy.
"""

from __future__ import annotations

import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import quantization as q
from ponente.namedtensor.nn import Linear
from ponente.trainer.data import data_vocab_size
from ponente.trainer.state import trainable_filter
from ponente.trainer.trainer import QuantizationConfig, Trainer, TrainerConfig, plain_model

Batch, In, Mid, Out = hax.Axis("batch", 8), hax.Axis("in", 6), hax.Axis("mid", 5), hax.Axis("out", 3)


class TwoLayers(eqx.Module):
    up_proj: Linear
    lm_head: Linear

    def __call__(self, x):
        return self.lm_head(hax.nn.relu(self.up_proj(x)))


def build(key):
    k1, k2 = jax.random.split(key)
    return TwoLayers(Linear.init(In, Mid, key=k1), Linear.init(Mid, Out, key=k2))


def loss_fn(model, batch, *, key):
    return hax.mean((model(batch["x"]) - batch["y"]) ** 2).scalar()


def make_batch(seed):
    rng = np.random.default_rng(seed)
    x = hax.named(jnp.asarray(rng.standard_normal((Batch.size, In.size)) * 3, jnp.float32), (Batch, In))
    y = hax.named(jnp.asarray(rng.standard_normal((Batch.size, Out.size)), jnp.float32), (Batch, Out))
    return {"x": x, "y": y}


def trainer(quantization, **kw):
    cfg = TrainerConfig(
        train_batch_size=Batch.size,
        num_train_steps=10,
        compilation_cache_dir=None,
        progress_bar=False,
        quantization=quantization,
        **kw,
    )
    return Trainer(cfg, optax.sgd(0.05), loss_fn)


FP8 = QuantizationConfig(fp8=True, amax_history_length=4)


def test_fp8_step_equals_the_namedtensor_recipe_and_keeps_state_out_of_the_optimizer():
    t = trainer(FP8)
    state = t.initial_state(build, key=jax.random.PRNGKey(0))
    model0 = jax.device_get(state.model)
    assert isinstance(model0.up_proj.dot_general, q.Fp8DotGeneralOp)
    assert isinstance(model0.lm_head.dot_general, q.DefaultDotGeneralOp)  # the output head stays plain
    # the FP8 scales and histories are not parameters: SGD's state has nothing, and they are not "trainable"
    mask = trainable_filter(model0)
    assert mask.up_proj.dot_general.input_scale is False
    assert mask.up_proj.weight.array is True

    # the reference: the recipe of ponente.namedtensor.quantization, by hand, two steps
    opt = optax.sgd(0.05)
    ref = model0
    opt_state = opt.init(eqx.filter(ref, trainable_filter(ref)))
    for seed in (1, 2):
        batch = make_batch(seed)
        grads = eqx.filter_grad(lambda m, b=batch: loss_fn(m, b, key=None))(ref)
        overwrites, grads = q.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state)
        ref = q.apply_updates(ref, updates, overwrites)
        state, metrics = t.train_step(state, make_batch(seed))
    got = jax.device_get(state.model)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # independently: the history holds the two inputs' absolute maxima, the newest in slot 0 (the others rotate)
    xs = [np.abs(np.asarray(make_batch(s)["x"].array)).max() for s in (2, 1)]
    history = np.asarray(got.up_proj.dot_general.input_amax_history)
    np.testing.assert_allclose(history[0], xs[0], rtol=1e-6)
    np.testing.assert_allclose(np.sort(history), np.sort([*xs, 0, 0]), rtol=1e-6)
    # the second step's scale came from the first step's history
    np.testing.assert_allclose(got.up_proj.dot_general.input_scale, [xs[1] / 448.0], rtol=1e-6)
    assert float(metrics["loss"]) > 0


def test_fp8_microbatches_record_the_batch_maximum():
    t = trainer(FP8, per_device_parallelism=2)
    assert t.num_microbatches == 4
    state = t.initial_state(build, key=jax.random.PRNGKey(0))
    batch = make_batch(3)
    state, _ = t.train_step(state, batch)
    history = np.asarray(jax.device_get(state.model).up_proj.dot_general.input_amax_history)
    np.testing.assert_allclose(history[0], np.abs(np.asarray(batch["x"].array)).max(), rtol=1e-6)
    np.testing.assert_array_equal(history[1:], 0)


def test_int8_step_differs_from_float_and_exports_plain():
    plain, int8 = trainer(None), trainer(QuantizationConfig(int8=True))
    s_plain = plain.initial_state(build, key=jax.random.PRNGKey(0))
    s_int8 = int8.initial_state(build, key=jax.random.PRNGKey(0))
    assert isinstance(s_int8.model.up_proj.dot_general, q.Int8DotGeneralOp)
    s_plain, m_plain = plain.train_step(s_plain, make_batch(1))
    s_int8, m_int8 = int8.train_step(s_int8, make_batch(1))
    # close (int8 keeps ~2 significant digits) but not equal: the products really were quantized
    assert float(m_int8["loss"]) == pytest.approx(float(m_plain["loss"]), rel=0.05)
    assert float(m_int8["loss"]) != float(m_plain["loss"])
    exported = plain_model(s_int8.model)
    assert isinstance(exported.up_proj.dot_general, q.DefaultDotGeneralOp)
    np.testing.assert_array_equal(exported.up_proj.weight.array, s_int8.model.up_proj.weight.array)


def test_bad_quantization_keys_name_the_key():
    with pytest.raises(ValueError, match=r"trainer\.quantization: set exactly one of fp8"):
        QuantizationConfig()
    with pytest.raises(ValueError, match=r"both are set"):
        QuantizationConfig(fp8=True, int8=True)
    with pytest.raises(ValueError, match=r"trainer\.quantization\.scaling"):
        QuantizationConfig(fp8=True, scaling="sometimes")  # type: ignore[arg-type]
    t = trainer(QuantizationConfig(fp8=True, targets=["q_proj"]))
    with pytest.raises(ValueError, match=r"trainer\.quantization\.targets: \['q_proj'\] selects none.*up_proj"):
        t.initial_state(build, key=jax.random.PRNGKey(0))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def test_levanter_yaml_with_fp8_and_profiler_trains_resumes_bitwise_and_exports_plain(
    tmp_path, tiny_lm_overrides, caplog
):
    """A YAML with Levanter's ``trainer.quantization`` and ``trainer.profiler`` runs; its checkpoints hold the FP8
    state; resuming from the step-2 checkpoint gives the uninterrupted run's step-4 state bit for bit; the export has
    only the model's weights."""
    import gzip
    import json
    import shutil

    from conftest import write_config
    from safetensors import safe_open

    from ponente.trainer.checkpoint import load_checkpoint
    from ponente.trainer.config import load_config
    from ponente.trainer.main import train_lm
    from ponente.trainer.main.train_lm import TrainLmConfig
    from ponente.trainer.tasks.lm import lm_loss_fn

    overrides = [
        *tiny_lm_overrides(4),
        "trainer.quantization={fp8: true, amax_history_length: 16}",
        "trainer.profiler=true",
        "trainer.profiler_start_step=1",
        "trainer.profiler_num_steps=1",
        "trainer.checkpointer.keep=[{every: 2}]",
        "trainer.checkpointer.save_interval=1h",
        "trainer.progress_bar=false",
        f"hf_save_path={tmp_path / 'hf'}",
    ]
    config_path = write_config(tmp_path, overrides)
    assert train_lm.main(["--config_path", str(config_path)]) == 0

    traces = list((tmp_path / "runs" / "tiny" / "profile").rglob("perfetto_trace.json.gz"))
    assert len(traces) == 1
    with gzip.open(traces[0]) as f:
        assert any(e.get("ph") == "X" for e in json.load(f)["traceEvents"])

    cfg = load_config(TrainLmConfig, overrides=overrides)
    t = Trainer(cfg.trainer, cfg.optimizer.build(cfg.trainer.num_train_steps), lm_loss_fn(0.0, None))
    Vocab = hax.Axis("vocab", data_vocab_size(cfg.data))
    template = t.initial_state(lambda key: cfg.model.build(Vocab, key=key))
    ckpt = tmp_path / "ckpt" / "tiny"
    reference = load_checkpoint(template, ckpt / "step-4")
    fp8_states = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(reference.model)
        if "input_amax_history" in jax.tree_util.keystr(path)
    ]
    assert fp8_states
    assert all(np.asarray(h).max() > 0 for h in fp8_states)

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert names
    assert not [n for n in names if "scale" in n or "amax" in n or "dot_general" in n]

    losses = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    shutil.rmtree(ckpt / "step-4")
    with caplog.at_level(logging.INFO, logger="ponente.trainer.run"):
        assert train_lm.main(["--config_path", str(config_path)]) == 0
    assert any("resuming from" in r.getMessage() and "step-2" in r.getMessage() for r in caplog.records)
    resumed = load_checkpoint(template, ckpt / "step-4")
    for a, b in zip(_leaves(resumed), _leaves(reference), strict=True):
        assert a.tobytes() == b.tobytes()
    again = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert [r["train/loss"] for r in again] == [r["train/loss"] for r in losses]


class WithFrozenCopy(eqx.Module):
    policy: TwoLayers
    reference: TwoLayers


def test_fp8_layers_outside_the_gradient_keep_their_state():
    """A quantized layer used only under ``stop_gradient`` (a DPO reference) or not at all gets a zero cotangent: its
    scales must not be overwritten by zeros (the next step would divide by them)."""

    def loss(model, batch, *, key):
        ref = jax.lax.stop_gradient(model.reference(batch["x"]))
        return hax.mean((model.policy(batch["x"]) - ref - batch["y"]) ** 2).scalar()

    def build_pair(key):
        return WithFrozenCopy(build(key), build(jax.random.fold_in(key, 1)))

    cfg = TrainerConfig(
        train_batch_size=Batch.size,
        num_train_steps=4,
        compilation_cache_dir=None,
        progress_bar=False,
        quantization=FP8,
    )
    t = Trainer(cfg, optax.sgd(0.05), loss)
    state = t.initial_state(build_pair, key=jax.random.PRNGKey(0))
    for seed in (1, 2, 3):
        state, metrics = t.train_step(state, make_batch(seed))
        assert np.isfinite(float(metrics["loss"]))
    model = jax.device_get(state.model)
    frozen = model.reference.up_proj.dot_general
    np.testing.assert_array_equal(frozen.input_scale, [1.0])  # untouched: still the initial state
    np.testing.assert_array_equal(frozen.input_amax_history, 0)
    trained = model.policy.up_proj.dot_general
    # the third step's scale: the largest input of the two steps before it
    seen = max(np.abs(np.asarray(make_batch(s)["x"].array)).max() for s in (1, 2))
    np.testing.assert_allclose(trained.input_scale, [seen / 448.0], rtol=1e-6)
