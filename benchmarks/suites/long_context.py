"""Context parallelism: per-device compiled memory and step time of a training step at long sequence lengths.

Needs several devices: on a CPU run it with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.

A small Llama (hidden 64, 2 layers, 4 heads, 2 key/value heads, vocabulary 256, packed documents) trained by the
``Trainer`` on one sequence (batch 1) split over ``trainer.context_axis_size`` = 1, 2, 4, 8 devices (the first that
many; ``data`` is 1), so the per-device activations should fall as 1/context, with ``model.attention_context_parallel``
``allgather`` and ``ring`` (the attention backend ``auto``: blockwise on a CPU), at sequence lengths
``PONENTE_BENCH_SEQS``
(default ``4096,8192,16384``). For each: the compiled step's per-device memory from XLA's memory analysis (temporaries,
arguments, outputs) and, up to ``PONENTE_BENCH_TIME_MAX_SEQ`` positions (default 4096), the step time over
``PONENTE_BENCH_STEPS`` timed steps (default 3). ``PONENTE_BENCH_LC_MODES`` (default ``allgather,ring``) picks the
modes (context 1 is measured with ``allgather``, which is then plain attention).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

import ponente.namedtensor as hax
from ponente.models import LlamaConfig
from ponente.trainer.tasks.lm import lm_batch, lm_loss_fn
from ponente.trainer.trainer import Trainer, TrainerConfig

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

BATCH, VOCAB = 1, 256


def _rows(seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, seq)).astype(np.int32)
    starts = np.zeros((BATCH, seq), np.int32)
    starts[:, rng.integers(1, seq, 8)] = 1
    return {"input_ids": ids, "segment_ids": np.cumsum(starts, axis=1).astype(np.int32)}


def _one(rec: Recorder, seq: int, context: int, mode: str, steps: int, timed: bool) -> None:
    cfg = LlamaConfig(
        seq_len=seq,
        hidden_dim=64,
        intermediate_dim=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        attention_context_parallel=mode,
    )
    trainer = Trainer(
        TrainerConfig(
            train_batch_size=BATCH,
            num_train_steps=10**6,
            context_axis_size=context,
            compilation_cache_dir=None,
            progress_bar=False,
        ),
        optax.adamw(1e-4),
        lm_loss_fn(context=context),
        devices=jax.devices()[:context],
    )
    state = trainer.initial_state(lambda k: cfg.build(hax.Axis("vocab", VOCAB), key=k), key=jax.random.key(0))
    batch = trainer.shard_batch(lm_batch(_rows(seq)))
    start = time.perf_counter()
    compiled = trainer.compile_step(state, batch)
    compile_s = time.perf_counter() - start
    mem: Any = compiled.memory_analysis()
    temp = float(getattr(mem, "temp_size_in_bytes", 0))
    args = float(getattr(mem, "argument_size_in_bytes", 0))
    out = float(getattr(mem, "output_size_in_bytes", 0))
    extra: dict[str, Any] = {}
    if timed:
        for _ in range(2):  # compile and warm up
            state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics["loss"])
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics["loss"])
        extra["step_s"] = (time.perf_counter() - start) / steps
    rec.record(
        f"llama_seq{seq}_context{context}_{mode}",
        "temp_bytes_per_device",
        temp,
        "bytes",
        argument_bytes=args,
        output_bytes=out,
        compile_s=compile_s,
        seq_len=seq,
        context_axis_size=context,
        attention_context_parallel=mode,
        devices=context,
        platform=jax.default_backend(),
        **extra,
    )


def run(rec: Recorder) -> None:
    """Memory (and step time up to ``PONENTE_BENCH_TIME_MAX_SEQ``) per sequence length, context size and mode."""
    if jax.device_count() < 2:
        raise RuntimeError(
            "the long-context suite needs several devices; on a CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )
    seqs = [int(s) for s in os.environ.get("PONENTE_BENCH_SEQS", "4096,8192,16384").split(",")]
    max_timed = int(os.environ.get("PONENTE_BENCH_TIME_MAX_SEQ", "4096"))
    steps = int(os.environ.get("PONENTE_BENCH_STEPS", "3"))
    modes = os.environ.get("PONENTE_BENCH_LC_MODES", "allgather,ring").split(",")
    for seq in seqs:
        for context in (1, 2, 4, 8):
            if context > jax.device_count():
                continue
            for mode in [m for m in modes if context > 1 or m == "allgather"]:
                _one(rec, seq, context, mode, steps, timed=seq <= max_timed)
