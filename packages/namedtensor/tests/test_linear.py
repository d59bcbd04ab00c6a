"""Linear: multi-axis In/Out against an np.einsum reference, init statistics, pluggable dot_general."""

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn

Embed, Heads, Head, Pos = Axis("embed", 6), Axis("heads", 2), Axis("head", 3), Axis("pos", 5)


@given(st.booleans(), st.booleans(), st.integers(0, 1000))
def test_multi_axis_linear_matches_einsum(out_first, use_bias, seed):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    layer = nn.Linear.init((Heads, Head), Embed, key=k1, out_first=out_first, use_bias=use_bias)
    if use_bias:
        layer = nn.Linear(layer.weight, hax.random.normal(k3, (Embed,)), layer.In, layer.Out, layer.dot_general)
    x = hax.random.normal(k2, (Pos, Head, Heads))
    out = layer(x)
    assert out.axes == (Pos, Embed)
    w = np.asarray(layer.weight.array)
    spec = "ehd" if out_first else "hde"
    ref = np.einsum(f"pdh,{spec}->pe", np.asarray(x.array), w)
    if use_bias:
        ref = ref + np.asarray(layer.bias.array)
    np.testing.assert_allclose(out.array, ref, rtol=1e-5, atol=1e-5)
    assert layer.out_first == out_first


def test_init_is_fan_in_scaled_truncated_normal():
    In, Out = Axis("in", 64), Axis("out", 256)
    layer = nn.Linear.init(In, Out, key=jax.random.key(0), init_scale=2.0)
    w = np.asarray(layer.weight.array)
    assert layer.weight.axes == (Out, In)
    std = 2.0 / np.sqrt(64)
    assert np.abs(w).max() <= 3 * std + 1e-6
    # a standard normal truncated at ±3σ has std 0.9866
    assert abs(w.std() / std - 0.9866) < 0.03
    np.testing.assert_array_equal(layer.bias.array, np.zeros(256))
    assert nn.Linear.init(In, Out, key=jax.random.key(0), use_bias=False).bias is None


def test_pluggable_dot_general_is_called():
    calls = []

    def my_dot(lhs, rhs, dims, precision=None, preferred_element_type=None):
        calls.append(dims)
        return 2.0 * jax.lax.dot_general(lhs, rhs, dims)

    layer = nn.Linear.init(Embed, Head, key=jax.random.key(1), dot_general=my_dot, use_bias=False)
    x = hax.random.normal(jax.random.key(2), (Pos, Embed))
    ref = 2.0 * np.asarray(x.array) @ np.asarray(layer.weight.array).T
    np.testing.assert_allclose(layer(x).array, ref, rtol=1e-5)
    assert calls == [(((1,), (1,)), ((), ()))]


def test_linear_under_jit_and_grad():
    layer = nn.Linear.init(Embed, Head, key=jax.random.key(3))
    x = hax.random.normal(jax.random.key(4), (Pos, Embed))

    @jax.jit
    def loss(layer):
        return hax.sum(layer(x) ** 2).scalar()

    g = jax.grad(loss)(layer)
    y = np.asarray(x.array) @ np.asarray(layer.weight.array).T + np.asarray(layer.bias.array)
    np.testing.assert_allclose(g.weight.array, 2 * y.T @ np.asarray(x.array), rtol=1e-4, atol=1e-5)


def test_errors_name_the_axis():
    layer = nn.Linear.init(Embed, Head, key=jax.random.key(0))
    with pytest.raises(ValueError, match="'embed'"):
        layer(hax.ones({"pos": 2, "model": 6}))
    with pytest.raises(ValueError, match=r"'embed'.*size 4"):
        layer(hax.ones({"pos": 2, "embed": 4}))
    with pytest.raises(ValueError, match="'head'"):
        layer(hax.ones({"embed": 6, "head": 3}))
    with pytest.raises(ValueError, match="share"):
        nn.Linear.init(Embed, Embed, key=jax.random.key(0))


@pytest.mark.multidevice
def test_linear_output_follows_the_axis_mapping():
    from jax.sharding import PartitionSpec

    from ponente.namedtensor import partitioning as P

    if len(jax.devices()) < 8:
        pytest.fail("multidevice tests need XLA_FLAGS=--xla_force_host_platform_device_count=8")
    Batch, Mlp = Axis("batch", 4), Axis("mlp", 8)
    layer = nn.Linear.init(Embed, Mlp, key=jax.random.key(0))
    x = hax.random.normal(jax.random.key(1), (Batch, Embed))
    mesh = P.make_mesh({"data": 2, "model": 4})
    with jax.set_mesh(mesh), P.axis_mapping({"batch": "data", "mlp": "model"}):
        out = jax.jit(lambda layer, x: layer(x))(layer, x)
    assert out.array.sharding.spec == PartitionSpec("data", "model")
    ref = np.asarray(x.array) @ np.asarray(layer.weight.array).T + np.asarray(layer.bias.array)
    np.testing.assert_allclose(out.array, ref, rtol=1e-5, atol=1e-5)
