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

With several devices (e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU) it also compiles the
fused loss with the batch (``PONENTE_BENCH_LOSS_BATCH`` rows per device) sharded over all of them, and records
what crosses devices per step: the all-reduces (inside the chunk loop, times its iterations, and after it) and
their bytes, with one group (``groups=1``, the loss before groups existed) and with the default (one group per
device, read from the axis mapping). Measured (2026-11-26, 8 CPU devices, batch 32): 64 all-reduces of the
projection's gradient per step with one group, 1 with the default.
Knobs: ``PONENTE_BENCH_LOSS_VOCAB``, ``PONENTE_BENCH_LOSS_SEQ``, ``PONENTE_BENCH_LOSS_EMBED``,
``PONENTE_BENCH_LOSS_BATCH``.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
import ponente.namedtensor.partitioning as partitioning
from ponente.models import blockwise_cross_entropy_loss
from ponente.models.loss import FUSED_LOSS_BLOCK_SIZE, FUSED_LOSS_CHUNK_ELEMENTS, fused_cross_entropy_loss
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
    if jax.device_count() > 1:
        _data_parallel(rec, vocab, seq, embed, batch)


_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "f64": 8}


def _all_reduces_per_step(hlo: str) -> tuple[int, int]:
    """All-reduces and their bytes per call of compiled HLO text, those in a loop body counted once per iteration."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = line.split(" ")[0]
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    iterations: dict[str, int] = {}
    for cond, body in re.findall(r"condition=(%[\w.\-]+), body=(%[\w.\-]+)", hlo):
        bounds = [int(b) for line in bodies.get(cond, []) for b in re.findall(r"s32\[\] constant\((\d+)\)", line)]
        iterations[body] = max(bounds, default=1)
    count = size = 0
    for name, lines in bodies.items():
        for line in lines:
            if not re.search(r" all-reduce(-start)?\(", line):
                continue
            result = re.split(r" all-reduce(?:-start)?\(", line)[0].split("=", 1)[1]  # the result's type(s)
            shapes = re.findall(r"(\w+)\[([\d,]*)\]", result)
            nbytes = sum(_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d])) for t, dims in shapes)
            count += iterations.get(name, 1)
            size += iterations.get(name, 1) * nbytes
    return count, size


def _data_parallel(rec: Recorder, vocab: int, seq: int, embed: int, per_device: int) -> None:
    devices = jax.device_count()
    Batch, Pos, Embed, Vocab = hax.make_axes(batch=per_device * devices, position=seq, embed=embed, vocab=vocab)
    mesh = partitioning.make_mesh({"data": devices})
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    shapes: tuple[tuple[tuple[hax.Axis, ...], Any, dict[str, str]], ...] = (
        ((Batch, Pos, Embed), dtype, {"batch": "data"}),
        ((Embed, Vocab), dtype, {}),
        ((Batch, Pos), jnp.int32, {"batch": "data"}),
    )
    args = [
        jax.ShapeDtypeStruct(
            tuple(ax.size for ax in axes), dt, sharding=partitioning.sharding_for_axis(axes, mapping, mesh)
        )
        for axes, dt, mapping in shapes
    ]
    extra = {"vocab": vocab, "seq_len": seq, "embed": embed, "batch": Batch.size, "devices": devices,
             "dtype": jnp.dtype(dtype).name, "device": jax.devices()[0].device_kind}  # fmt: skip
    for label, groups in (("one_group", 1), ("default", None)):

        def fused(h: jax.Array, w: jax.Array, t: jax.Array, groups: int | None = groups) -> jax.Array:
            named = (hax.named(h, (Batch, Pos, Embed)), hax.named(w, (Embed, Vocab)), hax.named(t, (Batch, Pos)))
            return fused_cross_entropy_loss(*named, groups=groups).scalar()

        with jax.set_mesh(mesh), partitioning.axis_mapping({"batch": "data"}):
            hlo = jax.jit(jax.value_and_grad(fused, argnums=(0, 1))).lower(*args).compile().as_text()
        count, size = _all_reduces_per_step(hlo or "")
        rec.record(f"loss/fused/data_parallel/{label}", "all_reduces_per_step", float(count), "count", **extra)
        rec.record(f"loss/fused/data_parallel/{label}", "all_reduce_bytes_per_step", float(size), "bytes", **extra)


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
