"""Each attention backend vs ``reference`` (values and q/k/v gradients), their errors, and ``auto``'s choices.

``xla`` and ``flash`` run here. ``cudnn`` and ``pallas`` need a GPU/TPU: their tests are marked ``gpu`` and
skipped (with the reason) elsewhere; the Pallas kernels' wiring (layouts, grouped heads, masks, soft cap) is
also checked on CPU through Pallas's interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models import AttentionMask, Gemma2Config
from ponente.models.attention import attention
from ponente.models.attention.backends import BACKENDS, FLASH_MIN_SEQ_LEN, AttentionCall, auto_backend
from ponente.models.attention.pallas import pallas_attention
from ponente.namedtensor import NamedArray

# head size 16 and 32 positions: small shapes the GPU kernels take (cuDNN: head size % 8; Triton: >= 16)
Batch, Pos, KVHeads, Group, HeadSize = hax.make_axes(
    batch=2, position=32, kv_heads=2, q_heads_per_group=3, head_size=16
)
SEGMENTS = np.array([[0] * 10 + [1] * 22, [4] * 29 + [5] * 3])

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason=f"needs a GPU; JAX runs on {jax.default_backend()}")


def _mask(kind: str) -> AttentionMask | NamedArray | None:
    seg = hax.named(SEGMENTS, (Batch, Pos))
    KPos = Pos.alias("key_position")
    explicit = hax.named(np.random.RandomState(3).rand(Pos.size, Pos.size) < 0.7, (Pos, KPos))
    explicit = explicit | hax.named(np.eye(Pos.size, dtype=bool), (Pos, KPos))  # every query sees a key
    return {
        "none": None,
        "causal": AttentionMask.causal(),
        "window": AttentionMask.causal(sliding_window=5),
        "window_segments": AttentionMask.causal(sliding_window=7).with_segment_ids(seg),
        "segments_bidirectional": AttentionMask(segment_ids=seg),
        "explicit": explicit,
    }[kind]


def _inputs(dtype: Any = jnp.float32, length: int | None = None) -> tuple[NamedArray, NamedArray, NamedArray]:
    P = Pos if length is None else Pos.resize(length)
    keys = jax.random.split(jax.random.key(0), 3)
    q = hax.random.normal(keys[0], (Batch, P, KVHeads, Group, HeadSize)).astype(dtype)
    k = hax.random.normal(keys[1], (Batch, KVHeads, P, HeadSize)).astype(dtype)  # kv heads before position
    v = hax.random.normal(keys[2], (Batch, P, KVHeads, HeadSize)).astype(dtype)
    return q, k, v


def _value_and_grads(fn: Callable[..., NamedArray], q: NamedArray, k: NamedArray, v: NamedArray) -> list[np.ndarray]:
    """Output and the gradients of ``sum(out * cotangent)`` wrt q, k and v, as float32 NumPy in fixed layouts."""
    ct = hax.random.normal(jax.random.key(7), q.axes).astype(q.dtype)

    def loss(q: NamedArray, k: NamedArray, v: NamedArray) -> tuple[jax.Array, NamedArray]:
        out = fn(q, k, v)
        return hax.sum((out * ct).astype(jnp.float32)).scalar(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    layouts = (q.axes, q.axes, k.axes, v.axes)
    return [np.asarray(x.rearrange(ax).array, np.float32) for x, ax in zip((out, *grads), layouts, strict=True)]


def _assert_matches_reference(
    fn: Callable[..., NamedArray],
    mask: AttentionMask | NamedArray | None,
    *,
    dtype: Any = jnp.float32,
    atol: float = 1e-5,
    soft_cap: float | None = None,
    length: int | None = None,
) -> None:
    q, k, v = _inputs(dtype, length)
    P = q.resolve_axis("position")
    ref = _value_and_grads(
        lambda q, k, v: attention(P, HeadSize, q, k, v, mask, backend="reference", logit_soft_cap=soft_cap),
        *(x.astype(jnp.float32) for x in (q, k, v)),
    )
    got = _value_and_grads(fn, q, k, v)
    for name, g, r in zip(("output", "dq", "dk", "dv"), got, ref, strict=True):
        np.testing.assert_allclose(g, r, atol=atol, rtol=atol, err_msg=name)


@pytest.mark.parametrize("kind", ["none", "causal", "window", "window_segments", "segments_bidirectional", "explicit"])
def test_xla_matches_reference(kind: str) -> None:
    mask = _mask(kind)
    _assert_matches_reference(lambda q, k, v: attention(Pos, HeadSize, q, k, v, mask, backend="xla"), mask)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the backend auto picks on a CPU")
def test_auto_on_cpu_matches_reference() -> None:
    P = Pos.resize(FLASH_MIN_SEQ_LEN["cpu"])  # long enough for auto to pick flash
    seg = hax.named(np.repeat([[0, 1], [2, 3]], [100, P.size - 100], axis=1), (Batch, P))
    mask = AttentionMask.causal(sliding_window=40).with_segment_ids(seg)
    assert auto_backend(AttentionCall("cpu", "float32", P.size, HeadSize.size, True, True)) == "flash"
    _assert_matches_reference(lambda q, k, v: attention(P, HeadSize, q, k, v, mask), mask, length=P.size)


def test_soft_capped_reference_matches_numpy() -> None:
    rs = np.random.RandomState(0)
    P, D, cap = 5, 4, 2.0
    Pos1, Hd = hax.make_axes(position=P, head_size=D)
    q, k, v = (rs.randn(P, D).astype(np.float32) * 3 for _ in range(3))
    named = [hax.named(x, (Pos1, Hd)) for x in (q, k, v)]
    out = attention(Pos1, Hd, *named, AttentionMask.causal(), backend="reference", logit_soft_cap=cap)
    logits = cap * np.tanh(q @ k.T / np.sqrt(D) / cap)
    logits = np.where(np.tril(np.ones((P, P), dtype=bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out.array), (w / w.sum(-1, keepdims=True)) @ v, atol=1e-5)


# --- Pallas kernels, wired up on CPU through Pallas's interpreter ------------------------------------------------


@pytest.mark.parametrize("kind", ["causal", "segments_bidirectional"])
def test_pallas_gpu_kernel_wiring_matches_reference(kind: str) -> None:
    mask = _mask(kind)
    _assert_matches_reference(
        lambda q, k, v: pallas_attention(Pos, HeadSize, q, k, v, mask, platform="gpu", interpret=True, block_size=16),
        mask,
    )


def test_pallas_tpu_kernel_wiring_matches_reference() -> None:
    # splash attention: sliding window + segments + soft cap + grouped heads; its tiles are 128 positions
    seg = hax.named(np.repeat([[0, 1], [2, 2]], [100, 156], axis=1), (Batch, Pos.resize(256)))
    mask = AttentionMask.causal(sliding_window=40).with_segment_ids(seg)
    P = Pos.resize(256)
    _assert_matches_reference(
        lambda q, k, v: pallas_attention(
            P, HeadSize, q, k, v, mask, platform="tpu", interpret=True, logit_soft_cap=3.0
        ),
        mask,
        soft_cap=3.0,
        length=256,
    )


# --- kernels that need a GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("backend", ["cudnn", "pallas"])
@pytest.mark.parametrize("kind", ["causal", "segments_bidirectional"])
def test_gpu_backend_matches_reference(backend: str, kind: str) -> None:
    # bfloat16 inputs (cuDNN's requirement); the reference runs in float32 on the same values
    mask = _mask(kind)
    _assert_matches_reference(
        lambda q, k, v: attention(Pos, HeadSize, q, k, v, mask, backend=backend), mask, dtype=jnp.bfloat16, atol=5e-2
    )


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    ("backend", "kind"), [("cudnn", "window_segments"), ("cudnn", "packed_causal"), ("pallas", "packed_causal")]
)
def test_gpu_segments_match_reference(backend: str, kind: str) -> None:
    # (the Triton kernel has no sliding window; that error is tested on CPU)
    if kind == "packed_causal":  # several documents per row, a one-token document, padding (-1) at the end
        ids = np.array([[0] * 5 + [1] + [2] * 20 + [-1] * 6, [7] * 12 + [8] * 12 + [9] * 8])
        mask: AttentionMask | NamedArray | None = AttentionMask.causal().with_segment_ids(hax.named(ids, (Batch, Pos)))
    else:
        mask = _mask(kind)
    _assert_matches_reference(
        lambda q, k, v: attention(Pos, HeadSize, q, k, v, mask, backend=backend), mask, dtype=jnp.bfloat16, atol=5e-2
    )


@pytest.mark.gpu
@on_gpu
def test_cudnn_sliding_window_matches_reference() -> None:
    mask = _mask("window")
    _assert_matches_reference(
        lambda q, k, v: attention(Pos, HeadSize, q, k, v, mask, backend="cudnn"), mask, dtype=jnp.bfloat16, atol=5e-2
    )


# --- errors naming the unsupported combination -------------------------------------------------------------------


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the errors raised on a CPU")
@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("pallas", r"'pallas' does not support device 'cpu'.*GPUs and TPUs"),
        ("cudnn", r"'cudnn' does not support device 'cpu'.*NVIDIA GPUs"),
    ],
)
def test_device_kernels_on_cpu_name_the_device(backend: str, message: str) -> None:
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=message):
        attention(Pos, HeadSize, q, k, v, AttentionMask.causal(), backend=backend)


def test_unsupported_combinations_are_named() -> None:
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"'xla' does not support logit soft-capping.*'auto' would use 'reference'"):
        attention(Pos, HeadSize, q, k, v, AttentionMask.causal(), backend="xla", logit_soft_cap=5.0)
    with pytest.raises(ValueError, match=r"'flash' does not support an explicit NamedArray mask"):
        attention(Pos, HeadSize, q, k, v, _mask("explicit"), backend="flash")
    with pytest.raises(ValueError, match=r"the value must have the key's axes"):
        attention(Pos, HeadSize, q, k, v.rename({"head_size": "v_size"}), None, backend="xla")
    gpu = AttentionCall("gpu", "bfloat16", seq_len=128, head_size=64)
    assert BACKENDS["cudnn"].supports(gpu) is None
    assert "dtype float32" in str(BACKENDS["cudnn"].supports(AttentionCall("gpu", "float32", 128, 64)))
    assert "head size 72" not in str(BACKENDS["cudnn"].supports(AttentionCall("gpu", "bfloat16", 128, 72)))
    assert "head size 100" in str(BACKENDS["cudnn"].supports(AttentionCall("gpu", "bfloat16", 128, 100)))
    assert "sliding window on GPU" in str(BACKENDS["pallas"].supports(AttentionCall("gpu", "bfloat16", 128, 64, True)))


def test_soft_capping_models_get_a_backend_that_caps() -> None:
    base: dict[str, Any] = {"seq_len": 8, "hidden_dim": 16, "intermediate_dim": 32, "num_layers": 2, "num_heads": 2}
    for backend in ("auto", "reference", "flash", "pallas"):
        assert Gemma2Config(**base, num_kv_heads=1, attn_backend=backend).attn_logit_softcapping == 50.0
    for backend in ("xla", "cudnn"):
        with pytest.raises(ValueError, match=f"'{backend}' attention backend has no logit soft-capping"):
            Gemma2Config(**base, num_kv_heads=1, attn_backend=backend)


# --- auto's static choice ----------------------------------------------------------------------------------------

BF16 = {"dtype": "bfloat16", "head_size": 64}
F32 = {"dtype": "float32", "head_size": 64}


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        # GPU from 2048 positions: cuDNN whenever it can (bf16/fp16, head size % 8 <= 128, no soft cap) ...
        (AttentionCall("gpu", seq_len=2048, **BF16), "cudnn"),
        (AttentionCall("gpu", seq_len=8192, sliding_window=True, segment_ids=True, **BF16), "cudnn"),
        # ... below 2048 the Triton kernel first (measured faster on an H100), cuDNN where it has no support ...
        (AttentionCall("gpu", "float16", seq_len=512, head_size=128), "pallas"),
        (AttentionCall("gpu", seq_len=1024, segment_ids=True, **BF16), "pallas"),
        (AttentionCall("gpu", seq_len=1024, sliding_window=True, **BF16), "cudnn"),
        # ... Triton where cuDNN cannot (float32), else materialized scores or the blockwise flash (memory)
        (AttentionCall("gpu", seq_len=2048, **F32), "pallas"),
        (AttentionCall("gpu", seq_len=16384, **F32), "pallas"),
        (AttentionCall("gpu", seq_len=16384, sliding_window=True, **F32), "flash"),
        (AttentionCall("gpu", "bfloat16", seq_len=2048, head_size=256), "reference"),
        (AttentionCall("gpu", seq_len=2048, soft_cap=True, **BF16), "reference"),
        (AttentionCall("gpu", seq_len=16384, soft_cap=True, **BF16), "flash"),
        (AttentionCall("gpu", seq_len=2047, segment_ids=True, **BF16), "reference"),
        (AttentionCall("gpu", seq_len=16384, explicit_mask=True, **F32), "reference"),
        # TPU: splash attention (every feature) when the length is a multiple of 128
        (AttentionCall("tpu", seq_len=2048, soft_cap=True, sliding_window=True, **BF16), "pallas"),
        (AttentionCall("tpu", seq_len=1000, **BF16), "reference"),
        (AttentionCall("tpu", seq_len=10000, **BF16), "flash"),
        (AttentionCall("tpu", seq_len=2048, explicit_mask=True, **BF16), "reference"),
        # CPU: materialized scores for short sequences, flash from 256 positions on (the attention benchmark)
        (AttentionCall("cpu", seq_len=128, **F32), "reference"),
        (AttentionCall("cpu", seq_len=255, **F32), "reference"),
        (AttentionCall("cpu", seq_len=256, **F32), "flash"),
        (AttentionCall("cpu", seq_len=8192, segment_ids=True, sliding_window=True, **F32), "flash"),
        (AttentionCall("cpu", seq_len=512, soft_cap=True, **F32), "flash"),  # Gemma 2: flash soft-caps
        (AttentionCall("cpu", seq_len=255, soft_cap=True, **F32), "reference"),
        (AttentionCall("cpu", seq_len=8192, explicit_mask=True, **F32), "reference"),
        # an unknown platform is treated as a CPU
        (AttentionCall("metal", seq_len=4096, **F32), "flash"),
        (AttentionCall("metal", seq_len=64, **F32), "reference"),
    ],
)
def test_auto_choice(call: AttentionCall, expected: str) -> None:
    assert auto_backend(call) == expected
