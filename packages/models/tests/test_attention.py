"""Attention masks, grouped-query attention and both backends vs naive NumPy loops; the Attention layer."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.models import ATTENTION_BACKENDS, Attention, AttentionMask, RotaryConfig, dot_product_attention
from ponente.models.attention import attention


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


def test_attention_dispatches_to_every_cpu_backend() -> None:
    rs = np.random.RandomState(1)
    P, D = 7, 4
    Pos, Hd = hax.make_axes(position=P, head_size=D)
    q, k, v = (hax.named(rs.randn(P, D).astype(np.float32), (Pos, Hd)) for _ in range(3))
    scores = np.asarray(q.array) @ np.asarray(k.array).T * 0.3
    scores = np.where(np.tril(np.ones((P, P), dtype=bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (w / w.sum(-1, keepdims=True)) @ np.asarray(v.array)
    # cudnn and pallas need a GPU/TPU: tests/test_attention_backends.py checks them there (and their errors here)
    for backend in (b for b in ATTENTION_BACKENDS if b not in ("cudnn", "pallas")):
        out = attention(Pos, Hd, q, k, v, AttentionMask.causal(), scaling_factor=0.3, backend=backend, block_size=3)
        np.testing.assert_allclose(np.asarray(out.array), expected, atol=1e-5, err_msg=backend)


def test_unknown_backend_lists_the_choices() -> None:
    Pos, Hd = hax.make_axes(position=2, head_size=2)
    x = hax.ones((Pos, Hd))
    with pytest.raises(ValueError, match=r"'splash'.*reference.*flash"):
        attention(Pos, Hd, x, x, x, None, backend="splash")
    with pytest.raises(ValueError, match="'splash'"):
        Attention.init(Pos, Hd, Hd, Hd, use_bias=False, rotary=None, key=jax.random.key(0), backend="splash")


def test_attention_layer_flash_backend_matches_reference() -> None:
    # values only: gradients through a flash Attention layer are checked by test_lm's blockwise-loss model test
    Embed, KVH, Grp, Hd = hax.make_axes(embed=8, kv_heads=2, q_heads_per_group=2, head_size=4)
    x = hax.random.normal(jax.random.key(1), (hax.Axis("batch", 2), hax.Axis("position", 10), Embed))
    common: dict[str, Any] = {"use_bias": True, "rotary": RotaryConfig(), "key": jax.random.key(0)}
    ref = Attention.init(Embed, KVH, Grp, Hd, backend="reference", **common)
    fla = Attention.init(Embed, KVH, Grp, Hd, backend="flash", block_size=4, **common)
    assert (ref.backend, fla.backend, fla.block_size) == ("reference", "flash", 4)
    assert Attention.init(Embed, KVH, Grp, Hd, **common).backend == "auto"
    mask = AttentionMask.causal(sliding_window=6)
    out_ref, out_fla = (eqx.filter_jit(lambda m: m(x, mask))(m) for m in (ref, fla))
    np.testing.assert_allclose(np.asarray(out_fla.array), np.asarray(out_ref.array), atol=2e-5, rtol=1e-5)
