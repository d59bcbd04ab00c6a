"""Supervised fine-tuning throughput with and without packing: non-padding tokens per second of a tiny Llama.

The shipped instruction set (``ponente.trainer.assets/tiny_instructions.jsonl``, 300 short examples) is rendered
with an Alpaca-style prompt template, tokenized with the shipped Shakespeare tokenizer and cached by
``ponente.datacache.SupervisedProcessor`` (prompt tokens masked), then read through
``ponente.datacache.PackedExampleDataset`` twice: ``pack=True`` (several examples per row, attention kept apart
by segment ids, positions restarting) and ``pack=False`` (one example per row, padded). Each step reads the next
``BATCH`` rows in order (wrapping around), makes the batch (``ponente.trainer.tasks.lm.lm_batch``) and runs the
Trainer's step on a small Llama (hidden 128, 2 layers, vocab 4096) with AdamW; the two modes' steps are timed in
interleaved rounds (``benchmarks.harness.interleaved_times``), reading included.

Recorded per mode: tokens/s counting only non-padding tokens (tokens of examples), trained tokens/s (response
tokens, the ones the loss uses), the padding fraction of the rows, and the number of rows per epoch; and the
packed/padded ratio of tokens/s (no target: it is about the mean number of examples per packed row, since a
step's cost hardly depends on how many of its tokens are padding).
Knobs: ``PONENTE_BENCH_SFT_SEQ`` (row length, default 256), ``PONENTE_BENCH_SFT_BATCH`` (rows per step, default
8), ``PONENTE_BENCH_STEPS`` (timed rounds, default 30).
"""

from __future__ import annotations

import importlib.resources
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

import ponente.namedtensor as hax
from benchmarks.harness import interleaved_times, round_ratio
from ponente.datacache import PackedExampleDataset, SupervisedProcessor, build_cache
from ponente.datacache.packing import PAD_SEGMENT_ID
from ponente.models import LlamaConfig
from ponente.trainer.tasks.lm import lm_batch, lm_loss_fn
from ponente.trainer.trainer import Trainer, TrainerConfig

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

PROMPT = (
    "{% if input %}### Instruction:\n{{ instruction }}\n\n### Input:\n{{ input }}\n\n### Response:\n"
    "{% else %}### Instruction:\n{{ instruction }}\n\n### Response:\n{% endif %}"
)
"""Alpaca-style prompt: the instruction, the input when there is one, then the response header."""
VOCAB = 4096
EOS = "<|endoftext|>"


def _asset(name: str) -> Path:
    return Path(str(importlib.resources.files("ponente.trainer.assets") / name))


def _step_fn(
    trainer: Trainer, state: list[Any], ds: Any, batch: int, tokens: list[int], trained: list[int]
) -> Callable[[], None]:
    """One training step on the next ``batch`` rows of ``ds``; appends the step's real and trained token counts."""
    cursor = [0]
    n = len(ds)

    def step() -> None:
        indices = [(cursor[0] + k) % n for k in range(batch)]
        cursor[0] = (cursor[0] + batch) % n
        rows = ds.get_batch(indices)
        arrays = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
        named = lm_batch(arrays)
        state[0], metrics = trainer.train_step(state[0], trainer.shard_batch(named))
        jax.block_until_ready(metrics["loss"])
        tokens.append(int((arrays["segment_ids"] != PAD_SEGMENT_ID).sum()))
        trained.append(int(np.asarray(named["loss_mask"].array).sum()))  # the positions the loss averages over

    return step


def run(rec: Recorder) -> None:
    """Time SFT steps on packed and on padded rows of the shipped instruction set; record tokens/s of each."""
    seq_len = int(os.environ.get("PONENTE_BENCH_SFT_SEQ", "256"))
    batch = int(os.environ.get("PONENTE_BENCH_SFT_BATCH", "8"))
    cfg = LlamaConfig(seq_len=seq_len, hidden_dim=128, intermediate_dim=352, num_layers=2, num_heads=4, num_kv_heads=2)
    trainer = Trainer(
        TrainerConfig(train_batch_size=batch, num_train_steps=10**6, compilation_cache_dir=None, progress_bar=False),
        optax.adamw(1e-3, weight_decay=0.0),
        lm_loss_fn(),
    )
    processor = SupervisedProcessor(_asset("shakespeare_tokenizer.json"), prompt_template=PROMPT, eos=EOS)
    with tempfile.TemporaryDirectory() as tmp:
        cache = build_cache(
            str(_asset("tiny_instructions.jsonl")), str(Path(tmp) / "cache"), processor=processor, progress=False
        )
        datasets = {mode: PackedExampleDataset(cache, seq_len, pack=mode == "packed") for mode in ("packed", "padded")}
        counts: dict[str, tuple[list[int], list[int]]] = {mode: ([], []) for mode in datasets}
        steps: dict[str, Callable[[], object]] = {}
        for mode, ds in datasets.items():
            state = [
                trainer.initial_state(lambda k: cfg.build(hax.Axis("vocab", VOCAB), key=k), key=jax.random.PRNGKey(0))
            ]
            steps[mode] = _step_fn(trainer, state, ds, batch, *counts[mode])
        times = interleaved_times(steps)
        rows = {mode: (len(ds), int(ds.truncated)) for mode, ds in datasets.items()}

    extra = {"seq_len": seq_len, "batch": batch, "hidden": cfg.hidden_dim, "layers": cfg.num_layers}
    rate = {}
    for mode in datasets:
        tokens, trained = (c[2:] for c in counts[mode])  # interleaved_times runs every step twice untimed first
        seconds = sum(times[mode])
        rate[mode] = sum(tokens) / seconds
        rec.record(mode, "step_time", statistics.median(times[mode]), "s", **extra)
        rec.record(mode, "tokens_per_second", rate[mode], "tokens/s", counted="non-padding", **extra)
        rec.record(mode, "trained_tokens_per_second", sum(trained) / seconds, "tokens/s", **extra)
        rec.record(mode, "padding_fraction", 1 - sum(tokens) / (len(tokens) * batch * seq_len), "fraction", **extra)
        rec.record(mode, "rows_per_epoch", rows[mode][0], "rows", truncated=rows[mode][1], **extra)
    rec.record("packed_vs_padded", "tokens_per_second_ratio", rate["packed"] / rate["padded"], "x", **extra)
    ratio, spread = round_ratio(times["packed"], times["padded"])
    rec.record("packed_vs_padded", "step_time_ratio", ratio, "packed/padded", **spread, **extra)
