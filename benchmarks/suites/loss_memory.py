"""Peak memory of the next-token loss at vocabulary 128k and sequence 2048: fused (blockwise) vs plain.

Both losses take the final hidden states ``[1, 2048, 2048]`` (Llama-3.2-1B width) and the output projection
``[2048, 128256]``, in bfloat16 on accelerators and float32 on CPUs (XLA:CPU has no bfloat16 matrix product: it
upcasts, and hoists a float32 copy of the whole projection out of the fused loss's loop), and return the mean
cross-entropy and its gradients wrt both; the plain loss materializes float32 logits, the fused one
(``blockwise_cross_entropy_loss`` with ``FUSED_LOSS_BLOCK_SIZE``, what ``compute_next_token_loss(block_size="auto")``
uses at this vocabulary) never does. Memory is XLA's compiled
analysis of the jitted forward+backward (so it runs on a CPU without allocating anything): the scratch ("temp")
bytes, the loss's own peak beyond its inputs and outputs. Target: fused <= 1/4 of plain.
Knobs: ``PONENTE_BENCH_LOSS_VOCAB``, ``PONENTE_BENCH_LOSS_SEQ``, ``PONENTE_BENCH_LOSS_EMBED``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.models import blockwise_cross_entropy_loss
from ponente.models.lm import FUSED_LOSS_BLOCK_SIZE
from ponente.namedtensor import NamedArray

if TYPE_CHECKING:
    from benchmarks.harness import Recorder


def run(rec: Recorder) -> None:
    """Compiled scratch memory of the plain and the fused loss (forward+backward)."""
    vocab = int(os.environ.get("PONENTE_BENCH_LOSS_VOCAB", "128256"))
    seq = int(os.environ.get("PONENTE_BENCH_LOSS_SEQ", "2048"))
    embed = int(os.environ.get("PONENTE_BENCH_LOSS_EMBED", "2048"))
    Batch, Pos, Embed, Vocab = hax.make_axes(batch=1, position=seq, embed=embed, vocab=vocab)

    def plain(h: NamedArray, w: NamedArray, t: NamedArray) -> jax.Array:
        logits = hax.dot(h, w, axis=Embed).astype(jnp.float32)
        per = hax.nn.logsumexp(logits, Vocab) - hax.sum(logits * hax.nn.one_hot(t, Vocab, dtype=jnp.float32), Vocab)
        return hax.mean(per).scalar()

    def fused(h: NamedArray, w: NamedArray, t: NamedArray) -> jax.Array:
        return hax.mean(blockwise_cross_entropy_loss(h, w, t, block_size=FUSED_LOSS_BLOCK_SIZE)).scalar()

    def spec(axes: tuple[hax.Axis, ...], dtype: Any) -> NamedArray:
        return NamedArray(jax.ShapeDtypeStruct(tuple(ax.size for ax in axes), dtype), axes)

    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    args = (spec((Batch, Pos, Embed), dtype), spec((Embed, Vocab), dtype), spec((Batch, Pos), jnp.int32))
    extra = {
        "vocab": vocab,
        "seq_len": seq,
        "embed": embed,
        "block_size": FUSED_LOSS_BLOCK_SIZE,
        "dtype": jnp.dtype(dtype).name,
        "device": jax.devices()[0].device_kind,
    }
    scratch = {}
    for name, fn in (("plain", plain), ("fused", fused)):
        stats = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile().memory_analysis()
        if stats is None:
            raise RuntimeError(f"loss-memory: XLA gives no memory analysis on {jax.devices()[0].device_kind}")
        scratch[name] = float(stats.temp_size_in_bytes)
        rec.record(f"loss/{name}", "scratch_memory", scratch[name], "bytes", **extra)
        rec.record(f"loss/{name}", "output_memory", float(stats.output_size_in_bytes), "bytes", **extra)
    rec.record("loss", "memory_ratio", scratch["fused"] / scratch["plain"], "fused/plain", target="<= 0.25", **extra)
