"""Attention and masks: against a NumPy softmax attention and naive Python loops over positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import Axis
from ponente.namedtensor.nn import attention as attn

B, Pos, KPos, Heads, Head = Axis("b", 2), Axis("pos", 4), Axis("key_pos", 4), Axis("heads", 3), Axis("head", 8)


def _np_attention(q, k, v, mask=None, bias=None):
    """q: [b, q, h, d], k/v: [b, k, h, d]; mask/bias broadcastable to [b, h, q, k]."""
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = np.where(mask, logits, -1e9)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    return w, np.einsum("bhqk,bkhd->bqhd", w, v)


def _qkv(seed):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = hax.random.normal(ks[0], (B, Pos, Heads, Head))
    k = hax.random.normal(ks[1], (B, KPos, Heads, Head))
    v = hax.random.normal(ks[2], (B, KPos, Heads, Head))
    return q, k, v


@given(st.integers(0, 1000), st.booleans(), st.booleans())
def test_attention_matches_numpy(seed, use_mask, use_bias):
    q, k, v = _qkv(seed)
    mask = attn.causal_mask(Pos, KPos) if use_mask else None
    bias = attn.alibi_attention_bias(Heads, KPos) if use_bias else None
    out = attn.dot_product_attention(KPos, Head, q, k, v, mask=mask, bias=bias)
    np_mask = np.tril(np.ones((4, 4), bool)) if use_mask else None
    np_bias = np.asarray(bias.array)[None, :, None, :] if use_bias else None
    w_ref, out_ref = _np_attention(np.asarray(q.array), np.asarray(k.array), np.asarray(v.array), np_mask, np_bias)
    assert out.axes == (B, Pos, Heads, Head)
    np.testing.assert_allclose(out.array, out_ref, rtol=1e-4, atol=1e-5)
    w = attn.dot_product_attention_weights(Head, KPos, q, k, mask=mask, bias=bias)
    np.testing.assert_allclose(w.rearrange(("b", "heads", "pos", "key_pos")).array, w_ref, rtol=1e-4, atol=1e-6)


def test_attention_over_tuple_of_key_axes():
    q, k, v = _qkv(1)
    Blk, Inner = Axis("blk", 2), Axis("inner", 2)
    k2 = k.unflatten_axis("key_pos", (Blk, Inner))
    v2 = v.unflatten_axis("key_pos", (Blk, Inner))
    mask = attn.causal_mask(Pos, KPos).unflatten_axis("key_pos", (Blk, Inner))
    out = attn.dot_product_attention((Blk, Inner), Head, q, k2, v2, mask=mask)
    _, ref = _np_attention(
        np.asarray(q.array), np.asarray(k.array), np.asarray(v.array), np.tril(np.ones((4, 4), bool))
    )
    np.testing.assert_allclose(out.rearrange(("b", "pos", "heads", "head")).array, ref, rtol=1e-4, atol=1e-5)


def test_attention_dtype_and_errors():
    q, k, v = _qkv(2)
    out = attn.dot_product_attention(
        KPos, Head, q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), attention_dtype=jnp.float32
    )
    assert out.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"must be distinct axes.*'pos'"):
        attn.dot_product_attention("pos", Head, q, k.rename({"key_pos": "pos"}), v.rename({"key_pos": "pos"}))
    with pytest.raises(ValueError, match=r"'kpos'\] not found in the key"):
        attn.dot_product_attention("kpos", Head, q, k, v)


def _loop_mask(nq, nk, allowed):
    return np.array([[allowed(i, j) for j in range(nk)] for i in range(nq)])


@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 4), st.integers(0, 4))
def test_causal_mask_loop(nq, nk, q_start, k_start):
    m = attn.causal_mask(Axis("q", nq), Axis("k", nk), q_start, k_start)
    assert m.axis_names == ("q", "k")
    np.testing.assert_array_equal(m.array, _loop_mask(nq, nk, lambda i, j: j + k_start <= i + q_start))


@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3))
def test_sliding_window_mask_loop(nq, nk, window, q_start):
    m = attn.sliding_window_mask(Axis("q", nq), Axis("k", nk), window, q_start=q_start)
    ref = _loop_mask(nq, nk, lambda i, j: (j <= i + q_start) and (i + q_start - j < window))
    np.testing.assert_array_equal(m.array, ref)


@given(st.integers(1, 6), st.integers(0, 6))
def test_prefix_lm_mask_loop(n, prefix):
    m = attn.prefix_lm_mask(Axis("q", n), Axis("k", n), prefix)
    np.testing.assert_array_equal(m.array, _loop_mask(n, n, lambda i, j: j <= i or j < prefix))


def test_segment_mask_loop_with_batch():
    ids = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    m = attn.segment_mask(hax.named(ids, ("b", "q")), hax.named(ids, ("b", "k")))
    assert m.axis_names == ("b", "q", "k")
    for b in range(2):
        np.testing.assert_array_equal(m.array[b], _loop_mask(5, 5, lambda i, j, b=b: ids[b, i] == ids[b, j]))


def test_combine_masks_and_bias():
    c = attn.causal_mask(Axis("q", 4), Axis("k", 4))
    seg = attn.segment_mask(hax.named(np.array([0, 0, 1, 1]), "q"), hax.named(np.array([0, 0, 1, 1]), "k"))
    both = attn.combine_masks_and(c, seg)
    either = attn.combine_masks_or(c, seg)
    np.testing.assert_array_equal(both.array, np.asarray(c.array) & np.asarray(seg.array))
    np.testing.assert_array_equal(either.array, np.asarray(c.array) | np.asarray(seg.array))
    assert attn.combine_masks_and(None, c) is c
    assert attn.combine_masks_or(c, None) is c
    assert attn.combine_masks_and(None, None) is None
    batched = hax.named(np.array([True, False]), "b")
    assert attn.combine_masks_and(c, batched).axis_names == ("q", "k", "b")
    bias = attn.mask_to_bias(c, -100.0)
    np.testing.assert_array_equal(bias.array, np.where(np.asarray(c.array), 0.0, -100.0))


def test_mask_and_bias_give_the_same_attention():
    q, k, v = _qkv(3)
    m = attn.causal_mask(Pos, KPos)
    a = attn.dot_product_attention(KPos, Head, q, k, v, mask=m)
    b = attn.dot_product_attention(KPos, Head, q, k, v, bias=attn.mask_to_bias(m))
    np.testing.assert_allclose(a.array, b.array, rtol=1e-5, atol=1e-6)


def test_alibi_slopes():
    bias = attn.alibi_attention_bias(Axis("h", 8), Axis("k", 3))
    slopes = np.array([2.0 ** -(i + 1) for i in range(8)])
    np.testing.assert_allclose(bias.array, slopes[:, None] * np.arange(3)[None, :], rtol=1e-6)
    six = attn.alibi_attention_bias(Axis("h", 6), Axis("k", 2))
    expected = np.array([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3])
    np.testing.assert_allclose(six.array[:, 1], expected, rtol=1e-6)


def test_dropout_mask_rate():
    m = attn.dropout_mask((Axis("n", 10000),), 0.2, key=jax.random.key(0))
    assert abs(float(np.mean(np.asarray(m.array))) - 0.8) < 0.02


def test_masks_with_batched_starts_loop():
    starts = np.array([0, 2, 5])
    q_start = hax.named(starts, "b")
    m = attn.causal_mask(Axis("q", 3), Axis("k", 8), q_start=q_start)
    assert m.axis_names == ("b", "q", "k")
    for b, s0 in enumerate(starts):
        np.testing.assert_array_equal(m.array[b], _loop_mask(3, 8, lambda i, j, s0=s0: j <= i + s0))
    w = attn.sliding_window_mask(Axis("q", 3), Axis("k", 8), 2, q_start=q_start)
    for b, s0 in enumerate(starts):
        np.testing.assert_array_equal(w.array[b], _loop_mask(3, 8, lambda i, j, s0=s0: 0 <= i + s0 - j < 2))


@given(st.integers(1, 5), st.integers(0, 5), st.integers(0, 3))
def test_prefix_lm_mask_counts_the_prefix_from_the_first_key(n, prefix, start):
    m = attn.prefix_lm_mask(Axis("q", n), Axis("k", n), prefix, q_start=start, k_start=start)
    np.testing.assert_array_equal(m.array, _loop_mask(n, n, lambda i, j: j <= i or j < prefix))


def test_scaling_factor():
    q, k, _ = _qkv(4)
    w = attn.dot_product_attention_weights(Head, KPos, q, k, scaling_factor=0.5)
    logits = np.einsum("bqhd,bkhd->bhqk", np.asarray(q.array), np.asarray(k.array)) * 0.5
    ref = np.exp(logits - logits.max(-1, keepdims=True))
    ref = ref / ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(w.rearrange(("b", "heads", "pos", "key_pos")).array, ref, rtol=1e-4, atol=1e-6)


def test_forgetful_causal_mask():
    K = Axis("k", 4000)
    m = np.asarray(attn.forgetful_causal_mask(K, 0.3, sample_prob=False, key=jax.random.key(0)).array)
    assert m[0]
    assert abs(m[1:].mean() - 0.7) < 0.03
    assert np.asarray(attn.forgetful_causal_mask(K, 1.0, key=jax.random.key(0)).array).sum() == 1
    assert np.asarray(attn.forgetful_causal_mask(K, 0.0, key=jax.random.key(0)).array).all()
    sampled = np.asarray(attn.forgetful_causal_mask(K, 0.5, key=jax.random.key(1)).array)
    assert sampled[1:].mean() >= 0.45
    with pytest.raises(ValueError, match="mask_prob"):
        attn.forgetful_causal_mask(K, 1.5, key=jax.random.key(0))
