"""Sampling: the compiled loop against a naive per-token loop over the exact, growing sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models import AttentionMask, LlamaConfig
from ponente.trainer.sample import sample_tokens


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2, num_kv_heads=1)
    return cfg.build(hax.Axis("vocab", 13), key=jax.random.key(3))


def _naive_greedy(model, prompt, num_tokens, vocab_size):
    seq = list(prompt)
    window = model.config.seq_len
    for _ in range(num_tokens):
        context = seq[-window:]
        ids = hax.named(jnp.asarray(context, jnp.int32), hax.Axis("position", len(context)))
        logits = np.asarray(model(ids, AttentionMask.causal()).array[-1])
        seq.append(int(np.argmax(logits[:vocab_size])))
    return seq[len(prompt) :]


def test_greedy_matches_naive_loop_including_a_sliding_window(model):
    # 3 prompt tokens + 9 new ones overflow the 8-token window, so the window slides
    got = sample_tokens(model, [1, 2, 3], num_tokens=9, key=jax.random.key(0), temperature=0)
    assert got == _naive_greedy(model, [1, 2, 3], 9, 13)


def test_padded_vocab_ids_are_never_sampled(model):
    got = sample_tokens(model, [4], num_tokens=20, key=jax.random.key(1), temperature=5.0, vocab_size=5)
    assert len(got) == 20
    assert max(got) < 5
    assert got == sample_tokens(model, [4], num_tokens=20, key=jax.random.key(1), temperature=5.0, vocab_size=5)


def test_top_1_is_greedy(model):
    assert sample_tokens(model, [7, 8], num_tokens=5, key=jax.random.key(2), top_k=1) == _naive_greedy(
        model, [7, 8], 5, 13
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"prompt": []}, "at least one token"), ({"temperature": -1.0}, "must be >= 0"), ({"top_k": 0}, "top_k")],
)
def test_bad_arguments(model, kwargs, match):
    args = {"prompt": [1], "num_tokens": 2, "key": jax.random.key(0)} | kwargs
    with pytest.raises(ValueError, match=match):
        sample_tokens(model, **args)
