"""AdamW and Lion against NumPy loops, with gradient clipping, a weight-decay mask and a warmup schedule."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray
from ponente.namedtensor.nn import Embedding, LayerNorm, Linear
from ponente.trainer.optim import AdamConfig, LionConfig, OptimizerConfig, param_paths

In, Out, Vocab = hax.Axis("embed", 3), hax.Axis("mlp", 4), hax.Axis("vocab", 5)
STEPS = 4
NUM_TRAIN_STEPS = 6


class Tiny(eqx.Module):
    lin: Linear
    norm: LayerNorm
    emb: Embedding


def _tiny(rng: np.random.Generator) -> Tiny:
    def arr(*axes: hax.Axis) -> NamedArray:
        return NamedArray(jnp.asarray(rng.normal(size=[a.size for a in axes]), jnp.float32), axes)

    return Tiny(
        lin=Linear(arr(Out, In), arr(Out), In, Out),
        norm=LayerNorm(Out, arr(Out), arr(Out), 1e-5),
        emb=Embedding(arr(Vocab, In), Vocab, In),
    )


DECAYED = {"lin.weight"}  # the default mask: Linear weights only


def _lr(step: int, peak: float) -> float:
    """warmup=2, then linear decay to 0.5 * peak over the remaining 4 steps (written out by hand)."""
    return peak * step / 2 if step < 2 else peak * (1 - 0.5 * (step - 2) / 4)


def _run_ours(cfg: OptimizerConfig, model: Tiny, grads: list[list[np.ndarray]]) -> list[np.ndarray]:
    opt = cfg.build(NUM_TRAIN_STEPS)
    state = opt.init(model)
    treedef = jax.tree.structure(model)
    update = eqx.filter_jit(lambda g, s, p: opt.update(g, s, p, loss=jnp.float32(1.0)))
    for g in grads:
        upd, state = update(jax.tree.unflatten(treedef, [jnp.asarray(x) for x in g]), state, model)
        model = eqx.apply_updates(model, upd)
    return [np.asarray(x) for x in jax.tree.leaves(model)]


def _clip(g: list[np.ndarray], max_norm: float) -> list[np.ndarray]:
    norm = np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g))
    return [x * min(1.0, max_norm / norm) for x in g]


def _setup(seed: int) -> tuple[Tiny, list[str], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    model = _tiny(rng)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(model)]
    grads = [[rng.normal(size=x.shape).astype(np.float32) * 2 for x in leaves] for _ in range(STEPS)]
    return model, param_paths(model), grads


@pytest.mark.parametrize("max_grad_norm", [0.5, None])
def test_adamw_matches_numpy(max_grad_norm):
    model, paths, grads = _setup(0)
    cfg = AdamConfig(
        learning_rate=0.1,
        weight_decay=0.3,
        beta1=0.8,
        beta2=0.9,
        epsilon=1e-6,
        max_grad_norm=max_grad_norm,
        warmup=2,
        lr_schedule="linear",
        min_lr_ratio=0.5,
    )
    got = _run_ours(cfg, model, grads)

    p = [np.asarray(x, np.float64) for x in jax.tree.leaves(model)]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for t, g in enumerate(grads):
        g = _clip(g, max_grad_norm) if max_grad_norm else g
        lr = _lr(t, 0.1)
        for i, path in enumerate(paths):
            m[i] = 0.8 * m[i] + 0.2 * g[i]
            v[i] = 0.9 * v[i] + 0.1 * g[i] ** 2
            mhat, vhat = m[i] / (1 - 0.8 ** (t + 1)), v[i] / (1 - 0.9 ** (t + 1))
            decay = 0.3 * p[i] if path in DECAYED else 0.0
            p[i] = p[i] - lr * (mhat / (np.sqrt(vhat) + 1e-6) + decay)
    for path, a, b in zip(paths, got, p):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=path)


def test_lion_matches_numpy():
    model, paths, grads = _setup(1)
    cfg = LionConfig(
        learning_rate=0.05,
        weight_decay=0.5,
        beta1=0.7,
        beta2=0.95,
        max_grad_norm=1.0,
        warmup=2,
        lr_schedule="linear",
        min_lr_ratio=0.5,
    )
    got = _run_ours(cfg, model, grads)

    p = [np.asarray(x, np.float64) for x in jax.tree.leaves(model)]
    m = [np.zeros_like(x) for x in p]
    for t, g in enumerate(grads):
        g = _clip(g, 1.0)
        lr = _lr(t, 0.05)
        for i, path in enumerate(paths):
            direction = np.sign(0.7 * m[i] + 0.3 * g[i])
            m[i] = 0.95 * m[i] + 0.05 * g[i]
            decay = 0.5 * p[i] if path in DECAYED else 0.0
            p[i] = p[i] - lr * (direction + decay)
    for path, a, b in zip(paths, got, p):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=path)
