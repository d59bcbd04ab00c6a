"""MLP: structure of the layers and the forward pass against a NumPy loop over the weights."""

import jax
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn

In, Out = Axis("in", 3), Axis("out", 2)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_mlp_matches_numpy(depth):
    mlp = nn.MLP.init(In, Out, width=5, depth=depth, activation=nn.silu, key=jax.random.key(depth))
    assert len(mlp.layers) == depth + 1
    x = hax.random.normal(jax.random.key(10), (Axis("b", 4), In))
    h = np.asarray(x.array, np.float64)
    for i, layer in enumerate(mlp.layers):
        h = h @ np.asarray(layer.weight.array, np.float64).T + np.asarray(layer.bias.array)
        if i < depth:
            h = h / (1 + np.exp(-h))
    out = mlp(x)
    assert out.axis_names == ("b", "out")
    np.testing.assert_allclose(out.array, h, rtol=1e-4, atol=1e-5)


def test_hidden_axes_alternate_and_bias_flags():
    mlp = nn.MLP.init(In, Out, width=Axis("hidden", 4), depth=3, key=jax.random.key(0), use_final_bias=False)
    names = [(layer.In.name, layer.Out.name) for layer in mlp.layers]
    assert names == [("in", "hidden"), ("hidden", "hidden2"), ("hidden2", "hidden"), ("hidden", "out")]
    assert mlp.layers[-1].bias is None
    assert mlp.layers[0].bias is not None


def test_negative_depth():
    with pytest.raises(ValueError, match="depth"):
        nn.MLP.init(In, Out, width=4, depth=-1, key=jax.random.key(0))
