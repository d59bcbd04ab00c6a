"""Flash attention vs the reference attention (values and gradients, with and without a soft cap), a tiny Gemma 2
trained through either, NumPy for fully masked rows, jaxpr shapes."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.models import AttentionMask, Gemma2Config, LmExample, compute_next_token_loss, dot_product_attention
from ponente.models.attention import attention
from ponente.models.attention.backends import AttentionCall, auto_backend
from ponente.models.attention.flash import _flash_arrays, _Spec, flash_attention
from ponente.models.attention.reference import soft_capped_attention
from ponente.namedtensor import NamedArray

Batch, Pos, KVHeads, Group, HeadSize = hax.make_axes(
    batch=2, position=11, kv_heads=2, q_heads_per_group=3, head_size=4
)
SEGMENTS = np.array([[0] * 4 + [1] * 7, [5] * 9 + [6] * 2])

AttentionFn = Callable[[NamedArray, NamedArray, NamedArray], NamedArray]


def _mask(kind: str) -> AttentionMask | None:
    seg = hax.named(SEGMENTS, (Batch, Pos))
    return {
        "causal": AttentionMask.causal(),
        "segments": AttentionMask.causal().with_segment_ids(seg),
        "segments_bidirectional": AttentionMask(segment_ids=seg),
        "window_segments": AttentionMask.causal(sliding_window=5).with_segment_ids(seg),
    }[kind]


def _value_and_grads(fn: AttentionFn, q: NamedArray, k: NamedArray, v: NamedArray) -> tuple[np.ndarray, list[Any]]:
    """Output (in the query's layout) and gradients of ``sum(out * cotangent)`` wrt q, k and v."""
    ct = hax.random.normal(jax.random.key(7), fn(q, k, v).axes)

    def loss(q: NamedArray, k: NamedArray, v: NamedArray) -> tuple[jax.Array, NamedArray]:
        out = fn(q, k, v)
        return hax.sum(out * ct).scalar(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out.rearrange(q.axes).array), [np.asarray(g.array) for g in grads]


def _compare(
    Q: tuple[Any, ...],
    K: tuple[Any, ...],
    mask: AttentionMask | None,
    block_size: int,
    soft_cap: float | None = None,
    spread: float = 1.0,
) -> None:
    """Flash vs the reference (``soft_capped_attention`` with a cap); inputs are standard normal times ``spread``."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = hax.random.normal(keys[0], Q) * spread
    k = hax.random.normal(keys[1], K) * spread
    v = hax.random.normal(keys[2], K)

    def reference(q: NamedArray, k: NamedArray, v: NamedArray) -> NamedArray:
        if soft_cap is None:
            return dot_product_attention(Pos, HeadSize, q, k, v, mask)
        return soft_capped_attention(Pos, HeadSize, q, k, v, mask, scaling_factor=None, soft_cap=soft_cap)

    ref = _value_and_grads(reference, q, k, v)
    fla = _value_and_grads(
        lambda q, k, v: flash_attention(Pos, HeadSize, q, k, v, mask, block_size=block_size, logit_soft_cap=soft_cap),
        q,
        k,
        v,
    )
    np.testing.assert_allclose(fla[0], ref[0], atol=2e-5, rtol=1e-5)
    for name, g_f, g_r in zip("qkv", fla[1], ref[1], strict=True):
        np.testing.assert_allclose(g_f, g_r, atol=2e-5, rtol=1e-5, err_msg=f"gradient wrt {name}")


@pytest.mark.parametrize("kind", ["causal", "window_segments", "segments_bidirectional"])
def test_gqa_matches_reference(kind: str) -> None:
    # 11 positions in blocks of 4: the last block is padded
    _compare((Batch, Pos, KVHeads, Group, HeadSize), (Batch, KVHeads, Pos, HeadSize), _mask(kind), block_size=4)


def test_mqa_matches_reference() -> None:
    # one key/value head shared by all query heads: the key has no heads axis at all
    Heads = hax.Axis("heads", 3)
    _compare((Batch, Heads, Pos, HeadSize), (Batch, Pos, HeadSize), _mask("segments"), block_size=3)


# a cap of 1.5 on logits of spread ~9 (inputs times 3, head size 4): tanh saturates on many entries, so both the cap
# and its derivative (1 - tanh²) change the output and the gradients a lot
CAP, SPREAD = 1.5, 3.0


@pytest.mark.parametrize("kind", ["causal", "window_segments", "segments_bidirectional"])
def test_soft_capped_gqa_matches_reference(kind: str) -> None:
    Q, K = (Batch, Pos, KVHeads, Group, HeadSize), (Batch, KVHeads, Pos, HeadSize)
    _compare(Q, K, _mask(kind), block_size=4, soft_cap=CAP, spread=SPREAD)


@pytest.mark.parametrize("kind", ["causal", "window_segments"])
def test_sinks_match_the_reference_values_and_gradients(kind: str) -> None:
    """gpt-oss's attention sinks (one logit per query head in each softmax's denominator) through the blockwise
    kernel against the reference's materialized softmax with sinks: output and gradients wrt q, k, v and the sinks."""
    keys = jax.random.split(jax.random.key(3), 5)
    q = hax.random.normal(keys[0], (Batch, Pos, KVHeads, Group, HeadSize))
    k = hax.random.normal(keys[1], (Batch, KVHeads, Pos, HeadSize))
    v = hax.random.normal(keys[2], (Batch, KVHeads, Pos, HeadSize))
    sinks = hax.random.normal(keys[3], (KVHeads, Group)) * 2.0
    ct = hax.random.normal(keys[4], (Batch, Pos, KVHeads, Group, HeadSize))
    mask = _mask(kind)

    def loss(backend: str, q: NamedArray, k: NamedArray, v: NamedArray, sinks: NamedArray) -> jax.Array:
        out = attention(Pos, HeadSize, q, k, v, mask, backend=backend, block_size=4, sinks=sinks)
        return hax.sum(out * ct).scalar()

    want = jax.jit(jax.value_and_grad(lambda *a: loss("reference", *a), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    got = jax.jit(jax.value_and_grad(lambda *a: loss("flash", *a), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for name, g, w in zip(("q", "k", "v", "sinks"), got[1], want[1], strict=True):
        np.testing.assert_allclose(np.asarray(g.array), np.asarray(w.array), atol=2e-5, rtol=1e-5, err_msg=name)
    # the sinks matter: without them the output differs
    plain = jax.jit(lambda *a: loss("flash", *a))(q, k, v, sinks * 0 - 1e4)
    assert abs(float(plain) - float(got[0])) > 1e-3


def test_soft_capped_mqa_matches_reference() -> None:
    Heads = hax.Axis("heads", 3)
    _compare((Batch, Heads, Pos, HeadSize), (Batch, Pos, HeadSize), _mask("segments"), 3, soft_cap=CAP, spread=SPREAD)


def test_soft_cap_changes_output_and_gradients() -> None:
    # the comparisons above are not vacuous: with these inputs the uncapped attention is far from the capped one
    q, k, v = (hax.random.normal(kk, (Pos, HeadSize)) * SPREAD for kk in jax.random.split(jax.random.key(0), 3))
    mask = _mask("causal")

    def run(cap: float | None) -> tuple[np.ndarray, list[Any]]:
        return _value_and_grads(
            lambda q, k, v: flash_attention(Pos, HeadSize, q, k, v, mask, block_size=4, logit_soft_cap=cap), q, k, v
        )

    capped, plain = run(CAP), run(None)
    assert np.abs(capped[0] - plain[0]).max() > 0.1
    for g_c, g_p in zip(capped[1], plain[1], strict=True):
        assert np.abs(g_c - g_p).max() > 0.1


def test_soft_capped_kernel_matches_numpy() -> None:
    # the kernel alone against NumPy (independent of the reference backend): scale, then cap, then mask
    rs = np.random.RandomState(4)
    length, d, cap, scale = 7, 3, 2.0, 0.8
    q, k, v = (rs.randn(1, length, d).astype(np.float32) * 2 for _ in range(3))
    q_, k_, v_ = (jnp.asarray(x) for x in (q[:, None], k, v))
    got = _flash_arrays(q_, k_, v_, None, None, block_size=3, causal=True, window=None, scale=scale, soft_cap=cap)
    logits = cap * np.tanh(q[0] @ k[0].T * scale / cap)
    logits = np.where(np.tril(np.ones((length, length), dtype=bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(got)[0, 0], (w / w.sum(-1, keepdims=True)) @ v[0], atol=1e-5, rtol=1e-5)


def test_auto_picks_flash_for_soft_capped_attention_on_cpu() -> None:
    assert auto_backend(AttentionCall("cpu", "float32", 512, 64, soft_cap=True)) == "flash"
    assert auto_backend(AttentionCall("cpu", "float32", 128, 64, soft_cap=True)) == "reference"  # short: materialized


def _gemma2_loss_and_grads(backend: str) -> tuple[float, list[np.ndarray]]:
    """Loss and parameter gradients of a tiny Gemma 2 (GQA, sliding + global layers, small caps), packed documents."""
    cfg = Gemma2Config(
        seq_len=13,
        hidden_dim=32,
        intermediate_dim=64,
        num_layers=2,  # sliding, then global
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        sliding_window=5,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
        initializer_range=0.5,  # large logits, so that the cap matters
        attn_backend=backend,
        flash_attention_block_size=4,  # 13 positions: four blocks, the last one padded
    )
    model = cfg.build(hax.Axis("vocab", 37), key=jax.random.key(0))
    tokens = hax.named(jax.random.randint(jax.random.key(1), (2, 13), 0, 37), ("batch", "position"))
    segments = hax.named(jnp.array([[0] * 6 + [1] * 7, [0] * 13]), ("batch", "position"))
    example = LmExample.causal(tokens, segment_ids=segments)

    @eqx.filter_jit
    def run(model: Any) -> tuple[jax.Array, Any]:
        return eqx.filter_value_and_grad(lambda m: compute_next_token_loss(m, example, block_size=None).scalar())(
            model
        )

    loss, grads = run(model)
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array))]


def test_gemma2_loss_and_grads_flash_match_reference() -> None:
    loss_f, grads_f = _gemma2_loss_and_grads("flash")
    loss_r, grads_r = _gemma2_loss_and_grads("reference")
    np.testing.assert_allclose(loss_f, loss_r, rtol=1e-6)
    assert len(grads_f) == len(grads_r) > 0
    for g_f, g_r in zip(grads_f, grads_r, strict=True):
        np.testing.assert_allclose(g_f, g_r, atol=2e-5, rtol=1e-4)


def _naive(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """Masked softmax attention ``q [b, g, L, D]``, ``k/v [b, L, D]``, ``allowed [b, L, L]``; empty rows give 0."""
    s = jnp.einsum("bgqd,bkd->bgqk", q, k) * scale
    allowed = allowed[:, None]
    s = jnp.where(allowed, s, -1e30)
    p = jnp.exp(s - s.max(-1, keepdims=True)) * allowed
    total = p.sum(-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bgqk,bkd->bgqd", p, v)


def test_fully_masked_rows_are_zero_with_finite_gradients() -> None:
    # query segments that no key has: those rows see nothing (the public API cannot express this, as every
    # query sees itself, but the kernel must not produce NaN)
    b, g, length, d = 2, 2, 9, 3
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (b, g, length, d))
    k, v = (jax.random.normal(kk, (b, length, d)) for kk in keys[1:3])
    q_seg = jnp.array([[0, 0, 1, 1, 7, 7, 1, 2, 2], [3, 3, 3, 3, 3, 9, 9, 9, 9]])
    k_seg = jnp.array([[0, 0, 1, 1, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 3, 3, 3, 3]])
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    allowed = (q_seg[:, :, None] == k_seg[:, None, :]) & causal
    ct = jax.random.normal(keys[3], (b, g, length, d))

    def flash(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return _flash_arrays(q, k, v, q_seg, k_seg, block_size=4, causal=True, window=None, scale=0.5)

    def naive(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return _naive(q, k, v, allowed, 0.5)

    out = jax.jit(flash)(q, k, v)
    empty = ~np.asarray(allowed).any(-1)
    assert empty.sum() == 6  # the test exercises some empty rows
    np.testing.assert_array_equal(np.asarray(out)[np.broadcast_to(empty[:, None], out.shape[:3])], 0.0)
    np.testing.assert_allclose(out, naive(q, k, v), atol=2e-5, rtol=1e-5)
    g_flash = jax.jit(jax.grad(lambda *a: jnp.sum(flash(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
    g_naive = jax.jit(jax.grad(lambda *a: jnp.sum(naive(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
    for gf, gn in zip(g_flash, g_naive, strict=True):
        assert np.isfinite(np.asarray(gf)).all()
        np.testing.assert_allclose(gf, gn, atol=2e-5, rtol=1e-5)


@settings(max_examples=8, deadline=None)
@given(
    length=st.integers(1, 9),
    block=st.integers(1, 5),
    window=st.one_of(st.none(), st.integers(1, 4)),
    causal=st.booleans(),
    cuts=st.lists(st.integers(1, 8), max_size=2),
)
def test_forward_matches_reference_property(
    length: int, block: int, window: int | None, causal: bool, cuts: list[int]
) -> None:
    P, H = hax.Axis("position", length), hax.Axis("head_size", 2)
    seg = hax.named(np.searchsorted(np.array(sorted(cuts)), np.arange(length), side="right"), P)
    mask = AttentionMask(is_causal=causal, segment_ids=seg, sliding_window=window)
    keys = jax.random.split(jax.random.key(length), 3)
    q, k, v = (hax.random.normal(kk, (P, H)) for kk in keys)
    ref = dot_product_attention(P, H, q, k, v, mask)
    got = flash_attention(P, H, q, k, v, mask, block_size=block)
    np.testing.assert_allclose(np.asarray(got.array), np.asarray(ref.array), atol=2e-5, rtol=1e-5)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 6),
    block=st.integers(1, 4),
    window=st.one_of(st.none(), st.integers(1, 9)),
    causal=st.booleans(),
)
def test_visited_blocks_cover_every_allowed_tile(n: int, block: int, window: int | None, causal: bool) -> None:
    # skipping is sound (no tile with an allowed entry is skipped) and causal tiles above the diagonal are skipped
    causal = causal or window is not None
    spec = _Spec(block=block, length=n * block, causal=causal, window=window, scale=1.0)
    pos = np.arange(n * block)
    allowed = np.ones((n * block, n * block), dtype=bool)
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    for i in range(n):
        lo, hi = (int(x) for x in spec.kv_range(jnp.int32(i), n))
        for j in range(n):
            needed = allowed[i * block : (i + 1) * block, j * block : (j + 1) * block].any()
            if needed:
                assert lo <= j < hi, (i, j, lo, hi)
                q_lo, q_hi = (int(x) for x in spec.q_range(jnp.int32(j), n))
                assert q_lo <= i < q_hi, (i, j, q_lo, q_hi)
            if causal:
                assert hi <= i + 1


def test_low_precision_inputs_accumulate_in_float32() -> None:
    P, H, Hd = hax.make_axes(position=9, heads=2, head_size=8)
    keys = jax.random.split(jax.random.key(2), 3)
    q, k, v = (hax.random.normal(kk, (P, H, Hd)).astype(jnp.bfloat16) for kk in keys)
    got = flash_attention(P, Hd, q, k, v, AttentionMask.causal(), block_size=4)
    assert got.dtype == jnp.bfloat16
    as32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = dot_product_attention(P, Hd, *as32, AttentionMask.causal())
    np.testing.assert_allclose(np.asarray(got.array, np.float32), np.asarray(ref.array), atol=2e-2)


def _shapes(jaxpr: Any) -> list[tuple[int, ...]]:
    """Every array shape printed in a jaxpr (nested jaxprs included)."""
    return [tuple(int(x) for x in dims.split(",")) for dims in re.findall(r"\[(\d+(?:,\d+)*)\]", str(jaxpr))]


def test_flash_never_builds_a_position_by_position_array() -> None:
    P, H, Hd = hax.make_axes(position=64, heads=3, head_size=5)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (hax.random.normal(kk, (P, H, Hd)) for kk in keys)
    mask = AttentionMask.causal()

    def grads(fn: AttentionFn) -> Any:
        return jax.make_jaxpr(jax.grad(lambda q, k, v: hax.sum(fn(q, k, v) ** 2).scalar(), argnums=(0, 1, 2)))(q, k, v)

    def square(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        return [s for s in shapes if sum(d == P.size for d in s) >= 2]

    ref = grads(lambda q, k, v: dot_product_attention(P, Hd, q, k, v, mask))
    assert square(_shapes(ref))  # the check can fail: the reference builds (position, key_position) scores
    flash = grads(lambda q, k, v: flash_attention(P, Hd, q, k, v, mask, block_size=16))
    assert _shapes(flash)
    assert not square(_shapes(flash))


def test_explicit_mask_is_rejected_naming_the_backend() -> None:
    P, Hd = hax.make_axes(position=4, head_size=2)
    x = hax.ones((P, Hd))
    explicit = AttentionMask.causal().materialize(P, P.alias("key_position"))
    with pytest.raises(ValueError, match="flash"):
        flash_attention(P, Hd, x, x, x, explicit)


def test_bad_arguments_name_the_problem() -> None:
    P, Hd = hax.make_axes(position=4, head_size=2)
    x = hax.ones((P, Hd))
    with pytest.raises(ValueError, match="block_size"):
        flash_attention(P, Hd, x, x, x, None, block_size=0)
    with pytest.raises(ValueError, match="logit_soft_cap must be positive"):
        flash_attention(P, Hd, x, x, x, None, logit_soft_cap=0.0)
    with pytest.raises(ValueError, match="'position'"):
        flash_attention(P, Hd, x, x.rename({"position": "pos"}), x, None)
    with pytest.raises(ValueError, match="kv_heads"):
        flash_attention(P, Hd, x, hax.ones((P, hax.Axis("kv_heads", 2), Hd)), x, None)
