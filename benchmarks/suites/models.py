"""Flash vs reference attention: forward+backward time and scratch memory at a moderate sequence length.

Both compute causal grouped-query attention on the same inputs and are jitted. The suite records each
median step time, the time ratio flash/reference (flash skips the key blocks above the causal diagonal;
target <= 1), and the ratio of XLA's compiled scratch ("temp") memory, flash/reference (target << 1:
flash never materializes (position, key_position) scores). A second pair compares the blockwise
cross-entropy with the materialized-logits loss the same way (target memory ratio << 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from benchmarks.harness import time_fn
from ponente.models import AttentionMask, blockwise_cross_entropy_loss
from ponente.models.attention import attention
from ponente.namedtensor import Axis, NamedArray

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

Batch, Pos, KVHeads, Group, HeadSize = hax.make_axes(
    batch=1, position=1024, kv_heads=2, q_heads_per_group=2, head_size=64
)
BLOCK = 128
Embed, Vocab = Axis("embed", 256), Axis("vocab", 8192)


def _attention_step(backend: str) -> Callable[[NamedArray, NamedArray, NamedArray], Any]:
    mask = AttentionMask.causal()

    def loss(q: NamedArray, k: NamedArray, v: NamedArray) -> jax.Array:
        out = attention(Pos, HeadSize, q, k, v, mask, backend=backend, block_size=BLOCK)
        return hax.sum(out * out).scalar()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _loss_step(blockwise: bool) -> Callable[[NamedArray, NamedArray, NamedArray], Any]:
    def loss(h: NamedArray, w: NamedArray, t: NamedArray) -> jax.Array:
        if blockwise:
            per = blockwise_cross_entropy_loss(h, w, t, block_size=1024)
        else:
            logits = hax.dot(h, w, axis=Embed)
            per = hax.nn.logsumexp(logits, Vocab) - hax.sum(logits * hax.nn.one_hot(t, Vocab), Vocab)
        return hax.mean(per).scalar()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _scratch_bytes(step: Any, *args: Any) -> float:
    stats = step.lower(*args).compile().memory_analysis()
    return float(stats.temp_size_in_bytes) if stats is not None else float("nan")


def _measure(rec: Recorder, name: str, steps: dict[str, Any], args: tuple[Any, ...], **extra: Any) -> None:
    """Time and scratch memory of each step; records ``candidate/reference`` ratios (the first step is reference)."""
    times, scratch = {}, {}
    for label, step in steps.items():

        def call(step: Any = step) -> None:
            jax.block_until_ready(step(*args))

        times[label] = time_fn(call, warmup=2, repeat=5)
        scratch[label] = _scratch_bytes(step, *args)
        rec.record(f"{name}/{label}", "fwd_bwd_time", times[label], "s", **extra)
        rec.record(f"{name}/{label}", "scratch_memory", scratch[label], "bytes", **extra)
    reference, candidate = list(steps)
    rec.record(name, "time_ratio", times[candidate] / times[reference], f"{candidate}/{reference}", **extra)
    rec.record(name, "memory_ratio", scratch[candidate] / scratch[reference], f"{candidate}/{reference}", **extra)


def run(rec: Recorder) -> None:
    """Flash vs reference attention, blockwise vs full cross-entropy (forward+backward)."""
    keys = jax.random.split(jax.random.key(0), 5)
    q = hax.random.normal(keys[0], (Batch, Pos, KVHeads, Group, HeadSize))
    k = hax.random.normal(keys[1], (Batch, Pos, KVHeads, HeadSize))
    v = hax.random.normal(keys[2], (Batch, Pos, KVHeads, HeadSize))
    steps = {backend: _attention_step(backend) for backend in ("reference", "flash")}
    _measure(rec, "attention_causal", steps, (q, k, v), seq_len=Pos.size, block_size=BLOCK, heads=4)

    h = hax.random.normal(keys[3], (Batch, Pos, Embed))
    w = hax.random.normal(keys[4], (Embed, Vocab)) * Embed.size**-0.5
    t = hax.named(jnp.arange(Pos.size, dtype=jnp.int32)[None, :] % Vocab.size, (Batch, Pos))
    loss_steps = {"full": _loss_step(False), "blockwise": _loss_step(True)}
    _measure(rec, "cross_entropy", loss_steps, (h, w, t), tokens=Pos.size, vocab=Vocab.size, block_size=1024)
