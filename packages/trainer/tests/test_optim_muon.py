"""Muon: Newton-Schulz against NumPy (same polynomial, and SVD's polar factor), and full updates vs a NumPy loop."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray
from ponente.namedtensor.nn import Embedding, Linear
from ponente.trainer.optim import MuonConfig, newton_schulz, orthogonalize_linear_update


def _np_newton_schulz(g: np.ndarray, steps: int = 5, eps: float = 1e-7) -> np.ndarray:
    x = g.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (np.linalg.norm(x) + eps)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(2, 9), cols=st.integers(2, 9), seed=st.integers(0, 100))
def test_newton_schulz_approximates_the_polar_factor(rows, cols, seed):
    g = np.random.default_rng(seed).normal(size=(rows, cols))
    got = np.asarray(newton_schulz(jnp.asarray(g, jnp.float32)), np.float64)
    np.testing.assert_allclose(got, _np_newton_schulz(g), rtol=2e-3, atol=2e-4)
    u, sigma, vt = np.linalg.svd(g, full_matrices=False)
    # same singular vectors as U Vᵀ; each singular value goes through the scalar quintic five times
    core = u.T @ got @ vt.T
    sv = np.diag(core)
    np.testing.assert_allclose(core - np.diag(sv), 0.0, atol=1e-3)
    x = sigma / np.linalg.norm(g)
    for _ in range(5):
        x = 3.4445 * x - 4.7750 * x**3 + 2.0315 * x**5
    np.testing.assert_allclose(sv, x, atol=2e-3)
    # which lands in the quintic's band, about [0.7, 1.2], unless a singular value is tiny relative to the norm
    assert np.all(sv < 1.25), sv
    assert np.all(sv[sigma / np.linalg.norm(g) > 3e-3] > 0.55), sv


def test_newton_schulz_batches_leading_axes():
    g = np.random.default_rng(0).normal(size=(3, 4, 6))
    got = np.asarray(newton_schulz(jnp.asarray(g, jnp.float32)))
    for i in range(3):
        np.testing.assert_allclose(got[i], _np_newton_schulz(g[i]), rtol=2e-3, atol=2e-4)


Layers, Embed, Heads, HeadDim, Vocab = hax.make_axes(layers=2, embed=6, heads=2, head_dim=4, vocab=5)


def test_orthogonalize_flattens_in_and_out_axes():
    rng = np.random.default_rng(1)
    arr = rng.normal(size=(Layers.size, Embed.size, Heads.size, HeadDim.size))  # In-first layout, stacked
    update = NamedArray(jnp.asarray(arr, jnp.float32), (Layers, Embed, Heads, HeadDim))
    got = orthogonalize_linear_update(update, Embed, (Heads, HeadDim))
    assert got.axes == update.axes
    for layer in range(Layers.size):
        mat = arr[layer].reshape(6, 8).T  # (Out = heads*head_dim, In = embed)
        want = _np_newton_schulz(mat) * np.sqrt(max(1.0, 8 / 6))
        np.testing.assert_allclose(np.asarray(got.array[layer]).reshape(6, 8).T, want, rtol=2e-3, atol=2e-4)
    kimi = orthogonalize_linear_update(update, Embed, (Heads, HeadDim), kimi_scaling=True)
    np.testing.assert_allclose(
        np.asarray(kimi.array), np.asarray(got.array) / np.sqrt(8 / 6) * 0.2 * np.sqrt(8), rtol=1e-5
    )
    with pytest.raises(ValueError, match="missing the layer axis 'vocab'"):
        orthogonalize_linear_update(update, Vocab, Embed)


class Tiny(eqx.Module):
    proj: Linear  # stacked, multi-axis Out, In-first layout: Muon
    emb: Embedding  # AdamW
    lm_head: Linear  # AdamW by default


def _tiny(rng: np.random.Generator) -> Tiny:
    def arr(*axes: hax.Axis) -> NamedArray:
        return NamedArray(jnp.asarray(rng.normal(size=[a.size for a in axes]), jnp.float32), axes)

    return Tiny(
        proj=Linear(arr(Layers, Embed, Heads, HeadDim), arr(Layers, Heads, HeadDim), Embed, (Heads, HeadDim)),
        emb=Embedding(arr(Vocab, Embed), Vocab, Embed),
        lm_head=Linear(arr(Vocab, Embed), None, Embed, Vocab),
    )


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_numpy_loop(nesterov):
    rng = np.random.default_rng(2)
    model = _tiny(rng)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(model)]
    names = ["proj.weight", "proj.bias", "emb.weight", "lm_head.weight"]
    assert len(leaves) == len(names)
    grads = [[rng.normal(size=x.shape) for x in leaves] for _ in range(3)]
    lr, adam_lr, wd, adam_wd, mu, max_norm = 0.02, 0.01, 0.1, 0.2, 0.9, 3.0
    cfg = MuonConfig(
        learning_rate=lr,
        adam_lr=adam_lr,
        weight_decay=wd,
        adam_weight_decay=adam_wd,
        momentum=mu,
        nesterov=nesterov,
        beta1=0.8,
        beta2=0.9,
        epsilon=1e-6,
        max_grad_norm=max_norm,
        warmup=0.0,
        lr_schedule="constant",
    )
    opt = cfg.build(10)
    state = opt.init(model)
    treedef = jax.tree.structure(model)
    update = eqx.filter_jit(lambda g, s, p: opt.update(g, s, p, loss=jnp.float32(1.0)))
    ours = model
    for g in grads:
        upd, state = update(jax.tree.unflatten(treedef, [jnp.asarray(x, jnp.float32) for x in g]), state, ours)
        ours = eqx.apply_updates(ours, upd)

    p = [x.copy() for x in leaves]
    buf = np.zeros_like(p[0])
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    decayed = {"proj.weight", "lm_head.weight"}  # the default mask: Linear weights
    for t, g in enumerate(grads):
        norm = np.sqrt(sum(np.sum(x**2) for x in g))
        g = [x * min(1.0, max_norm / norm) for x in g]
        buf = mu * buf + g[0]
        d = g[0] + mu * buf if nesterov else buf
        ortho = np.stack([_np_newton_schulz(d[i].reshape(6, 8).T).T.reshape(6, 2, 4) for i in range(2)])
        p[0] = p[0] - lr * (ortho * np.sqrt(8 / 6) + wd * p[0])
        for i in (1, 2, 3):
            m[i] = 0.8 * m[i] + 0.2 * g[i]
            v[i] = 0.9 * v[i] + 0.1 * g[i] ** 2
            step = (m[i] / (1 - 0.8 ** (t + 1))) / (np.sqrt(v[i] / (1 - 0.9 ** (t + 1))) + 1e-6)
            p[i] = p[i] - adam_lr * (step + (adam_wd * p[i] if names[i] in decayed else 0.0))
    for name, a, b in zip(names, jax.tree.leaves(ours), p):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-3, atol=1e-5, err_msg=name)
