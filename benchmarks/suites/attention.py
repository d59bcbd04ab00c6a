"""Every attention backend that runs on this device vs ``reference``: forward+backward time and compiled memory.

Causal grouped-query attention over sequence lengths 512..8192: on CPU batch 1, 2 kv heads x 2 query heads per
group, head size 64, float32; on GPU/TPU one sequence of Llama-3.2-1B's attention (8 kv heads x 4, head size 64),
bfloat16. For each length and each backend whose ``supports`` check accepts the call on this device, the suite
records the median forward+backward time, XLA's compiled scratch ("temp") memory, and both as ratios over
``reference`` at the same length; it also records which backend ``auto`` picks. These figures set
``FLASH_MIN_SEQ_LEN`` in ``ponente.models.attention.backends``. The ``packed`` mask (on GPU/TPU by default) is
the same causal attention over packed documents: segment ids of documents of random lengths (mean a quarter of
the sequence), named ``seqN-packed/backend``.

Environment knobs: ``PONENTE_BENCH_ATTN_SEQ_LENS`` (comma-separated, default ``512,1024,2048,4096,8192``),
``PONENTE_BENCH_ATTN_MASKS`` (``causal``, ``packed`` or both; default ``causal`` on CPU, both elsewhere),
``PONENTE_BENCH_ATTN_HEADS`` (``kv_heads,group``), ``PONENTE_BENCH_REPEAT`` (timed calls per measurement,
default 3 on CPU, 10 elsewhere), ``PONENTE_BENCH_ATTN_REFERENCE_MAX`` (longest length at which ``reference``
runs, default 8192; longer lengths get no ratios).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from benchmarks.harness import packed_segment_ids, time_fn
from ponente.models import AttentionMask
from ponente.models.attention import attention
from ponente.models.attention.backends import BACKENDS, AttentionCall, auto_backend

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

BLOCK = 128


def _step(backend: str, Pos: hax.Axis, HeadSize: hax.Axis, mask: AttentionMask) -> Any:
    def loss(q: hax.NamedArray, k: hax.NamedArray, v: hax.NamedArray) -> jax.Array:
        out = attention(Pos, HeadSize, q, k, v, mask, backend=backend, block_size=BLOCK)
        return hax.sum((out * out).astype(jnp.float32)).scalar()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _call(step: Any, *args: Any) -> None:
    jax.block_until_ready(step(*args))


def run(rec: Recorder) -> None:
    """Time and memory of each backend's causal attention, forward+backward, per sequence length."""
    platform = jax.default_backend()
    dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
    lengths = [int(x) for x in os.environ.get("PONENTE_BENCH_ATTN_SEQ_LENS", "512,1024,2048,4096,8192").split(",")]
    repeat = int(os.environ.get("PONENTE_BENCH_REPEAT", "3" if platform == "cpu" else "10"))
    reference_max = int(os.environ.get("PONENTE_BENCH_ATTN_REFERENCE_MAX", "8192"))
    masks = os.environ.get("PONENTE_BENCH_ATTN_MASKS", "causal" if platform == "cpu" else "causal,packed").split(",")
    kv, group = (
        int(x) for x in os.environ.get("PONENTE_BENCH_ATTN_HEADS", "2,2" if platform == "cpu" else "8,4").split(",")
    )
    for length, kind in ((n, m) for n in lengths for m in masks):
        Batch, Pos, KVHeads, Group, HeadSize = hax.make_axes(
            batch=1, position=length, kv_heads=kv, q_heads_per_group=group, head_size=64
        )
        mask = AttentionMask.causal()
        if kind == "packed":
            mask = mask.with_segment_ids(hax.named(packed_segment_ids(Batch.size, Pos.size), (Batch, Pos)))
        elif kind != "causal":
            raise ValueError(f"PONENTE_BENCH_ATTN_MASKS: unknown mask {kind!r}; choose causal or packed")
        label = f"seq{length}" if kind == "causal" else f"seq{length}-packed"
        keys = jax.random.split(jax.random.key(0), 3)
        q = hax.random.normal(keys[0], (Batch, Pos, KVHeads, Group, HeadSize)).astype(dtype)
        k = hax.random.normal(keys[1], (Batch, Pos, KVHeads, HeadSize)).astype(dtype)
        v = hax.random.normal(keys[2], (Batch, Pos, KVHeads, HeadSize)).astype(dtype)
        call = AttentionCall(
            platform, jnp.dtype(dtype).name, seq_len=length, head_size=HeadSize.size, segment_ids=kind == "packed"
        )
        extra = {
            "seq_len": length,
            "mask": kind,
            "dtype": call.dtype,
            "kv_heads": kv,
            "heads": kv * group,
            "head_size": HeadSize.size,
            "repeat": repeat,
            "device": jax.devices()[0].device_kind,
        }
        rec.record(f"{label}/auto", "choice", 1.0, auto_backend(call), **extra)
        times: dict[str, float] = {}
        memory: dict[str, float] = {}
        for name, backend in BACKENDS.items():
            if backend.supports(call) is not None or (name == "reference" and length > reference_max):
                continue
            step = _step(name, Pos, HeadSize, mask)
            stats = step.lower(q, k, v).compile().memory_analysis()
            memory[name] = float(stats.temp_size_in_bytes) if stats is not None else float("nan")
            times[name] = time_fn(functools.partial(_call, step, q, k, v), warmup=1, repeat=repeat)
            rec.record(f"{label}/{name}", "fwd_bwd_time", times[name], "s", **extra)
            rec.record(f"{label}/{name}", "scratch_memory", memory[name], "bytes", **extra)
        if "reference" not in times:
            continue
        for name in times:
            if name != "reference":
                rec.record(f"{label}/{name}", "time_ratio", times[name] / times["reference"], "x/reference", **extra)
                rec.record(
                    f"{label}/{name}", "memory_ratio", memory[name] / memory["reference"], "x/reference", **extra
                )
