"""Skip-step on crafted loss and gradient-norm sequences, against a plain Python rolling-statistics loop."""

from __future__ import annotations

import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo_support import copied_parameters

from ponente.trainer.optim import AdamConfig, optimizer_metrics, skip_bad_steps

WINDOW, SIGMA, WARMUP = 4, 2.0, 3


def _expected_skips(losses: list[float], gnorms: list[float]) -> list[bool]:
    """The rule written out: skip non-finite steps, and after WARMUP finite steps any value above the
    mean + SIGMA * std (population) of the last WINDOW finite values; every finite value enters the window."""
    seen_l: list[float] = []
    seen_g: list[float] = []
    skips = []
    for loss, gn in zip(losses, gnorms):
        finite = math.isfinite(loss) and math.isfinite(gn)
        skip = not finite
        if finite and len(seen_l) >= WARMUP:
            wl, wg = seen_l[-WINDOW:], seen_g[-WINDOW:]
            spike_l = loss > statistics.fmean(wl) + SIGMA * statistics.pstdev(wl)
            spike_g = gn > statistics.fmean(wg) + SIGMA * statistics.pstdev(wg)
            skip = spike_l or spike_g
        if finite:
            seen_l.append(loss)
            seen_g.append(gn)
        skips.append(skip)
    return skips


def test_skip_step_on_a_crafted_sequence():
    losses = [1.0, 1.1, 0.9, 1.0, 5.0, 1.05, math.nan, 0.95, 1.0, 1.02, 0.98, math.inf, 1.01, 1.0]
    scales = [1.0, 1.1, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 50.0, 1.0, math.nan, 1.0, 1.0, 1.05]
    gnorms = [2.0 * s for s in scales]  # the gradient is [s, s, s, s]: its norm is 2s
    want = _expected_skips(losses, gnorms)
    assert want.count(True) >= 4  # the sequence exercises loss spikes, grad spikes and non-finite values

    opt = skip_bad_steps(optax.adam(0.1), window=WINDOW, sigma=SIGMA, warmup=WARMUP)
    params = jnp.zeros(4)
    state = opt.init(params)
    update = jax.jit(lambda g, s, p, loss: opt.update(g, s, p, loss=loss))
    got = []
    for loss, scale in zip(losses, scales):
        before = state.inner_state
        upd, state = update(jnp.full(4, scale, jnp.float32), state, params, jnp.float32(loss))
        got.append(bool(state.skipped))
        if got[-1]:
            assert np.all(np.asarray(upd) == 0.0)
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.inner_state)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            assert np.all(np.asarray(upd) != 0.0)
        params = params + upd
    assert got == want
    assert int(state.num_skipped) == want.count(True)


def test_skip_step_through_the_config():
    cfg = AdamConfig(skip_bad_steps=True, skip_step_window=3, skip_step_warmup=2, warmup=0.0, lr_schedule="constant")
    opt = cfg.build(10)
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    _, state = opt.update({"w": jnp.ones(3)}, state, params, loss=jnp.float32(2.0))
    upd, state = opt.update({"w": jnp.ones(3)}, state, params, loss=jnp.float32(jnp.nan))
    metrics = optimizer_metrics(state)
    assert float(metrics["optim/skipped"]) == 1.0
    assert int(metrics["optim/num_skipped"]) == 1
    assert float(metrics["optim/update_norm"]) == 0.0
    assert np.all(np.asarray(upd["w"]) == 0.0)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="skip_step_window"):
        skip_bad_steps(optax.sgd(1.0), window=0)
    with pytest.raises(ValueError, match="skip_step_window"):
        AdamConfig(skip_step_window=0)


def test_skip_step_updates_the_inner_state_in_place():
    """The skip is a conditional: a donated Adam state is updated in place (XLA copies neither moment), and the
    parameters and moments of a kept step equal plain Adam's, and a skipped step keeps the parameters."""
    opt = skip_bad_steps(optax.adam(1e-2), window=WINDOW, sigma=SIGMA, warmup=WARMUP)
    params = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8), "b": jnp.ones(8)}

    def step(p, state, scale):
        grads = jax.tree.map(lambda x: x * scale, p)
        updates, state = opt.update(grads, state, p, loss=jnp.sum(grads["w"]))
        return optax.apply_updates(p, updates), state

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt.init(params), 1.0).compile()
    copied = copied_parameters(compiled.as_text())
    # at most the rolling statistics (the loss and norm windows, the count): never the parameters or the moments
    assert all(any(name in c for name in ("losses", "grad_norms", "num_observed")) for c in copied), copied

    plain = optax.adam(1e-2)
    got, state = jax.tree.map(jnp.copy, (params, opt.init(params)))  # distinct buffers, each donated once
    want, want_state = jax.tree.map(jnp.copy, params), plain.init(params)
    for scale in (1.0, 0.5, float("nan"), 2.0):
        before = jax.tree.map(np.asarray, got)
        got, state = compiled(got, state, scale)
        if math.isfinite(scale):
            grads = jax.tree.map(lambda x, s=scale: x * s, want)
            updates, want_state = plain.update(grads, want_state, want)
            want = optax.apply_updates(want, updates)
            for a, b in zip(jax.tree.leaves((got, state.inner_state)), jax.tree.leaves((want, want_state))):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6)  # compiled vs op by op
        else:
            assert bool(state.skipped)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(before)):
                np.testing.assert_array_equal(np.asarray(a), b)
