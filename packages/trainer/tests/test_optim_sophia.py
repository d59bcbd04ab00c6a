"""Sophia-H against a NumPy loop with the explicit Hessian of a quadratic; Hutchinson's estimator."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray
from ponente.trainer.optim import SophiaHConfig, hutchinson_diagonal, scale_by_sophia_h

A = hax.Axis("a", 4)
D_W = np.array([4.0, -2.0, 0.5, 10.0])  # includes a negative curvature: max(γh, ε) must take over
D_V = np.array([1.0, 3.0, 0.02])
B_W = np.array([1.0, -2.0, 0.3, 0.5])
B_V = np.array([-0.5, 0.2, 1.0])


def _loss(params: dict) -> jax.Array:
    w, v = params["w"].array, params["v"]
    return 0.5 * jnp.sum(D_W * w**2) + 0.5 * jnp.sum(D_V * v**2) + jnp.sum(B_W * w) + jnp.sum(B_V * v)


def test_sophia_h_matches_numpy_on_a_quadratic():
    w0, v0 = np.array([1.0, 0.5, -2.0, 0.3]), np.array([0.7, -1.0, 4.0])
    params = {"w": NamedArray(jnp.asarray(w0, jnp.float32), (A,)), "v": jnp.asarray(v0, jnp.float32)}
    lr, wd, b1, b2, gamma, eps, k, clip, steps = 0.1, 0.1, 0.9, 0.5, 0.2, 1e-3, 2, 1.0, 5
    cfg = SophiaHConfig(
        learning_rate=lr,
        weight_decay=wd,
        beta1=b1,
        beta2=b2,
        gamma=gamma,
        epsilon=eps,
        update_interval=k,
        clip_threshold=clip,
        max_grad_norm=None,
        warmup=0.0,
        lr_schedule="constant",
    )
    opt = cfg.build(steps)
    state = opt.init(params)
    step = eqx.filter_jit(lambda g, s, p, key: opt.update(g, s, p, loss=_loss(p), obj_fn=_loss, key=key))
    for t in range(steps):
        grads = jax.grad(_loss)(params)
        upd, state = step(grads, state, params, jax.random.key(t))
        params = eqx.apply_updates(params, upd)

    x = np.concatenate([w0, v0])
    hess_diag = np.concatenate([D_W, D_V])  # the explicit Hessian is diagonal: Hutchinson is exact
    b = np.concatenate([B_W, B_V])
    m, h = np.zeros_like(x), np.zeros_like(x)
    for t in range(steps):
        g = hess_diag * x + b
        m = b1 * m + (1 - b1) * g
        if t % k == 0:
            h = b2 * h + (1 - b2) * hess_diag
        direction = np.clip(m / np.maximum(gamma * h, eps), -clip, clip)
        x = x - lr * (direction + wd * x)  # a dict of plain arrays: the default mask decays every leaf
    np.testing.assert_allclose(np.asarray(params["w"].array), x[:4], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(params["v"]), x[4:], rtol=1e-5, atol=1e-6)


def test_hutchinson_is_unbiased_for_a_full_hessian():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(5, 5))
    hessian = (q + q.T) / 2

    def f(x: jax.Array) -> jax.Array:
        return 0.5 * x @ jnp.asarray(hessian, jnp.float32) @ x

    keys = jax.random.split(jax.random.key(0), 4000)
    samples = np.asarray(jax.vmap(lambda key: hutchinson_diagonal(f, jnp.ones(5), key))(keys))
    # each sample is diag(H) + sum_{j != i} H_ij u_i u_j with u = ±1: check its values and its mean
    off = np.abs(hessian).sum(axis=1) - np.abs(np.diag(hessian))
    assert np.all(np.abs(samples - np.diag(hessian)) <= off + 1e-5)
    stderr = np.sqrt((hessian**2).sum(axis=1) - np.diag(hessian) ** 2) / np.sqrt(len(keys))
    assert np.all(np.abs(samples.mean(axis=0) - np.diag(hessian)) < 5 * stderr + 1e-6)


def test_sophia_needs_obj_fn_and_key():
    opt = scale_by_sophia_h()
    params = jnp.ones(3)
    with pytest.raises(ValueError, match=r"missing \['obj_fn', 'key'\]"):
        opt.update(params, opt.init(params), params)


def test_hessian_refreshes_only_every_k_steps():
    opt = scale_by_sophia_h(b2=0.0, update_interval=3)
    params = jnp.ones(2)
    state = opt.init(params)
    seen = []
    for t in range(5):
        curvature = jnp.array([1.0, 2.0]) * (t + 1)

        def f(p: jax.Array, c: jax.Array = curvature) -> jax.Array:
            return 0.5 * jnp.sum(c * p**2)

        _, state = opt.update(params, state, params, obj_fn=f, key=jax.random.key(t))
        seen.append(np.asarray(state.hessian).tolist())
    # refreshed at steps 0 and 3 (b2 = 0: the EMA is the latest estimate)
    assert seen == [[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [4.0, 8.0], [4.0, 8.0]]
