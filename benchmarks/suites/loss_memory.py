"""Peak memory of the next-token loss at vocabulary 128k and sequence 2048: fused vs plain (and blockwise).

All three losses take the final hidden states ``[batch, 2048, 2048]`` (Llama-3.2-1B width) and the output
projection ``[2048, 128256]``, in bfloat16 on accelerators and float32 on CPUs (XLA:CPU has no bfloat16 matrix
product: it upcasts, and hoists a float32 copy of the whole projection out of the losses' loops), and return the
mean cross-entropy and its gradients wrt both:

- ``plain`` materializes float32 logits ``[batch, 2048, 128256]`` and their gradient;
- ``fused`` is ``fused_cross_entropy_loss`` with its default chunks (``FUSED_LOSS_CHUNK_ELEMENTS`` logits, 1024
  tokens at this vocabulary), what ``compute_next_token_loss(block_size="auto")`` uses for a mean at this
  vocabulary: the gradient is computed with the loss, chunk by chunk over positions;
- ``blockwise`` is ``blockwise_cross_entropy_loss`` with ``FUSED_LOSS_BLOCK_SIZE`` vocabulary blocks (it recomputes
  the logits in its backward pass; ``"auto"`` keeps it for ``reduction="none"``), for comparison.

Memory is XLA's compiled analysis of the jitted forward+backward (so it runs on a CPU without allocating
anything): the scratch ("temp") bytes, the loss's own peak beyond its inputs and outputs. Target: fused <= 1/4 of
plain, at batch 4 (``PONENTE_BENCH_LOSS_BATCH``, the batch of the Llama-1B GPU baseline); batch 1 is recorded too
(``.../batch1``), without a target. The batch matters because the fused loss's scratch does not grow with the
tokens while the plain loss's does: it is the gradient of the projection, computed in the forward pass and kept
for the backward one (``[2048, 128256]``: 1 GiB in float32, 0.5 GiB in bfloat16), and one chunk's logits and their
gradient. Measured (2026-11-26): on a CPU, fused 1.6 GB vs plain 12.6 GB at batch 4 (0.13) and vs 3.2 GB at batch 1
(0.51); on an H100 (bfloat16), 0.53 GB vs 4.2 GB at batch 4 (0.13), and 0.53 vs 0.56 GB at batch 1, where XLA fuses
the plain loss's softmax into little scratch. The blockwise loss takes 0.06-0.11 of the plain loss's.
Knobs: ``PONENTE_BENCH_LOSS_VOCAB``, ``PONENTE_BENCH_LOSS_SEQ``, ``PONENTE_BENCH_LOSS_EMBED``,
``PONENTE_BENCH_LOSS_BATCH``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.models import blockwise_cross_entropy_loss
from ponente.models.lm import FUSED_LOSS_BLOCK_SIZE, FUSED_LOSS_CHUNK_ELEMENTS, fused_cross_entropy_loss
from ponente.namedtensor import NamedArray

if TYPE_CHECKING:
    from benchmarks.harness import Recorder


def run(rec: Recorder) -> None:
    """Compiled scratch memory of the plain, the fused and the blockwise loss (forward+backward), at two batches."""
    vocab = int(os.environ.get("PONENTE_BENCH_LOSS_VOCAB", "128256"))
    seq = int(os.environ.get("PONENTE_BENCH_LOSS_SEQ", "2048"))
    embed = int(os.environ.get("PONENTE_BENCH_LOSS_EMBED", "2048"))
    batch = int(os.environ.get("PONENTE_BENCH_LOSS_BATCH", "4"))
    for size in sorted({1, batch}):
        _measure(rec, vocab, seq, embed, size, "" if size == batch else f"/batch{size}")


def _measure(rec: Recorder, vocab: int, seq: int, embed: int, batch: int, suffix: str) -> None:
    Batch, Pos, Embed, Vocab = hax.make_axes(batch=batch, position=seq, embed=embed, vocab=vocab)

    def plain(h: NamedArray, w: NamedArray, t: NamedArray) -> jax.Array:
        logits = hax.dot(h, w, axis=Embed).astype(jnp.float32)
        per = hax.nn.logsumexp(logits, Vocab) - hax.sum(logits * hax.nn.one_hot(t, Vocab, dtype=jnp.float32), Vocab)
        return hax.mean(per).scalar()

    def fused(h: NamedArray, w: NamedArray, t: NamedArray) -> jax.Array:
        return fused_cross_entropy_loss(h, w, t).scalar()

    def blockwise(h: NamedArray, w: NamedArray, t: NamedArray) -> jax.Array:
        return hax.mean(blockwise_cross_entropy_loss(h, w, t, block_size=FUSED_LOSS_BLOCK_SIZE)).scalar()

    def spec(axes: tuple[hax.Axis, ...], dtype: Any) -> NamedArray:
        return NamedArray(jax.ShapeDtypeStruct(tuple(ax.size for ax in axes), dtype), axes)

    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    args = (spec((Batch, Pos, Embed), dtype), spec((Embed, Vocab), dtype), spec((Batch, Pos), jnp.int32))
    extra = {
        "vocab": vocab,
        "seq_len": seq,
        "batch": batch,
        "embed": embed,
        "chunk_elements": FUSED_LOSS_CHUNK_ELEMENTS,
        "block_size": FUSED_LOSS_BLOCK_SIZE,
        "dtype": jnp.dtype(dtype).name,
        "device": jax.devices()[0].device_kind,
    }
    scratch = {}
    for name, fn in (("plain", plain), ("fused", fused), ("blockwise", blockwise)):
        stats = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile().memory_analysis()
        if stats is None:
            raise RuntimeError(f"loss-memory: XLA gives no memory analysis on {jax.devices()[0].device_kind}")
        scratch[name] = float(stats.temp_size_in_bytes)
        rec.record(f"loss/{name}{suffix}", "scratch_memory", scratch[name], "bytes", **extra)
        rec.record(f"loss/{name}{suffix}", "output_memory", float(stats.output_size_in_bytes), "bytes", **extra)
    target = {} if suffix else {"target": "<= 0.25"}
    rec.record(f"loss{suffix}", "memory_ratio", scratch["fused"] / scratch["plain"], "fused/plain", **target, **extra)
    ratio = scratch["blockwise"] / scratch["plain"]
    rec.record(f"loss/blockwise{suffix}", "memory_ratio", ratio, "blockwise/plain", **extra)
