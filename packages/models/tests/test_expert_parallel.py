"""The ``expert_parallel`` dispatch: on 8 simulated devices (experts split over a mesh axis, tokens travelling by
all-to-all) its output and gradients equal the single-device ``sorted`` and ``dense`` dispatches; with a capacity it
drops exactly the assignments a NumPy count says it must."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models.moe import ClampedSwiGlu, MoeMlp, router_metrics

Embed, Mlp, Experts = hax.Axis("embed", 8), hax.Axis("mlp", 6), hax.Axis("experts", 8)
Batch, Pos = hax.Axis("batch", 8), hax.Axis("position", 4)


def _layer(dispatch: str, capacity_factor: float | None = None, gpt_oss: bool = False) -> MoeMlp:
    layer = MoeMlp.init(
        Embed,
        Mlp,
        Experts,
        2,
        key=jax.random.key(3),
        dispatch=dispatch,
        capacity_factor=capacity_factor,
        bias=gpt_oss,
        activation=ClampedSwiGlu(alpha=1.702, limit=1.0) if gpt_oss else None,
    )
    if gpt_oss:  # random expert biases, so that each one is checked
        keys = jax.random.split(jax.random.key(5), 3)
        layer = dataclasses.replace(
            layer,
            gate_bias=hax.random.normal(keys[0], layer.gate_bias.axes) * 0.5,
            up_bias=hax.random.normal(keys[1], layer.up_bias.axes) * 0.5,
            down_bias=hax.random.normal(keys[2], layer.down_bias.axes) * 0.5,
        )
    return layer


def _x() -> hax.NamedArray:
    return hax.random.normal(jax.random.key(4), (Batch, Pos, Embed))


def _loss(layer: MoeMlp, x: hax.NamedArray) -> jax.Array:
    return jnp.sum(jnp.sin(layer(x)[0].array))


def _value_and_grads(layer: MoeMlp, x: hax.NamedArray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    out = np.asarray(layer(x)[0].array)
    g_layer, g_x = eqx.filter_grad(_loss)(layer, x), jax.grad(lambda a: _loss(layer, hax.named(a, x.axes)))(x.array)
    return out, np.asarray(g_x), [np.asarray(g) for g in jax.tree_util.tree_leaves(g_layer)]


def _run_sharded(layer: MoeMlp, x: hax.NamedArray, mesh_shape: dict[str, int], mapping: dict[str, object]):
    mesh = hax.partitioning.make_mesh(mesh_shape, devices=jax.devices()[:8])

    @hax.named_jit(axis_resources=mapping)
    def run(layer: MoeMlp, x: hax.NamedArray):
        x = hax.shard(x, mapping)
        layer = hax.shard(layer, mapping)
        out = layer(x)[0]
        g_layer = eqx.filter_grad(_loss)(layer, x)
        g_x = jax.grad(lambda a: _loss(layer, hax.named(a, x.axes)))(x.array)
        return out, g_x, g_layer

    with hax.partitioning.set_mesh(mesh):
        hlo = run.lower(layer, x).as_text()
        out, g_x, g_layer = run(layer, x)
    return np.asarray(out.array), np.asarray(g_x), [np.asarray(g) for g in jax.tree_util.tree_leaves(g_layer)], hlo


MESHES = {
    "expert8": ({"expert": 8}, {"batch": "expert", "experts": "expert"}),
    "data2_expert2_model2": (
        {"data": 2, "expert": 2, "model": 2},
        {"batch": ("data", "expert"), "experts": "expert", "mlp": "model"},
    ),
}


@pytest.mark.multidevice
@pytest.mark.parametrize(("name", "gpt_oss"), [(name, False) for name in MESHES] + [("data2_expert2_model2", True)])
def test_expert_parallel_matches_the_single_device_dispatches(name: str, gpt_oss: bool) -> None:
    """Also with gpt-oss's experts (biases, clamped SwiGLU) under tensor parallelism."""
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    x = _x()
    ref_out, ref_gx, ref_g = _value_and_grads(_layer("sorted", gpt_oss=gpt_oss), x)
    dense_out, _, dense_g = _value_and_grads(_layer("dense", gpt_oss=gpt_oss), x)
    np.testing.assert_allclose(dense_out, ref_out, atol=1e-5)
    out, g_x, g_layer, hlo = _run_sharded(_layer("auto", gpt_oss=gpt_oss), x, *MESHES[name])
    assert "all_to_all" in hlo or "all-to-all" in hlo
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(g_x, ref_gx, atol=1e-5)
    for got, want, dense in zip(g_layer, ref_g, dense_g, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(got, dense, atol=1e-5)


def _numpy_dropped(indices: np.ndarray, devices: int, local: int, capacity: int) -> np.ndarray:
    """Per device (rows of the batch split evenly), assignments in (expert, token, slot) order beyond ``capacity``
    rows per destination are dropped."""
    rows = indices.shape[0] // devices
    dropped = np.zeros(indices.shape, bool)
    for d in range(devices):
        block = indices[d * rows : (d + 1) * rows].reshape(-1)
        order = np.argsort(block, kind="stable")
        seen: dict[int, int] = {}
        flat = np.zeros(block.shape, bool)
        for a in order:
            dest = block[a] // local
            seen[dest] = seen.get(dest, 0) + 1
            flat[a] = seen[dest] > capacity
        dropped[d * rows : (d + 1) * rows] = flat.reshape(indices[d * rows : (d + 1) * rows].shape)
    return dropped


@pytest.mark.multidevice
def test_capacity_drops_are_counted() -> None:
    x = _x()
    layer = _layer("expert_parallel", capacity_factor=0.5)
    mesh = hax.partitioning.make_mesh({"expert": 8}, devices=jax.devices()[:8])
    mapping = {"batch": "expert", "experts": "expert"}

    @hax.named_jit(axis_resources=mapping)
    def run(layer: MoeMlp, x: hax.NamedArray):
        out, routing = layer(hax.shard(x, mapping))
        # the routing's (tokens, experts) probabilities cannot leave a program whose mapping splits both over one axis
        return out, dataclasses.replace(routing, probs=None, logsumexp=None)

    with hax.partitioning.set_mesh(mesh):
        out, routing = run(layer, x)
    indices = np.asarray(routing.indices.rearrange((Batch, Pos, "top_k")).array)
    # 1 batch row x 4 positions x k=2 = 8 assignments per device, 8 destinations: capacity ceil(0.5 * 8 / 8) = 1
    want = _numpy_dropped(indices, 8, 1, 1)
    assert want.any()
    assert not want.all()
    np.testing.assert_array_equal(np.asarray(routing.dropped.rearrange((Batch, Pos, "top_k")).array), want)
    np.testing.assert_allclose(float(hax.mean(routing.dropped.astype(jnp.float32)).scalar()), want.mean())
    # a dropped assignment contributes nothing: the output is the sorted dispatch's with those weights zeroed
    weights = np.where(want, 0.0, np.asarray(routing.weights.rearrange((Batch, Pos, "top_k")).array))
    expected = _sorted_with_weights(layer, x, indices, weights)
    np.testing.assert_allclose(np.asarray(out.rearrange((Batch, Pos, Embed)).array), expected, atol=1e-5)


def _sorted_with_weights(layer: MoeMlp, x: hax.NamedArray, indices: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """A NumPy loop over tokens: ``sum_j weights[j] * expert_{indices[j]}(x)``."""
    w1 = np.asarray(layer.gate_proj.rearrange(("experts", "embed", "mlp")).array)
    w3 = np.asarray(layer.up_proj.rearrange(("experts", "embed", "mlp")).array)
    w2 = np.asarray(layer.down_proj.rearrange(("experts", "mlp", "embed")).array)
    xs = np.asarray(x.rearrange((Batch, Pos, Embed)).array)
    out = np.zeros_like(xs)
    for b in range(xs.shape[0]):
        for p in range(xs.shape[1]):
            for e, w in zip(indices[b, p], weights[b, p], strict=True):
                g, u = xs[b, p] @ w1[e], xs[b, p] @ w3[e]
                out[b, p] += w * ((g / (1 + np.exp(-g)) * u) @ w2[e])
    return out


def test_expert_parallel_on_one_device_is_the_sorted_dispatch() -> None:
    x = _x()
    ref = _value_and_grads(_layer("sorted"), x)
    got = _value_and_grads(dataclasses.replace(_layer("sorted"), dispatch="expert_parallel"), x)
    np.testing.assert_allclose(got[0], ref[0], atol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], atol=1e-5)
    for a, b in zip(got[2], ref[2], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_router_metrics_match_numpy() -> None:
    layer = _layer("dense")
    x = _x()
    routing = layer(x)[1]
    metrics = router_metrics(routing, Experts)
    logits = np.einsum(
        "bpd,ed->bpe", np.asarray(x.array), np.asarray(layer.router.weight.rearrange(("experts", "embed")).array)
    )
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(metrics["z_loss"].scalar()), (lse**2).mean(), rtol=1e-5)
    top2 = np.argsort(-logits, -1)[..., :2]
    counts = np.bincount(top2.reshape(-1), minlength=Experts.size)
    np.testing.assert_allclose(float(metrics["expert_load_max"].scalar()), counts.max() / counts.mean(), rtol=1e-6)
    assert float(metrics["dropped_fraction"].scalar()) == 0.0
