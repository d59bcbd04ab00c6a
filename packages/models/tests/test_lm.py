"""LmExample (EOS and segment ids), next-token loss (vs NumPy), the blockwise loss, and a few SGD steps."""

from __future__ import annotations

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.models.loss.fused as fused_kernel
import ponente.namedtensor as hax
from ponente.models import (
    Attention,
    Gemma2Config,
    Gpt2Config,
    LlamaConfig,
    LmExample,
    LmHeadModel,
    blockwise_cross_entropy_loss,
    compute_next_token_loss,
)
from ponente.models.loss import FUSED_LOSS_BLOCK_SIZE, FUSED_LOSS_MIN_VOCAB, cross_entropy_block_size
from ponente.namedtensor import NamedArray
from ponente.namedtensor.nn import Embedding

Vocab = hax.Axis("vocab", 13)
TINY: dict[str, Any] = {"seq_len": 8, "hidden_dim": 16, "intermediate_dim": 32, "num_layers": 2, "num_heads": 4}


def _tokens(batch: int = 2, seq: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, Vocab.size, size=(batch, seq))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_segments_and_loss_mask_from_eos(tokens: list[int]) -> None:
    eos = 0
    ex = LmExample.causal(hax.named(jnp.array(tokens), "position"), eos_id=eos)
    seg, expected_seg, expected_mask = 0, [], []
    for i, t in enumerate(tokens):  # naive loop: an EOS closes its own segment
        expected_seg.append(seg)
        expected_mask.append(0.0 if (i == len(tokens) - 1 or t == eos) else 1.0)
        seg += t == eos
    assert ex.attn_mask.segment_ids is not None
    assert ex.attn_mask.segment_ids.array.tolist() == expected_seg
    assert ex.loss_mask.array.tolist() == expected_mask


def test_causal_requires_position_axis() -> None:
    with pytest.raises(ValueError, match="position"):
        LmExample.causal(hax.named(jnp.zeros(3, dtype=int), "seq"))


def _numpy_loss(logits: np.ndarray, tokens: np.ndarray, mask: np.ndarray, z: float) -> float:
    logits = logits.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    targets = np.roll(tokens, -1, axis=-1)
    tgt = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    per = (lse - tgt + z * lse**2) * mask
    return float(per.sum() / mask.sum())


@pytest.mark.parametrize("z", [0.0, 1e-2])
@pytest.mark.parametrize("eos", [None, 3])
def test_loss_matches_numpy(z: float, eos: int | None) -> None:
    model = LlamaConfig(**TINY, num_kv_heads=2).build(Vocab, key=jax.random.key(0))
    tokens = _tokens()
    ex = LmExample.causal(hax.named(tokens, ("batch", "position")), eos_id=eos)
    loss = compute_next_token_loss(model, ex, logsumexp_weight=z)
    logits = np.asarray(model(ex.tokens, ex.attn_mask).array)
    expected = _numpy_loss(logits, tokens, np.asarray(ex.loss_mask.array), z)
    np.testing.assert_allclose(float(loss.scalar()), expected, rtol=1e-5)


def test_segment_mask_isolates_documents() -> None:
    model = Gpt2Config(**TINY, num_kv_heads=4).build(Vocab, key=jax.random.key(1))
    eos = 0
    doc_b = np.array([5, 6, 7, 8])
    packed = np.concatenate([np.array([1, 2, 3, eos]), doc_b])
    ex = LmExample.causal(hax.named(packed, "position"), eos_id=eos)
    packed_logits = np.asarray(model(ex.tokens, ex.attn_mask).array)
    # the second document alone, at the same positions (GPT-2 has absolute positions): pad its prefix with a segment
    alone = LmExample.causal(hax.named(np.concatenate([np.array([9, 9, 9, eos]), doc_b]), "position"), eos_id=eos)
    alone_logits = np.asarray(model(alone.tokens, alone.attn_mask).array)
    np.testing.assert_allclose(packed_logits[4:], alone_logits[4:], atol=1e-5)
    # without segments the first document leaks into the second
    causal_logits = np.asarray(model(ex.tokens).array)
    assert np.abs(causal_logits[4:] - packed_logits[4:]).max() > 1e-4


def test_bad_reduction() -> None:
    model = Gpt2Config(**TINY, num_kv_heads=4).build(Vocab, key=jax.random.key(0))
    with pytest.raises(ValueError, match="reduction"):
        compute_next_token_loss(model, LmExample.causal(hax.named(_tokens(1)[0], "position")), reduction="avg")


@pytest.mark.parametrize("config", [Gpt2Config(**TINY, num_kv_heads=4), LlamaConfig(**TINY, num_kv_heads=2)])
def test_sgd_steps_reduce_loss(config: Any) -> None:
    model = config.build(Vocab, key=jax.random.key(0))
    ex = LmExample.causal(hax.named(_tokens(4), ("batch", "position")))

    @eqx.filter_jit
    def step(m: Any) -> tuple[Any, jax.Array]:
        loss, grads = eqx.filter_value_and_grad(lambda mm: compute_next_token_loss(mm, ex).scalar())(m)
        return jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, m, grads), loss

    losses = []
    for _ in range(5):
        model, loss = step(model)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=10), st.one_of(st.none(), st.integers(0, 3)))
def test_segment_ids_mask_attention_and_loss(seg_list: list[int], eos: int | None) -> None:
    seg_list = sorted(seg_list)
    tokens = [(3 * i + 1) % 4 for i in range(len(seg_list))]
    ex = LmExample.causal(
        hax.named(jnp.array(tokens), "position"), eos_id=eos, segment_ids=hax.named(jnp.array(seg_list), "position")
    )
    # naive loop: a new segment starts where the given id changes or after an EOS
    ids, current = [], 0
    for i in range(len(tokens)):
        if i > 0 and (seg_list[i] != seg_list[i - 1] or tokens[i - 1] == eos):
            current += 1
        ids.append(current)
    expected_mask = [float(i + 1 < len(ids) and ids[i + 1] == ids[i]) for i in range(len(ids))]
    assert ex.attn_mask.segment_ids is not None
    got = ex.attn_mask.segment_ids.array.tolist()
    same = [[a == b for b in got] for a in got]
    assert same == [[a == b for b in ids] for a in ids]  # same partition into segments
    assert ex.loss_mask.array.tolist() == expected_mask


def test_segment_ids_with_foreign_axes_are_rejected() -> None:
    tokens = hax.named(jnp.zeros((2, 3), dtype=int), ("batch", "position"))
    with pytest.raises(ValueError, match="segment_ids"):
        LmExample.causal(tokens, segment_ids=hax.named(jnp.zeros((4, 3), dtype=int), ("doc", "position")))


def _naive_per_position(h: jax.Array, w: jax.Array, t: jax.Array, z: float) -> jax.Array:
    """Cross-entropy from materialized logits ``h @ w`` (``h [..., E]``, ``w [E, V]``)."""
    logits = h @ w
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0] + z * lse**2


@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_blockwise_loss_matches_naive(z: float) -> None:
    B, P, E, V = hax.make_axes(batch=2, position=5, embed=6, vocab=23)
    keys = jax.random.split(jax.random.key(3), 4)
    hidden = hax.random.normal(keys[0], (B, P, E))
    head = hax.random.normal(keys[1], (V, E)) * 0.5  # (vocab, embed): either order is accepted
    targets = hax.random.randint(keys[2], (B, P), 0, V.size)
    weights = hax.random.uniform(keys[3], (B, P)) * (hax.arange(P) < 4)  # a mask and per-position weights

    def blockwise(h: NamedArray, w: NamedArray) -> jax.Array:
        loss = blockwise_cross_entropy_loss(h, w, targets, block_size=8, z_loss_weight=z)
        return hax.sum(loss * weights).scalar()

    def naive(h: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(_naive_per_position(h, w.T, targets.array, z) * weights.array)

    per = blockwise_cross_entropy_loss(hidden, head, targets, block_size=8, z_loss_weight=z)
    assert per.axis_names == ("batch", "position")
    h64, w64 = np.asarray(hidden.array, np.float64), np.asarray(head.array, np.float64)
    logits = h64 @ w64.T
    lse = np.log(np.exp(logits).sum(-1))
    tgt = np.take_along_axis(logits, np.asarray(targets.array)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(per.array), lse - tgt + z * lse**2, rtol=1e-5, atol=1e-5)
    g_block = jax.grad(blockwise, argnums=(0, 1))(hidden, head)
    g_naive = jax.grad(naive, argnums=(0, 1))(hidden.array, head.array)
    for gb, gn in zip(g_block, g_naive, strict=True):
        np.testing.assert_allclose(np.asarray(gb.array), np.asarray(gn), rtol=1e-5, atol=1e-5)


def test_blockwise_loss_never_materializes_logits() -> None:
    B, P, E, V = hax.make_axes(batch=2, position=7, embed=9, vocab=44)
    hidden = hax.random.normal(jax.random.key(0), (B, P, E))
    head = hax.random.normal(jax.random.key(1), (E, V))
    targets = hax.zeros((B, P), dtype=jnp.int32)

    def big(fn: Any) -> list[tuple[int, ...]]:
        jaxpr = str(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(hidden, head))
        shapes = [tuple(int(x) for x in d.split(",")) for d in re.findall(r"\[(\d+(?:,\d+)*)\]", jaxpr)]
        assert shapes
        # any array with a (padded) vocabulary dimension and a token dimension is a logits-sized intermediate
        return [s for s in shapes if {44, 48} & set(s) and {7, 14} & set(s)]

    assert big(lambda h, w: hax.sum(hax.nn.logsumexp(hax.dot(h, w, axis=E), V)).scalar())  # the check can fail
    assert not big(lambda h, w: hax.sum(blockwise_cross_entropy_loss(h, w, targets, block_size=16)).scalar())


def test_blockwise_loss_checks_axes() -> None:
    P, E, V = hax.make_axes(position=3, embed=4, vocab=5)
    h, w = hax.ones((P, E)), hax.ones((E, V))
    with pytest.raises(ValueError, match="lm_head"):
        blockwise_cross_entropy_loss(h, hax.ones((V, hax.Axis("other", 2))), hax.arange(P), block_size=2)
    with pytest.raises(ValueError, match="targets"):
        blockwise_cross_entropy_loss(h, w, hax.zeros((P, hax.Axis("batch", 2)), dtype=int), block_size=2)
    with pytest.raises(ValueError, match="block_size"):
        blockwise_cross_entropy_loss(h, w, hax.arange(P), block_size=0)


class _ToyLm(LmHeadModel):
    """Embedding, one attention layer and an untied head: exposes activations and get_lm_head."""

    embed: Embedding
    attn: Attention
    head: NamedArray
    config: Any = eqx.field(static=True)  # no LmConfig: the loss never reads it

    @property
    def Vocab(self) -> hax.Axis:
        return self.embed.Vocab

    def activations(self, input_ids: NamedArray, attn_mask: Any = None, *, key: jax.Array | None = None) -> NamedArray:
        x = self.embed.embed(input_ids)
        return x + self.attn(x, attn_mask)

    def get_lm_head(self) -> NamedArray:
        return self.head

    def __call__(self, input_ids: NamedArray, attn_mask: Any = None, *, key: jax.Array | None = None) -> NamedArray:
        return hax.dot(self.activations(input_ids, attn_mask), self.head, axis="embed")


def test_next_token_loss_blockwise_equals_full() -> None:
    E, KVH, Grp, Hd = hax.make_axes(embed=8, kv_heads=2, q_heads_per_group=2, head_size=4)
    keys = jax.random.split(jax.random.key(0), 3)
    attn = Attention.init(E, KVH, Grp, Hd, use_bias=False, rotary=None, key=keys[1], backend="flash", block_size=4)
    embed = Embedding.init(Vocab, E, key=keys[0])
    model = _ToyLm(config=None, embed=embed, attn=attn, head=hax.random.normal(keys[2], (E, Vocab)))
    ex = LmExample.causal(hax.named(_tokens(2, 9), ("batch", "position")), eos_id=3)

    def loss(m: _ToyLm, block_size: int | None) -> jax.Array:
        return compute_next_token_loss(m, ex, logsumexp_weight=1e-2, block_size=block_size).scalar()

    l_full, g_full = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, None)
    l_block, g_block = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, 5)
    np.testing.assert_allclose(float(l_block), float(l_full), rtol=1e-5)
    leaves_full, leaves_block = jax.tree_util.tree_leaves(g_full), jax.tree_util.tree_leaves(g_block)
    assert len(leaves_full) == len(leaves_block) > 0
    for a, b in zip(leaves_block, leaves_full, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    per = compute_next_token_loss(model, ex, reduction="none", block_size=5)
    np.testing.assert_array_equal(np.asarray(per.array)[np.asarray(ex.loss_mask.array) == 0], 0.0)


class _LogitsOnly(LmHeadModel):
    """A model that only implements ``__call__`` (no hidden states / head for the blockwise loss)."""

    embed: Embedding
    config: Any = eqx.field(static=True)

    @property
    def Vocab(self) -> hax.Axis:
        return self.embed.Vocab

    def __call__(self, input_ids: NamedArray, attn_mask: Any = None, *, key: jax.Array | None = None) -> NamedArray:
        return self.embed.unembed(self.embed.embed(input_ids))


def test_blockwise_loss_needs_activations() -> None:
    model = _LogitsOnly(embed=Embedding.init(Vocab, hax.Axis("embed", 4), key=jax.random.key(0)), config=None)
    ex = LmExample.causal(hax.named(_tokens(1)[0], "position"))
    compute_next_token_loss(model, ex)  # the full loss works
    with pytest.raises(NotImplementedError, match="_LogitsOnly does not implement activations"):
        compute_next_token_loss(model, ex, block_size=4)


@pytest.mark.parametrize(
    "config", [Gpt2Config(**TINY, num_kv_heads=4), LlamaConfig(**TINY, num_kv_heads=2, attn_backend="flash")]
)
def test_zoo_blockwise_loss_equals_full(config: Any) -> None:
    model = config.build(Vocab, key=jax.random.key(0))
    ex = LmExample.causal(hax.named(_tokens(2), ("batch", "position")), eos_id=3)

    @eqx.filter_jit
    def both(m: Any) -> tuple[NamedArray, NamedArray]:
        full = compute_next_token_loss(m, ex, logsumexp_weight=1e-3)
        return full, compute_next_token_loss(m, ex, logsumexp_weight=1e-3, block_size=4)

    full, block = both(model)
    np.testing.assert_allclose(float(block.scalar()), float(full.scalar()), rtol=1e-5)


def _toy_lm(V: hax.Axis) -> _ToyLm:
    E, KVH, Grp, Hd = hax.make_axes(embed=8, kv_heads=2, q_heads_per_group=2, head_size=4)
    keys = jax.random.split(jax.random.key(0), 3)
    attn = Attention.init(E, KVH, Grp, Hd, use_bias=False, rotary=None, key=keys[1], backend="reference")
    head = hax.random.normal(keys[2], (E, V))
    return _ToyLm(config=None, embed=Embedding.init(V, E, key=keys[0]), attn=attn, head=head)


def _has_logits(model: LmHeadModel, ex: LmExample) -> bool:
    """Whether the default loss's gradient program holds a (tokens, vocab)-sized array."""
    jaxpr = str(jax.make_jaxpr(lambda m: eqx.filter_grad(lambda m: compute_next_token_loss(m, ex).scalar())(m))(model))
    shapes = [tuple(int(x) for x in d.split(",")) for d in re.findall(r"\[(\d+(?:,\d+)*)\]", jaxpr)]
    positions = ex.tokens.resolve_axis("position").size
    return any(model.Vocab.size in s and positions in s for s in shapes)


def test_default_loss_switches_to_blockwise_at_the_vocabulary_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    ex = LmExample.causal(hax.named(_tokens(2, 9), ("batch", "position")))
    # the fused loss's chunks: 4 of the 9 positions (by default a chunk would be the whole of this short sequence)
    monkeypatch.setattr(fused_kernel, "FUSED_LOSS_CHUNK_ELEMENTS", 2 * 4 * FUSED_LOSS_MIN_VOCAB)
    below = _toy_lm(hax.Axis("vocab", FUSED_LOSS_MIN_VOCAB - 1))
    at = _toy_lm(hax.Axis("vocab", FUSED_LOSS_MIN_VOCAB))
    assert (cross_entropy_block_size(below), cross_entropy_block_size(at)) == (None, FUSED_LOSS_BLOCK_SIZE)
    assert (cross_entropy_block_size(at, None), cross_entropy_block_size(below, 16)) == (None, 16)
    assert _has_logits(below, ex)  # the check can fail
    assert not _has_logits(at, ex)
    with pytest.raises(ValueError, match="'fused'"):
        cross_entropy_block_size(at, "fused")


def test_default_fused_loss_equals_plain_loss() -> None:
    model = _toy_lm(hax.Axis("vocab", FUSED_LOSS_MIN_VOCAB))
    ex = LmExample.causal(hax.named(_tokens(2, 9), ("batch", "position")), eos_id=3)

    def loss(m: _ToyLm, block_size: int | str | None) -> jax.Array:
        return compute_next_token_loss(m, ex, logsumexp_weight=1e-2, block_size=block_size).scalar()

    plain, g_plain = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, None)
    fused, g_fused = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, "auto")
    np.testing.assert_allclose(float(fused), float(plain), rtol=1e-5)
    leaves_plain, leaves_fused = jax.tree_util.tree_leaves(g_plain), jax.tree_util.tree_leaves(g_fused)
    assert len(leaves_plain) == len(leaves_fused) > 0
    for a, b in zip(leaves_fused, leaves_plain, strict=True):
        # head gradients are ~1/vocab: compare relative to the largest entry of each gradient
        scale = float(np.abs(np.asarray(b)).max())
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * scale)


def test_final_soft_cap_keeps_the_plain_loss() -> None:
    base: dict[str, Any] = {**TINY, "num_heads": 2, "num_kv_heads": 1, "num_layers": 2}
    V = hax.Axis("vocab", FUSED_LOSS_MIN_VOCAB)
    ex = LmExample.causal(hax.named(_tokens(1, 8)[0], "position"))
    capped = Gemma2Config(**base).build(V, key=jax.random.key(0))
    assert capped.blockwise_loss_support() is not None
    assert cross_entropy_block_size(capped) is None
    assert np.isfinite(float(compute_next_token_loss(capped, ex).scalar()))  # "auto" does not raise
    uncapped = Gemma2Config(**base, final_logit_softcapping=None).build(V, key=jax.random.key(0))
    assert cross_entropy_block_size(uncapped) == FUSED_LOSS_BLOCK_SIZE
