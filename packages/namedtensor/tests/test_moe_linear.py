"""MoELinear: grouped products against a per-expert NumPy loop."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn

E, In, Out = Axis("experts", 3), Axis("embed", 4), Axis("mlp", 5)


def _loop(x, w, groups, bias):
    """Row i of x (tokens, in) goes through the expert whose group contains i; w is (experts, in, out)."""
    out = np.zeros((x.shape[0], w.shape[2]), np.float32)
    start = 0
    for e, n in enumerate(groups):
        out[start : start + n] = x[start : start + n] @ w[e]
        start += n
    return out + (0 if bias is None else bias)


@pytest.mark.parametrize("out_first", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
def test_matches_per_expert_loop(out_first, use_bias):
    moe = nn.MoELinear.init(E, In, Out, key=jax.random.key(0), out_first=out_first, use_bias=use_bias)
    if use_bias:  # a non-zero bias, so adding it is checked
        moe = dataclasses.replace(moe, bias=hax.arange(Out).astype(jnp.float32))
    assert moe.out_first == out_first
    Tokens = Axis("tokens", 7)
    x = hax.random.normal(jax.random.key(1), (Tokens, In))
    groups = [2, 0, 4]  # the last token belongs to no group
    out = moe(x, hax.named(jnp.array(groups), E))
    assert out.axes == (Tokens, Out)
    w = np.asarray(moe.weight.rearrange((E, In, Out)).array)
    bias = None if moe.bias is None else np.asarray(moe.bias.array)
    np.testing.assert_allclose(out.array, _loop(np.asarray(x.array), w, groups, bias), rtol=1e-5, atol=1e-5)


def test_several_token_axes_and_in_first():
    moe = nn.MoELinear.init(E, In, Out, key=jax.random.key(0), use_bias=False)
    x = hax.random.normal(jax.random.key(1), {"embed": 4, "b": 2, "pos": 3})
    out = moe(x, hax.named(jnp.array([1, 3, 2]), E))
    assert out.axis_names == ("mlp", "b", "pos")  # Out takes In's place
    flat = np.asarray(x.rearrange(("b", "pos", "embed")).array).reshape(6, 4)
    expected = _loop(flat, np.asarray(moe.weight.array), [1, 3, 2], None).reshape(2, 3, 5)
    np.testing.assert_allclose(out.rearrange(("b", "pos", "mlp")).array, expected, rtol=1e-5, atol=1e-5)


def test_gradient_matches_loop():
    moe = nn.MoELinear.init(E, In, Out, key=jax.random.key(0), use_bias=False)
    x = hax.random.normal(jax.random.key(1), (Axis("tokens", 6), In))
    groups = hax.named(jnp.array([3, 1, 2]), E)
    g = jax.grad(lambda m: hax.sum(m(x, groups) ** 2).scalar())(moe).weight.array
    w = moe.weight.array

    def ref_loss(w):
        xs = x.array
        return sum(jnp.sum((xs[s:e] @ w[k]) ** 2) for k, (s, e) in enumerate([(0, 3), (3, 4), (4, 6)]))

    np.testing.assert_allclose(g, jax.grad(ref_loss)(w), rtol=1e-4, atol=1e-5)


def test_bad_inputs():
    moe = nn.MoELinear.init(E, In, Out, key=jax.random.key(0))
    with pytest.raises(ValueError, match="lacks the axis 'embed'"):
        moe(hax.ones({"tokens": 2, "other": 4}), hax.named(jnp.array([1, 1, 0]), E))
    with pytest.raises(ValueError, match="group_sizes"):
        moe(hax.ones({"tokens": 2, "embed": 4}), hax.named(jnp.array([1, 1]), "wrong"))
