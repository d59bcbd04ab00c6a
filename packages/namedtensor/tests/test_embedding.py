"""Embedding: lookups against NumPy indexing, unembed against a matmul, resizing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn

Vocab, Embed = Axis("vocab", 11), Axis("embed", 4)


def test_embed_and_unembed():
    emb = nn.Embedding.init(Vocab, Embed, key=jax.random.key(0))
    ids = np.array([[1, 10, 0], [3, 3, 7]])
    named_ids = hax.named(jnp.asarray(ids), ("b", "pos"))
    w = np.asarray(emb.weight.array)
    out = emb.embed(named_ids)
    assert out.axis_names == ("b", "pos", "embed")
    np.testing.assert_array_equal(out.array, w[ids])
    np.testing.assert_array_equal(emb(named_ids).array, w[ids])
    logits = emb.unembed(out)
    assert logits.axis_names == ("b", "pos", "vocab")
    np.testing.assert_allclose(logits.array, w[ids] @ w.T, rtol=1e-5)


def test_init_scale_and_multi_axis_embed():
    E2 = (Axis("heads", 4), Axis("head", 16))
    emb = nn.Embedding.init(Axis("vocab", 512), E2, key=jax.random.key(1))
    assert emb.weight.axis_names == ("vocab", "heads", "head")
    # Haliax's default: sigma = init_scale / axis_size(Embed) = 1 / 64 (0.9866: the std of a normal truncated at 3)
    assert abs(float(np.asarray(emb.weight.array).std()) * 64 - 0.9866) < 0.03
    fixed = nn.Embedding.init(Axis("vocab", 512), E2, key=jax.random.key(1), initializer_range=0.02)
    assert abs(float(np.asarray(fixed.weight.array).std()) / 0.02 - 0.9866) < 0.03
    ids = hax.named(jnp.array([5, 6]), "pos")
    np.testing.assert_array_equal(emb.embed(ids).array, np.asarray(emb.weight.array)[[5, 6]])
    assert emb.unembed(emb.embed(ids)).axis_names == ("pos", "vocab")


def test_resize():
    emb = nn.Embedding.init(Vocab, Embed, key=jax.random.key(0))
    small = emb.resize_embeddings(5)
    np.testing.assert_array_equal(small.weight.array, np.asarray(emb.weight.array)[:5])
    assert small.Vocab == Axis("vocab", 5)
    big = emb.resize_embeddings(15, key=jax.random.key(2))
    assert big.weight.shape == {"vocab": 15, "embed": 4}
    np.testing.assert_array_equal(big.weight.array[:11], emb.weight.array)
    with pytest.raises(ValueError, match="key"):
        emb.resize_embeddings(20)


def test_bad_ids():
    emb = nn.Embedding.init(Vocab, Embed, key=jax.random.key(0))
    with pytest.raises(ValueError, match="integers"):
        emb.embed(hax.ones({"pos": 2}))
    with pytest.raises(ValueError, match="'vocab'"):
        emb.embed(hax.named(jnp.array([1, 2]), "vocab"))
