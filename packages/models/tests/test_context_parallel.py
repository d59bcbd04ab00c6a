"""Context parallelism: attention over a zig-zag permuted ``position`` axis split over 4 of 8 simulated devices
equals single-device attention in the original order (outputs and gradients), with packed segments, sliding windows,
soft caps and attention sinks; the zig-zag example leaves the next-token loss unchanged."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models import AttentionMask, LlamaConfig, LmExample, compute_next_token_loss, config_for_type
from ponente.models.attention import attention
from ponente.models.attention.ring import ring_attention
from ponente.models.context_parallel import check_context_split, zigzag_example, zigzag_permutation

Batch, Pos, KVHeads, Group, HeadSize = (
    hax.Axis("batch", 2),
    hax.Axis("position", 32),
    hax.Axis("kv_heads", 2),
    hax.Axis("q_heads_per_group", 2),
    hax.Axis("head_size", 8),
)
CONTEXT = 4


def test_zigzag_permutation_balances_the_causal_work() -> None:
    perm = zigzag_permutation(32, 4)
    assert sorted(perm.tolist()) == list(range(32))
    # keys seen by each query under a causal mask: index + 1; every device (8 consecutive rows) gets the same sum
    work = (perm + 1).reshape(4, 8).sum(axis=1)
    assert len(set(work.tolist())) == 1
    assert perm.reshape(4, 8)[1].tolist() == [*range(4, 8), *range(24, 28)]


def test_bad_lengths_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"trainer\.context_axis_size=4: .* 100 .* 2 x 4 = 8"):
        check_context_split(100, 4)


def _inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    q = hax.random.normal(keys[0], (Batch, Pos, KVHeads, Group, HeadSize))
    k = hax.random.normal(keys[1], (Batch, Pos, KVHeads, HeadSize))
    v = hax.random.normal(keys[2], (Batch, Pos, KVHeads, HeadSize))
    # packed documents: segment boundaries at different places in each row
    seg = np.zeros((Batch.size, Pos.size), np.int32)
    seg[0, 9:] = 1
    seg[0, 20:] = 2
    seg[1, 15:] = 1
    return q, k, v, hax.named(jnp.asarray(seg), (Batch, Pos))


def _permute(x: hax.NamedArray, perm: np.ndarray) -> hax.NamedArray:
    return hax.named(jnp.take(x.array, jnp.asarray(perm), axis=x.axis_indices("position")), x.axes)


def _objective(out: hax.NamedArray) -> jax.Array:
    return jnp.sum(jnp.sin(out.array) * jnp.cos(jnp.arange(out.array.size).reshape(out.array.shape)))


CASES = {
    "causal_packed": {"window": None, "cap": None},
    "sliding_packed": {"window": 6, "cap": None},
    "softcap_sliding_packed": {"window": 6, "cap": 2.0},
    "full": {"window": None, "cap": None, "causal": False, "packed": False},  # no mask: every key block, no ids
    "sinks_sliding_packed": {"window": 6, "cap": None, "sinks": True},  # gpt-oss: a sink logit per query head
}


def _masks(case: str, seg: hax.NamedArray, perm: np.ndarray) -> tuple[AttentionMask, AttentionMask]:
    """The case's mask in the original order and in the permuted order (with the token indices)."""
    window = CASES[case]["window"]
    mask = AttentionMask.causal(window) if CASES[case].get("causal", True) else AttentionMask()
    pmask = mask.with_token_index(hax.named(jnp.asarray(perm), (Pos,)))
    if CASES[case].get("packed", True):
        mask, pmask = mask.with_segment_ids(seg), pmask.with_segment_ids(_permute(seg, perm))
    return mask, pmask


def test_ring_attention_on_one_device_is_the_reference() -> None:
    q, k, v, seg = _inputs()
    for window, cap in ((None, None), (6, 2.0)):
        mask = AttentionMask.causal(window).with_segment_ids(seg)
        ref = functools.partial(attention, Pos, HeadSize, logit_soft_cap=cap)
        ring = functools.partial(ring_attention, Pos, HeadSize, logit_soft_cap=cap)
        want, got = jax.jit(ref)(q, k, v, mask), jax.jit(ring)(q, k, v, mask)
        np.testing.assert_allclose(np.asarray(got.array), np.asarray(want.array), atol=1e-5)


@pytest.mark.parametrize("case", [c for c in CASES if not CASES[c].get("sinks")])  # sinks: the flash kernel's tests
def test_flash_follows_token_indices(case: str) -> None:
    """The blockwise kernel on permuted tokens (token indices, tiles hidden by the mask skipped) equals the
    reference on the original order, values and gradients."""
    cap = CASES[case]["cap"]
    q, k, v, seg = _inputs()
    perm = zigzag_permutation(Pos.size, CONTEXT)
    inverse = np.argsort(perm)
    mask, pmask = _masks(case, seg, perm)

    def loss(backend, q, k, v, mask, back):
        out = attention(Pos, HeadSize, q, k, v, mask, backend=backend, block_size=4, logit_soft_cap=cap)
        return _objective(_permute(out, back) if back is not None else out)

    want = jax.value_and_grad(functools.partial(loss, "reference"), argnums=(0, 1, 2))(q, k, v, mask, None)
    pq, pk, pv = (_permute(x, perm) for x in (q, k, v))
    flash = jax.jit(jax.value_and_grad(functools.partial(loss, "flash"), argnums=(0, 1, 2)), static_argnums=(4,))
    got = flash(pq, pk, pv, pmask, tuple(inverse.tolist()))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(np.asarray(_permute(g, inverse).array), np.asarray(w.array), atol=1e-5)


@pytest.mark.multidevice
@pytest.mark.parametrize("mode", ["allgather", "allgather_flash", "ring", "ring_flash"])
@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_attention_matches_one_device(case: str, mode: str) -> None:
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    cap = CASES[case]["cap"]
    q, k, v, seg = _inputs()
    perm = zigzag_permutation(Pos.size, CONTEXT)
    mask, pmask = _masks(case, seg, perm)
    backend = "flash" if mode.endswith("_flash") else "reference"
    strategy = mode.removesuffix("_flash")

    # gpt-oss's sinks (one logit per query head) are a fourth differentiable input
    sinks = (hax.random.normal(jax.random.key(5), (KVHeads, Group)),) if CASES[case].get("sinks") else ()

    def attend(mask, q, k, v, *sinks):
        return attention(
            Pos,
            HeadSize,
            q,
            k,
            v,
            mask,
            backend=backend,
            block_size=4,
            logit_soft_cap=cap,
            context_parallel=strategy,
            sinks=sinks[0] if sinks else None,
        )

    every = tuple(range(3 + len(sinks)))

    def value_and_grads(mask, *xs):
        out = attend(mask, *xs)
        grads = jax.grad(lambda *a: _objective(attend(mask, *a)), argnums=every)(*xs)
        return out, grads

    # the single-device reference, in the original order
    ref_out, ref_grads = jax.jit(value_and_grads)(mask, q, k, v, *sinks)

    inverse = np.argsort(perm)
    pq, pk, pv = (_permute(x, perm) for x in (q, k, v))

    mapping = {"batch": "data", "position": "context"}
    mesh = hax.partitioning.make_mesh({"data": 2, "context": CONTEXT}, devices=jax.devices()[:8])

    @hax.named_jit(axis_resources=mapping)
    def run(mask, *xs):
        q, k, v, mask = hax.shard((*xs[:3], mask), mapping)
        xs = (q, k, v, *xs[3:])
        out = hax.shard(attend(mask, *xs), mapping)

        def objective(*a):
            # the reference's objective weights positions in the original order
            return _objective(_permute(attend(mask, *a), inverse))

        return out, jax.grad(objective, argnums=every)(*xs)

    with hax.partitioning.set_mesh(mesh):
        hlo = run.lower(pmask, pq, pk, pv, *sinks).as_text()
        out, grads = run(pmask, pq, pk, pv, *sinks)
    if strategy == "ring":  # key/value blocks travel around the ring, never gathered
        assert "collective_permute" in hlo or "collective-permute" in hlo
    else:
        assert "all_gather" in hlo or "all-gather" in hlo
    # each device holds a quarter of the query rows (and half of the batch)
    shard = out.array.addressable_shards[0].data
    assert shard.shape[out.axis_indices("position")] == Pos.size // CONTEXT
    assert shard.shape[out.axis_indices("batch")] == Batch.size // 2
    np.testing.assert_allclose(np.asarray(_permute(out, inverse).array), np.asarray(ref_out.array), atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        back = np.asarray((_permute(got, inverse) if got.has_axis("position") else got).array)
        np.testing.assert_allclose(back, np.asarray(want.array), atol=1e-5)


MAPPING = {"batch": "data", "position": "context"}


def _mesh() -> jax.sharding.Mesh:
    return hax.partitioning.make_mesh({"data": 2, "context": CONTEXT}, devices=jax.devices()[:8])


@pytest.mark.multidevice
def test_ring_flash_in_bfloat16_returns_bfloat16_gradients() -> None:
    """bfloat16 inputs: the ring accumulates in float32 and returns the output and gradients in bfloat16, within
    bfloat16 rounding of the float32 reference on the same (rounded) inputs."""
    q, k, v, seg = _inputs()
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    perm = zigzag_permutation(Pos.size, CONTEXT)
    inverse = np.argsort(perm)
    mask, pmask = _masks("causal_packed", seg, perm)

    def ref(a, b, c):
        return _objective(attention(Pos, HeadSize, a, b, c, mask, backend="reference"))

    want = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))

    @hax.named_jit(axis_resources=MAPPING)
    def run(q, k, v, mask):
        q, k, v, mask = hax.shard((q, k, v, mask), MAPPING)

        def objective(a, b, c):
            out = attention(Pos, HeadSize, a, b, c, mask, backend="flash", block_size=4, context_parallel="ring")
            assert out.dtype == jnp.bfloat16
            return _objective(_permute(out, inverse).astype(jnp.float32))

        return jax.grad(objective, argnums=(0, 1, 2))(q, k, v)

    with hax.partitioning.set_mesh(_mesh()):
        grads = run(*(_permute(x, perm) for x in (q, k, v)), pmask)
    for got, w in zip(grads, want, strict=True):
        assert got.dtype == jnp.bfloat16
        back = np.asarray(_permute(got, inverse).array.astype(jnp.float32))
        np.testing.assert_allclose(back, np.asarray(w.array), atol=3e-2, rtol=3e-2)


@pytest.mark.multidevice
def test_blockwise_ring_keeps_no_more_memory_than_allgather() -> None:
    """The blockwise ring's backward pass keeps nothing per step (its own VJP: the inputs, the output and the final
    log-sum-exp), so the compiled gradient's temporaries per device are at most all-gather's, which holds every key
    and value. (Differentiating through the ring's steps kept each step's output, log-sum-exp and received block:
    about twice all-gather's at this shape.)"""
    Long, Hd = hax.Axis("position", 256), hax.Axis("head_size", 16)
    keys = jax.random.split(jax.random.key(0), 3)
    q = hax.random.normal(keys[0], (Batch, Long, KVHeads, Group, Hd))
    k, v = (hax.random.normal(key, (Batch, Long, KVHeads, Hd)) for key in keys[1:])
    mask = AttentionMask.causal().with_token_index(hax.named(jnp.asarray(zigzag_permutation(256, CONTEXT)), (Long,)))
    temp = {}
    for mode in ("allgather", "ring"):

        @hax.named_jit(axis_resources=MAPPING)
        def grads(q, k, v, mode=mode):
            q, k, v = hax.shard((q, k, v), MAPPING)

            def total(a, b, c):
                out = attention(Long, Hd, a, b, c, mask, backend="flash", block_size=16, context_parallel=mode)
                return hax.sum(out).scalar()

            return jax.grad(total, argnums=(0, 1, 2))(q, k, v)

        with hax.partitioning.set_mesh(_mesh()):
            temp[mode] = grads.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    assert temp["ring"] <= temp["allgather"], temp


@pytest.mark.parametrize("family", ["llama", "gpt2", "olmo2", "gpt_oss", "deepseek_v3"])
def test_every_family_takes_the_context_parallel_key(family: str) -> None:
    """``model.attention_context_parallel`` reaches every attention layer a family builds (a family that built its
    own attention and dropped the key would silently run ``allgather``)."""
    tiny = {"seq_len": 16, "hidden_dim": 16, "intermediate_dim": 32, "num_layers": 2, "num_heads": 4}
    extra: dict[str, dict[str, object]] = {
        "gpt2": {"num_kv_heads": 4},
        "gpt_oss": {"num_kv_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
        "deepseek_v3": {
            "num_kv_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_dim": 8,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 8,
            "q_lora_rank": 8,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 4,
        },
    }
    config = config_for_type(family)(
        **tiny, **extra.get(family, {"num_kv_heads": 2}), attention_context_parallel="ring"
    )
    model = eqx.filter_eval_shape(lambda key: config.build(hax.Axis("vocab", 32), key=key), jax.random.key(0))
    layers = [
        x
        for x in jax.tree_util.tree_leaves(model, is_leaf=lambda x: hasattr(x, "context_parallel"))
        if hasattr(x, "context_parallel")
    ]
    assert layers
    assert {x.context_parallel for x in layers} == {"ring"}


def test_zigzag_example_keeps_the_loss() -> None:
    """The permuted example (explicit targets, positions, token indices) gives the loss of the original one."""
    config = LlamaConfig(seq_len=16, hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=4, num_kv_heads=2)
    Vocab = hax.Axis("vocab", 32)
    model = config.build(Vocab, key=jax.random.key(1))
    ids = hax.named(jax.random.randint(jax.random.key(2), (2, 16), 0, 32), ("batch", "position"))
    seg = hax.named(jnp.asarray(np.repeat([[0, 1, 2, 3], [0, 0, 1, 1]], 4, axis=1)), ("batch", "position"))
    example = LmExample.causal(ids, segment_ids=seg)
    loss = eqx.filter_jit(lambda m, ex: compute_next_token_loss(m, ex, block_size=None).array)
    want = float(loss(model, example))
    got = float(loss(model, zigzag_example(example, 4)))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert zigzag_example(example, 1) is example
