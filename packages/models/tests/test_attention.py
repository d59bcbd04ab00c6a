"""Attention masks and grouped-query attention vs naive NumPy loops."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.models import AttentionMask, dot_product_attention


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=8).map(sorted), st.one_of(st.none(), st.integers(1, 4)))
def test_mask_matches_loop(segments: list[int], window: int | None) -> None:
    n = len(segments)
    Pos = hax.Axis("position", n)
    mask = AttentionMask.causal(window).with_segment_ids(hax.named(np.array(segments), "position"))
    got = mask.materialize(Pos, Pos.alias("key_position"))
    assert got is not None
    expected = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for k in range(n):
            ok = k <= q and segments[q] == segments[k]
            expected[q, k] = ok and (window is None or q - k < window)
    np.testing.assert_array_equal(np.asarray(got.rearrange(("position", "key_position")).array), expected)


def test_no_mask_is_none() -> None:
    Pos = hax.Axis("position", 3)
    assert AttentionMask().materialize(Pos, Pos.alias("key_position")) is None


def test_grouped_query_attention_matches_numpy() -> None:
    rs = np.random.RandomState(0)
    P, KV, G, D = 6, 2, 3, 4
    Pos, KVH, Grp, Hd = hax.make_axes(position=P, kv_heads=KV, q_heads_per_group=G, head_size=D)
    q, k, v = rs.randn(P, KV, G, D), rs.randn(P, KV, D), rs.randn(P, KV, D)
    out = dot_product_attention(
        Pos,
        Hd,
        hax.named(q.astype(np.float32), (Pos, KVH, Grp, Hd)),
        hax.named(k.astype(np.float32), (Pos, KVH, Hd)),
        hax.named(v.astype(np.float32), (Pos, KVH, Hd)),
        AttentionMask.causal(),
    )
    expected = np.zeros((P, KV, G, D))
    for h in range(KV * G):  # query head h uses kv head h // G
        kv, g = divmod(h, G)
        scores = q[:, kv, g] @ k[:, kv].T / np.sqrt(D)
        scores = np.where(np.tril(np.ones((P, P), dtype=bool)), scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        expected[:, kv, g] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
    got = out.rearrange(("position", "kv_heads", "q_heads_per_group", "head_size")).array
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5)
