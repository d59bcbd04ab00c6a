"""μP parameterizations of Linear and Embedding: forward pass, initialization and state dicts vs NumPy."""

import dataclasses

import jax
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn
from ponente.namedtensor.nn import mup

In, Out, B = Axis("in", 64), Axis("out", 32), Axis("b", 3)
TRUNC_STD = 0.9866  # std of a standard normal truncated at +-3


def _np(x):
    return np.asarray(x.array)


@pytest.mark.parametrize(
    ("cls", "std", "active", "lr"),
    [
        (mup.LinearStandardParam, 1 / 8, 1, 1),
        (mup.InputLinearMup, 1, 1, 1),
        (mup.HiddenLinearMup, 1 / 8, 1, 1 / 64),
        (mup.OutputLinearMup, 1, 1 / 64, 1),
    ],
)
def test_linear_parameterizations(cls, std, active, lr):
    layer = nn.Linear.init(In, Out, key=jax.random.key(0), reparam_cls=cls, init_scale=2.0)
    assert layer.reparam.active_scale == pytest.approx(active)
    assert layer.reparam.lr_scale == pytest.approx(lr)
    assert abs(_np(layer.weight).std() / (2.0 * std * TRUNC_STD) - 1) < 0.05
    x = hax.random.normal(jax.random.key(1), (B, In))
    w = _np(layer.weight)  # (out, in)
    expected = _np(x) @ w.T * active
    np.testing.assert_allclose(_np(layer(x)), expected, rtol=1e-5, atol=1e-5)


def test_output_mup_state_dict_holds_the_effective_weight():
    layer = nn.Linear.init(In, Out, key=jax.random.key(0), reparam_cls=mup.OutputLinearMup)
    state = hax.state_dict.to_state_dict(layer, "head")
    np.testing.assert_allclose(np.asarray(state["head.weight"]), _np(layer.weight) / 64, rtol=1e-6)
    fresh = nn.Linear.init(In, Out, key=jax.random.key(5), reparam_cls=mup.OutputLinearMup)
    loaded = hax.state_dict.from_state_dict(fresh, state, "head")
    np.testing.assert_allclose(_np(loaded.weight), _np(layer.weight), rtol=1e-6)
    assert loaded.reparam.active_scale == layer.reparam.active_scale


def test_reparam_helpers_pick_the_classes():
    assert nn.Linear.input_reparam() is mup.InputLinearMup
    assert nn.Linear.hidden_reparam() is mup.HiddenLinearMup
    assert nn.Linear.output_reparam() is mup.OutputLinearMup
    assert nn.Linear.hidden_reparam(use_mup=False) is mup.LinearStandardParam


def test_embedding_mup_scales_unembed_logits():
    Vocab, Embed = Axis("vocab", 50), Axis("embed", 16)
    std_emb = nn.Embedding.init(Vocab, Embed, key=jax.random.key(0))
    mup_emb = nn.Embedding.init(Vocab, Embed, key=jax.random.key(0), reparam_cls=mup.EmbeddingMup)
    assert abs(_np(std_emb.weight).std() / (TRUNC_STD / 16) - 1) < 0.05
    assert abs(_np(mup_emb.weight).std() / TRUNC_STD - 1) < 0.05
    h = hax.random.normal(jax.random.key(1), (B, Embed))
    np.testing.assert_allclose(_np(mup_emb.unembed(h)), _np(h) @ _np(mup_emb.weight).T / 16, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(std_emb.unembed(h)), _np(h) @ _np(std_emb.weight).T, rtol=1e-5, atol=1e-5)
    ids = hax.named(jax.numpy.array([3, 7]), "pos")
    np.testing.assert_array_equal(_np(mup_emb.embed(ids)), _np(mup_emb.weight)[[3, 7]])
    resized = mup_emb.resize_embeddings(40)
    assert resized.reparam.unembed_active_scale == pytest.approx(1 / 16)


def test_mup_lr_scale_keeps_hidden_updates_width_independent():
    # for x = 1, d sum(Wx)/dW is all ones, so one SGD step with lr * lr_scale moves every output by lr * width *
    # lr_scale: 0.1 at every width under muP
    def update_size(width):
        H1, H2 = Axis("h1", width), Axis("h2", width)
        layer = nn.Linear.init(H1, H2, key=jax.random.key(0), use_bias=False, reparam_cls=mup.HiddenLinearMup)
        x = hax.ones(H1)

        def loss(m):
            return hax.sum(m(x)).scalar()

        grad = jax.grad(loss)(layer)
        new = dataclasses.replace(layer, weight=layer.weight - 0.1 * layer.reparam.lr_scale * grad.weight)
        return float(np.abs(_np(new(x)) - _np(layer(x))).mean())

    sizes = [update_size(w) for w in (16, 64, 256)]
    np.testing.assert_allclose(sizes, 0.1, rtol=1e-4)
