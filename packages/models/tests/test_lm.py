"""LmExample, next-token loss (vs NumPy) and a few SGD steps that reduce the loss."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.models import Gpt2Config, LlamaConfig, LmExample, compute_next_token_loss

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
