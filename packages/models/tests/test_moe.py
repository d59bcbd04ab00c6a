"""The mixture-of-experts layer: routing and load-balancing loss vs transformers, output vs a naive loop, algebra."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.mixtral.modeling_mixtral import (
    MixtralSparseMoeBlock,
    MixtralTopKRouter,
    load_balancing_loss_func,
)

import ponente.namedtensor as hax
from ponente.models.moe import (
    MoeMlp,
    RouterOutput,
    layer_groups,
    load_balancing_loss,
    route_top_k,
    route_top_k_softmax,
)

Embed, Mlp = hax.Axis("embed", 8), hax.Axis("mlp", 6)


def _hf_config(experts: int, k: int) -> transformers.MixtralConfig:
    return transformers.MixtralConfig(
        hidden_size=Embed.size, intermediate_size=Mlp.size, num_local_experts=experts, num_experts_per_tok=k
    )


@pytest.mark.parametrize(("experts", "k"), [(4, 1), (4, 2), (8, 2), (8, 3), (5, 5)])
def test_routing_matches_transformers_router(experts: int, k: int) -> None:
    router = MixtralTopKRouter(_hf_config(experts, k))
    torch.nn.init.normal_(router.weight)
    x = torch.randn(2 * 7, Embed.size)
    with torch.no_grad():
        logits, weights, indices = router(x)
    E = hax.Axis("experts", experts)
    ours = route_top_k(
        hax.named(jnp.asarray(logits.numpy().reshape(2, 7, experts)), ("batch", "position", "experts")), E, k
    )
    assert ours.indices.axis_names == ("batch", "position", "top_k")
    np.testing.assert_array_equal(np.asarray(ours.indices.array).reshape(-1, k), indices.numpy())
    np.testing.assert_allclose(np.asarray(ours.weights.array).reshape(-1, k), weights.numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(
        np.asarray(ours.probs.array).reshape(-1, experts), torch.softmax(logits, -1).numpy(), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize(("layers", "experts", "k"), [(1, 4, 2), (3, 8, 2), (2, 6, 1)])
def test_load_balancing_loss_matches_transformers(layers: int, experts: int, k: int) -> None:
    logits = torch.randn(layers, 3 * 5, experts) * 2
    expected = float(load_balancing_loss_func(tuple(logits), experts, k))
    E = hax.Axis("experts", experts)
    named = hax.named(
        jnp.asarray(logits.numpy().reshape(layers, 3, 5, experts)), ("layers", "batch", "position", "experts")
    )
    routing = route_top_k(named, E, k)
    ours = load_balancing_loss(routing.probs, routing.indices, E)
    assert ours.axes == ()
    np.testing.assert_allclose(float(ours.scalar()), expected, rtol=1e-6)


def _numpy_moe(x: np.ndarray, layer: MoeMlp) -> np.ndarray:
    """A naive loop: each token through its top-k experts, weighted by the renormalized softmax."""
    router = np.asarray(layer.router.weight.rearrange(("experts", "embed")).array, np.float64)
    w1 = np.asarray(layer.gate_proj.rearrange(("experts", "mlp", "embed")).array, np.float64)
    w3 = np.asarray(layer.up_proj.rearrange(("experts", "mlp", "embed")).array, np.float64)
    w2 = np.asarray(layer.down_proj.rearrange(("experts", "embed", "mlp")).array, np.float64)
    out = np.zeros_like(x)
    for t, token in enumerate(x):
        logits = router @ token
        p = np.exp(logits - logits.max())
        p /= p.sum()
        chosen = np.argsort(-p)[: layer.num_experts_per_tok]
        for e in chosen:
            gate = w1[e] @ token
            hidden = gate / (1 + np.exp(-gate)) * (w3[e] @ token)
            out[t] += p[e] / p[chosen].sum() * (w2[e] @ hidden)
    return out


@pytest.mark.parametrize("dispatch", ["dense", "sorted"])
@pytest.mark.parametrize(("experts", "k"), [(4, 2), (3, 1)])
def test_moe_output_matches_naive_loop_and_transformers_block(experts: int, k: int, dispatch: str) -> None:
    E = hax.Axis("experts", experts)
    layer = MoeMlp.init(Embed, Mlp, E, k, key=jax.random.key(experts), dispatch=dispatch)
    x = np.random.RandomState(k).randn(2, 5, Embed.size).astype(np.float32)
    out, routing = layer(hax.named(jnp.asarray(x), ("batch", "position", "embed")))
    assert out.axis_names == ("batch", "position", "embed")
    ours = np.asarray(out.array).reshape(-1, Embed.size)
    np.testing.assert_allclose(ours, _numpy_moe(x.reshape(-1, Embed.size).astype(np.float64), layer), atol=1e-5)
    # the same weights in transformers' block (fused gate_up layout)
    block = MixtralSparseMoeBlock(_hf_config(experts, k)).eval()
    w1 = np.asarray(layer.gate_proj.rearrange(("experts", "mlp", "embed")).array)
    w3 = np.asarray(layer.up_proj.rearrange(("experts", "mlp", "embed")).array)
    with torch.no_grad():
        block.gate.weight.copy_(torch.tensor(np.asarray(layer.router.weight.rearrange(("experts", "embed")).array)))
        block.experts.gate_up_proj.copy_(torch.tensor(np.concatenate([w1, w3], axis=1)))
        block.experts.down_proj.copy_(
            torch.tensor(np.asarray(layer.down_proj.rearrange(("experts", "embed", "mlp")).array))
        )
        expected = block(torch.tensor(x)).numpy()
    np.testing.assert_allclose(np.asarray(out.array), expected, atol=1e-5)
    np.testing.assert_allclose(np.asarray(hax.sum(routing.weights, "top_k").array), 1.0, atol=1e-6)


@eqx.filter_jit
def _apply(layer: MoeMlp, x: hax.NamedArray) -> tuple[hax.NamedArray, RouterOutput]:
    return layer(x)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(1, 4), perm=st.permutations(range(4)))
def test_moe_is_invariant_under_expert_permutation(seed: int, k: int, perm: list[int]) -> None:
    """Relabelling the experts (router rows and expert weights together) changes nothing in the output."""
    order = np.asarray(perm)
    layer = MoeMlp.init(Embed, Mlp, hax.Axis("experts", 4), k, key=jax.random.key(seed))

    def permuted(a: hax.NamedArray) -> hax.NamedArray:
        return hax.named(jnp.take(a.array, order, axis=a.axis_names.index("experts")), a.axes)

    relabelled = dataclasses.replace(
        layer,
        router=dataclasses.replace(layer.router, weight=permuted(layer.router.weight)),
        gate_proj=permuted(layer.gate_proj),
        up_proj=permuted(layer.up_proj),
        down_proj=permuted(layer.down_proj),
    )
    x = hax.random.normal(jax.random.key(seed + 1), (hax.Axis("position", 4), Embed))
    out, routing = _apply(layer, x)
    out_p, routing_p = _apply(relabelled, x)
    np.testing.assert_allclose(np.asarray(out_p.array), np.asarray(out.array), atol=1e-5)
    # expert perm[j] of the original is expert j of the relabelled layer
    np.testing.assert_array_equal(order[np.asarray(routing_p.indices.array)], np.asarray(routing.indices.array))


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(1, 12), experts=st.integers(1, 6), data=st.data())
def test_load_balancing_loss_is_k_for_a_uniform_router(tokens: int, experts: int, data: st.DataObject) -> None:
    """With uniform router probabilities, E * sum_e f_e P_e = sum_e f_e = k, whatever experts were chosen."""
    k = data.draw(st.integers(1, experts))
    E = hax.Axis("experts", experts)
    probs = hax.full((hax.Axis("position", tokens), E), 1.0 / experts)
    choices = [data.draw(st.permutations(range(experts)))[:k] for _ in range(tokens)]
    indices = hax.named(jnp.asarray(choices, dtype=jnp.int32), ("position", "top_k"))
    np.testing.assert_allclose(float(load_balancing_loss(probs, indices, E).scalar()), k, rtol=1e-6)


def test_sorted_dispatch_has_the_gradients_of_the_dense_one() -> None:
    layer = MoeMlp.init(Embed, Mlp, hax.Axis("experts", 5), 2, key=jax.random.key(3))
    x = hax.random.normal(jax.random.key(4), (hax.Axis("batch", 2), hax.Axis("position", 6), Embed))

    def loss(layer: MoeMlp, x: hax.NamedArray) -> jax.Array:
        return jnp.sum(jnp.sin(layer(x)[0].array))

    dense = eqx.filter_grad(loss)(layer, x)
    sorted_ = eqx.filter_grad(loss)(dataclasses.replace(layer, dispatch="sorted"), x)
    for a, b in zip(jax.tree_util.tree_leaves(dense), jax.tree_util.tree_leaves(sorted_), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_bad_k_is_rejected_with_the_axis_named() -> None:
    E = hax.Axis("experts", 4)
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in 1\.\.4"):
        MoeMlp.init(Embed, Mlp, E, 5, key=jax.random.key(0))
    with pytest.raises(ValueError, match="dispatch must be one of"):
        MoeMlp.init(Embed, Mlp, E, 2, key=jax.random.key(0), dispatch="gather")
    with pytest.raises(ValueError, match="'experts'"):
        route_top_k(hax.zeros(E), E, 0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_softmax_after_top_k_routing_with_a_bias_matches_numpy(k: int) -> None:
    """gpt-oss's routing with DeepSeek-V3's balancing bias: chosen by ``logits + bias``, weighted by the softmax of
    the chosen logits alone."""
    rng = np.random.default_rng(k)
    logits, bias = rng.normal(size=(6, 5)).astype(np.float32), rng.normal(size=5).astype(np.float32)
    E = hax.Axis("experts", 5)
    ours = route_top_k_softmax(hax.named(jnp.asarray(logits), ("position", "experts")), E, k, bias=hax.named(bias, E))
    chosen = np.argsort(-(logits + bias), axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, chosen, -1)
    weights = np.exp(top - top.max(-1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(ours.indices.array), chosen)
    np.testing.assert_allclose(np.asarray(ours.weights.array), weights / weights.sum(-1, keepdims=True), atol=1e-6)
    assert not np.array_equal(chosen, np.argsort(-logits, axis=-1, kind="stable")[:, :k])  # the bias did steer


@given(st.integers(0, 12), st.integers(0, 6))
def test_layer_groups_cover_the_layers_in_order(layers: int, groups: int) -> None:
    runs = layer_groups(layers, groups)
    assert len(runs) == min(layers, groups)
    flat = [i for start, stop in runs for i in range(start, stop)]
    assert flat == (list(range(layers)) if runs else [])
    sizes = [stop - start for start, stop in runs]
    assert not sizes or max(sizes) - min(sizes) <= 1
