"""The training loop: accumulation equals a full batch, mixed precision, the loop, NaNs, hooks, Ctrl-C, errors."""

import functools
import logging
import os
import signal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo_support import copied_parameters

import ponente.namedtensor as hax
from ponente.models import LlamaConfig, LmExample, compute_next_token_loss
from ponente.trainer.callbacks import Hook, as_hook
from ponente.trainer.trainer import NonFiniteLossError, Trainer, TrainerConfig

Vocab = hax.Axis("vocab", 13)
MODEL = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)


def lm_loss(model, example, *, key):
    return compute_next_token_loss(model, example, key=key)


def make_batch(seed, batch_size=8, drop_some=True):
    """A batch of random tokens whose loss masks hold different numbers of tokens per example."""
    rng = np.random.default_rng(seed)
    tokens = hax.named(
        jnp.asarray(rng.integers(0, Vocab.size, (batch_size, MODEL.seq_len)), jnp.int32), ("batch", "position")
    )
    mask = (rng.random((batch_size, MODEL.seq_len)) < 0.6) if drop_some else np.ones((batch_size, MODEL.seq_len))
    return LmExample.causal(tokens, loss_mask=hax.named(jnp.asarray(mask, jnp.float32), ("batch", "position")))


def config(**kw):
    defaults = {"train_batch_size": 8, "num_train_steps": 20, "compilation_cache_dir": None, "progress_bar": False}
    return TrainerConfig(**{**defaults, **kw})


def build(key):
    return MODEL.build(Vocab, key=key)


@functools.cache
def _shared(crash_on_nan=True, nan=False):
    return Trainer(
        config(num_train_steps=10, steps_per_eval=4, crash_on_nan=crash_on_nan),
        optax.sgd(0.1),
        nan_loss if nan else lm_loss,
    )


def shared_trainer(*, hooks=(), log_fn=None, flops_per_token=None, crash_on_nan=True, nan=False):
    """One compiled trainer per (loss, crash_on_nan) for the loop tests, with fresh hooks and logging."""
    trainer = _shared(crash_on_nan, nan)
    trainer.hooks = [as_hook(h) for h in hooks]
    trainer.log_fn = log_fn
    trainer.flops_per_token = flops_per_token
    return trainer


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_inexact_array))]


def keep_gradients():
    """An "optimizer" that stores the gradients it receives as its state and leaves the parameters alone."""

    def init(params):
        return jax.tree_util.tree_map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        return jax.tree_util.tree_map(jnp.zeros_like, grads), grads

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("per_device", [2])
def test_gradient_accumulation_equals_the_full_batch(per_device):
    batch = make_batch(0)
    model = build(jax.random.PRNGKey(1))
    # reference: the gradient of the full batch's mean loss, computed directly
    ref_loss, ref_grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, b: compute_next_token_loss(m, b).array))(
        model, batch
    )

    trainer = Trainer(config(per_device_parallelism=per_device), keep_gradients(), lm_loss)
    assert trainer.num_microbatches == 8 // per_device
    state = trainer.initial_state(lambda key: model, key=jax.random.PRNGKey(0))
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(ref_grad)), rtol=1e-6)
    for got, want in zip(leaves(state.opt_state), leaves(ref_grad), strict=True):
        # float32 sums in another order: agree to 1e-6 of the leaf's gradient scale
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _scan_constants(jaxpr):
    """The closed-over inputs (constants) of the scans of a jaxpr, inner jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.extend(eqn.invars[: eqn.params["num_consts"]])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_scan_constants(sub))
    return found


def test_gradient_accumulation_in_bf16_casts_the_model_once_and_sums_each_microbatch():
    """With a bf16 compute policy the accumulated gradient is the weighted sum of each microbatch's gradient wrt
    the float32 parameters cast inside the loss (computed here one microbatch at a time); the cast is done once,
    before the loop over microbatches, which then closes over bf16 weights, not float32 ones."""
    from ponente.trainer.trainer._step import TrainStep

    batch = make_batch(4)
    model = build(jax.random.PRNGKey(2))
    bf16 = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tree
    )

    @eqx.filter_jit
    def micro_sum(m, b):
        loss, grad = eqx.filter_value_and_grad(lambda p: compute_next_token_loss(bf16(p), b, reduction="sum").array)(m)
        return loss, grad, jnp.sum(b.loss_mask.array)

    total_loss, total_grad, total_weight = 0.0, None, 0.0
    for i in range(4):  # microbatches of 2 examples, in order
        loss, grad, weight = micro_sum(model, _slice_rows(batch, 2 * i, 2 * i + 2))
        total_loss += float(loss)
        total_weight += float(weight)
        grad = jax.tree_util.tree_map(np.asarray, eqx.filter(grad, eqx.is_inexact_array))
        total_grad = grad if total_grad is None else jax.tree_util.tree_map(np.add, total_grad, grad)
    want = [g / total_weight for g in jax.tree_util.tree_leaves(total_grad)]

    trainer = Trainer(config(per_device_parallelism=2, mp="p=f32,c=bfloat16"), keep_gradients(), lm_loss)
    assert trainer.num_microbatches == 4
    state = trainer.initial_state(lambda key: model, key=jax.random.PRNGKey(0))
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), total_loss / total_weight, rtol=1e-3)
    got = leaves(state.opt_state)
    assert {g.dtype for g in got} == {np.dtype(np.float32)}
    for g, w in zip(got, want, strict=True):
        # bf16 products: the same math, a few bf16 roundings apart (XLA fuses the two programs differently)
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-2 * np.abs(w).max())

    # the loop over microbatches closes over the weights cast to bf16, not over the float32 parameters
    step = TrainStep(
        loss_fn=lm_loss,
        optimizer=keep_gradients(),
        mp=trainer.mp,
        batch_axis="batch",
        num_microbatches=4,
        compute_axis_mapping={},
        loss_weight_fn=trainer.loss_weight_fn,
        optimizer_metrics_fn=lambda _: {},
        lr_schedule=None,
    )
    trainable, rest = eqx.partition(model, eqx.is_inexact_array)
    no_fp8_state = eqx.filter(model, lambda _: False)  # the overwritten (FP8) states: none in this model
    jaxpr = jax.make_jaxpr(step._accumulate)((trainable, no_fp8_state), rest, batch, jax.random.PRNGKey(0))
    floats = [v.aval for v in _scan_constants(jaxpr.jaxpr) if jnp.issubdtype(v.aval.dtype, jnp.floating)]
    weights = [a for a in floats if a.ndim >= 2]
    assert weights, "expected the microbatch loop to close over the model's weights"
    assert {w.dtype for w in weights} == {jnp.dtype(jnp.bfloat16)}, weights


def _slice_rows(example, start, stop):
    return LmExample.causal(
        hax.named(example.tokens.array[start:stop], ("batch", "position")),
        loss_mask=hax.named(example.loss_mask.array[start:stop], ("batch", "position")),
    )


def test_extra_metrics_of_the_loss_are_logged_and_accumulated_like_the_loss():
    """A loss returning ``(loss, {name: value})``: the value is a token-weighted mean over the microbatches."""

    def loss_with_metric(model, example, *, key):
        loss = compute_next_token_loss(model, example, key=key)
        # per microbatch: the mean token id over loss tokens (a value we can compute independently)
        mask = example.loss_mask.array
        return loss, {"mean_token": jnp.sum(example.tokens.array * mask) / jnp.sum(mask)}

    batch = make_batch(3)
    mask = np.asarray(batch.loss_mask.array)
    expected = float(np.sum(np.asarray(batch.tokens.array) * mask) / np.sum(mask))
    for per_device in (8, 2):
        trainer = Trainer(config(per_device_parallelism=per_device), optax.sgd(0.0), loss_with_metric)
        state = trainer.initial_state(build, key=jax.random.PRNGKey(0))
        _, metrics = trainer.train_step(state, batch)
        np.testing.assert_allclose(float(metrics["mean_token"]), expected, rtol=1e-6)
        assert trainer._step_metrics(jax.device_get(metrics), 1, 8, 1.0, 0.0, None, 1)["train/mean_token"] == float(
            metrics["mean_token"]
        )


def test_mixed_precision_computes_in_bf16_and_keeps_f32_parameters():
    seen = {}

    def recording_loss(model, example, *, key):
        seen["params"] = {x.dtype for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))}
        logits = model(example.tokens, example.attn_mask, key=key)
        seen["logits"] = logits.dtype
        loss = compute_next_token_loss(model, example, key=key)
        seen["loss"] = loss.dtype
        return loss

    schedule = optax.linear_schedule(1e-3, 0.0, 10)
    trainer = Trainer(config(mp="p=f32,c=bfloat16"), optax.adam(schedule), recording_loss, lr_schedule=schedule)
    state = trainer.initial_state(build)
    state, metrics = trainer.train_step(state, make_batch(0))
    state, metrics = trainer.train_step(state, make_batch(1))
    assert float(metrics["learning_rate"]) == pytest.approx(0.9e-3)  # schedule(1): the second step
    assert seen["params"] == {jnp.dtype(jnp.bfloat16)}
    assert seen["logits"] == jnp.bfloat16
    assert seen["loss"] == jnp.float32
    assert {x.dtype for x in leaves(state.model)} == {np.dtype(np.float32)}
    assert {x.dtype for x in leaves(state.opt_state)} == {np.dtype(np.float32)}
    assert metrics["loss"].dtype == jnp.float32


def test_policy_casts_parameters_at_init():
    trainer = Trainer(config(mp="p=bfloat16,c=bfloat16"), optax.sgd(0.1), lm_loss)
    state = trainer.initial_state(lambda key: {"w": jax.random.normal(key, (3,)), "n": jnp.arange(3)})
    assert state.model["w"].dtype == jnp.bfloat16
    assert state.model["n"].dtype == jnp.int32  # integers are not cast


def test_bad_policy_names_the_key():
    with pytest.raises(ValueError, match=r"trainer\.mp"):
        Trainer(config(mp="p=f33"), optax.sgd(0.1), lm_loss)


def test_the_loop_reduces_the_loss_and_logs_every_step():
    batches = [make_batch(i, drop_some=False) for i in range(2)]
    logged = []
    trainer = Trainer(
        config(num_train_steps=20),
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),  # the learning rate metric is read from it
        lm_loss,
        log_fn=lambda metrics, step: logged.append((step, metrics)),
        flops_per_token=MODEL.flops_per_token(Vocab.size),
    )
    state = trainer.initial_state(build)
    initial = trainer.eval_loss(state, batches)
    state = trainer.train(state, ((s, batches[s % 2]) for s in range(100)))
    assert int(state.step) == 20
    final = trainer.eval_loss(state, batches)
    assert final < 0.8 * initial, (initial, final)
    train_logs = [(s, m) for s, m in logged if "train/loss" in m]
    assert [s for s, _ in train_logs] == list(range(1, 21))
    _step, last = train_logs[-1]
    for key in ("train/grad_norm", "throughput/tokens_per_second", "throughput/examples_per_second"):
        assert last[key] > 0
    assert last["optim/learning_rate"] == pytest.approx(1e-2)
    assert "optim/count" not in last  # only the optimizer's metrics, not its whole state
    np.testing.assert_allclose(last["throughput/tokens_per_second"], 8 * 8 / last["throughput/step_seconds"])
    assert "throughput/mfu" not in last  # CPU: no peak FLOP/s known


def test_mfu_metric_is_model_flops_over_peak(monkeypatch):
    monkeypatch.setattr("ponente.trainer.trainer._loop.device_peak_flops", lambda kind, dtype: 2e12)
    fpt = MODEL.flops_per_token(Vocab.size)
    logged = []
    trainer = shared_trainer(flops_per_token=fpt, log_fn=lambda m, s: logged.append(m))
    batch = make_batch(0)
    trainer.train(trainer.initial_state(build), ((s, batch) for s in range(2)))
    last = logged[-1]
    hand = 3 * fpt * (8 * 8) / last["throughput/step_seconds"] / 2e12
    assert last["throughput/mfu"] == pytest.approx(hand, rel=1e-9)


def test_eval_loss_weights_batches_by_loss_tokens():
    trainer = shared_trainer()
    state = trainer.initial_state(build)
    batches = [make_batch(3, batch_size=4), make_batch(4, batch_size=4)]
    sums = [float(compute_next_token_loss(state.model, b, reduction="sum").array) for b in batches]
    counts = [float(b.loss_mask.array.sum()) for b in batches]
    assert counts[0] != counts[1]
    assert trainer.eval_loss(state, batches) == pytest.approx(sum(sums) / sum(counts), rel=1e-5)


def nan_loss(model, example, *, key):
    return compute_next_token_loss(model, example, key=key) * jnp.nan


def test_nan_loss_raises_with_the_step():
    trainer = shared_trainer(nan=True)
    batch = make_batch(0)
    with pytest.raises(NonFiniteLossError, match=r"step 1: non-finite loss=nan"):
        trainer.train(trainer.initial_state(build), ((s, batch) for s in range(5)))


def test_nan_loss_is_logged_when_crash_on_nan_is_off(caplog):
    trainer = shared_trainer(nan=True, crash_on_nan=False)
    batch = make_batch(0)
    with caplog.at_level(logging.ERROR, logger="ponente.trainer.trainer"):
        state = trainer.train(trainer.initial_state(build), ((s, batch) for s in range(2)))
    assert int(state.step) == 2
    assert "step 2: non-finite loss=nan" in caplog.text


def test_hooks_run_at_their_steps_and_once_at_the_end():
    calls = {"every3": [], "every5": [], "each": []}
    hooks = [
        Hook(lambda info: calls["every3"].append((info.step, info.final)), every=3),
        Hook(lambda info: calls["every5"].append((info.step, info.final)), every=5),
        lambda info: calls["each"].append(int(info.state.step)),
    ]
    evals = []
    trainer = shared_trainer(hooks=hooks)  # num_train_steps=10, steps_per_eval=4
    batch = make_batch(0)
    trainer.train(
        trainer.initial_state(build),
        ((s, batch) for s in range(100)),
        eval_fn=lambda st: evals.append(int(st.step)) or 1.0,
    )
    assert calls["every3"] == [(3, False), (6, False), (9, False), (10, True)]
    assert calls["every5"] == [(5, False), (10, False)]
    assert calls["each"] == list(range(1, 11))
    assert evals == [4, 8]


def test_first_ctrl_c_stops_at_the_step_boundary():
    def interrupt(info):
        os.kill(os.getpid(), signal.SIGINT)

    trainer = shared_trainer(hooks=[Hook(interrupt, every=3)])
    batch = make_batch(0)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the tests run as a background job
    state = trainer.train(trainer.initial_state(build), ((s, batch) for s in range(100)))
    assert int(state.step) == 3
    assert trainer.stop_requested is None  # reset for the next call
    assert trainer.last_stop_reason == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


def test_second_ctrl_c_raises_keyboard_interrupt():
    def interrupt_twice(info):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    trainer = shared_trainer(hooks=[Hook(interrupt_twice, every=2)])
    batch = make_batch(0)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        trainer.train(trainer.initial_state(build), ((s, batch) for s in range(100)))
    assert signal.getsignal(signal.SIGINT) is before


def test_request_stop_from_a_hook():
    trainer = shared_trainer()
    trainer.hooks.append(Hook(lambda info: trainer.request_stop("SIGTERM"), every=2))
    batch = make_batch(0)
    assert int(trainer.train(trainer.initial_state(build), ((s, batch) for s in range(100))).step) == 2


def test_loader_step_must_match_the_state():
    trainer = shared_trainer()
    batch = make_batch(0)
    with pytest.raises(ValueError, match="batch for step 5, but the state is at step 0"):
        trainer.train(trainer.initial_state(build), ((s, batch) for s in range(5, 10)))


def test_batch_and_mesh_errors_name_the_keys():
    with pytest.raises(ValueError, match=r"per_device_parallelism=3 x data axis size 1"):
        Trainer(config(per_device_parallelism=3), optax.sgd(0.1), lm_loss)
    with pytest.raises(ValueError, match=r"model_axis_size=2 does not divide the 1 devices"):
        Trainer(config(model_axis_size=2), optax.sgd(0.1), lm_loss, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"trainer\.train_batch_size must be >= 1"):
        config(train_batch_size=0)
    trainer = shared_trainer()
    with pytest.raises(ValueError, match=r"batch has 4 examples along axis 'batch'.*train_batch_size is 8"):
        trainer.train_step(trainer.initial_state(build), make_batch(0, batch_size=4))


def test_same_seed_same_bits():
    batch = make_batch(0)
    trainer = shared_trainer()

    def run():
        state = trainer.initial_state(build)
        for _ in range(2):
            state, _ = trainer.train_step(state, batch)
        return [*leaves(state.model), np.asarray(state.training_key)]

    first, second = run(), run()
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    other = trainer.initial_state(build, key=jax.random.PRNGKey(1))
    assert not np.array_equal(leaves(other.model)[0], leaves(trainer.initial_state(build).model)[0])


@pytest.mark.multidevice
@pytest.mark.parametrize("per_device", [-1, 1])
def test_data_parallel_on_eight_devices_equals_one_device(per_device):
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    batches = [make_batch(i, batch_size=16) for i in range(2)]

    def run(devices, per_device):
        trainer = Trainer(
            config(train_batch_size=16, per_device_parallelism=per_device), optax.adam(1e-2), lm_loss, devices=devices
        )
        state = trainer.initial_state(build)
        losses = []
        for batch in batches:
            state, metrics = trainer.train_step(state, trainer.shard_batch(batch))
            losses.append(float(metrics["loss"]))
        return losses, leaves(state.model), state

    one_losses, one_params, _ = run(jax.devices()[:1], -1)
    losses, params, state = run(jax.devices(), per_device)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    for a, b in zip(params, one_params):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # parameters are stored FSDP: every array with an "embed" axis is split over "data" along it
    named = jax.tree_util.tree_leaves(state.model, is_leaf=lambda x: isinstance(x, hax.NamedArray))
    with_embed = [x for x in named if isinstance(x, hax.NamedArray) and x.has_axis("embed")]
    assert with_embed
    for x in with_embed:
        assert x.array.sharding.spec[x.axis_indices("embed")] == "data"


@pytest.mark.multidevice
def test_batch_must_divide_over_the_data_axis():
    with pytest.raises(ValueError, match="train_batch_size=4 is not divisible by the data axis size 8"):
        Trainer(config(train_batch_size=4), optax.sgd(0.1), lm_loss)
    with pytest.raises(ValueError, match="model_axis_size=3 does not divide the 8 devices"):
        Trainer(config(model_axis_size=3), optax.sgd(0.1), lm_loss)


def _leaves_bytes(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def test_initial_state_from_the_seed_matches_keys_split_by_hand():
    trainer = Trainer(config(seed=3), optax.adam(1e-2), lm_loss)
    state = trainer.initial_state(build)
    # the same state from an explicit root key (another compiled program), and keys split eagerly by hand
    explicit = trainer.initial_state(build, key=jax.random.PRNGKey(3))
    assert _leaves_bytes(state) == _leaves_bytes(explicit)
    model_key, training_key = jax.random.split(jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(state.training_key), np.asarray(training_key))
    reference = build(model_key)  # eager: other XLA programs, so equal up to rounding
    for got, want in zip(jax.tree_util.tree_leaves(state.model), jax.tree_util.tree_leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    assert int(state.step) == 0


def test_compile_step_means_the_first_step_does_not_compile():
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    batches = [make_batch(s) for s in range(2)]
    trainer = Trainer(config(seed=1), optax.adam(1e-2), lm_loss)
    state = trainer.initial_state(build)
    placeholder = jax.tree_util.tree_map(jnp.zeros_like, batches[0])
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        compiled = trainer.compile_step(state, placeholder)
        assert len(compiles) >= 1  # the step itself (plus any helper the placement needs)
        # the compiled step is returned: what XLA planned for it can be read (benchmarks record the scratch)
        assert compiled.memory_analysis().temp_size_in_bytes > 0
        assert compiled.cost_analysis()["flops"] > 0
        # the donated state (parameters, Adam's moments) is updated in place: XLA copies none of the step's inputs
        # (an element-wise select of the new and the old state for the non-finite guard made it copy the moments)
        assert copied_parameters(compiled.as_text()) == []
        compiles.clear()
        for batch in batches:
            state, metrics = trainer.train_step(state, trainer.shard_batch(batch))
        losses = [float(metrics["loss"])]
        assert compiles == []
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    # an independent trainer that compiles on the first call gives the same bits
    other = Trainer(config(seed=1), optax.adam(1e-2), lm_loss)
    other_state = other.initial_state(build)
    for batch in batches:
        other_state, other_metrics = other.train_step(other_state, other.shard_batch(batch))
    assert losses == [float(other_metrics["loss"])]
    assert _leaves_bytes(state.model) == _leaves_bytes(other_state.model)


def test_compile_step_checks_the_batch_size():
    trainer = Trainer(config(), optax.sgd(0.1), lm_loss)
    state = trainer.initial_state(build)
    with pytest.raises(ValueError, match="train_batch_size is 8"):
        trainer.compile_step(state, make_batch(0, batch_size=4))
