"""Reinforcement learning (``ponente-rl``): rollout tokens/s and the share of a step spent rolling out vs training.

A small Llama (hidden 128, 2 layers, 4 heads, the shipped 4096-token Shakespeare tokenizer, random weights) is saved
as a Hugging Face folder, then ``ponente-rl`` runs GRPO on the shipped arithmetic prompts
(``tiny_arithmetic.jsonl``) with the exact-match reward through its entry point (``train_rl.main``): 8 prompts x
``group_size`` 8 completions of up to ``PONENTE_BENCH_RL_TOKENS`` (default 16) new tokens per step, on one host, the
engine and the training step on the same devices. From the run's ``train/rl/*`` metrics, over the steps after the
first (which compiles): the median ``rollout_tokens_per_second``, ``rollout_seconds`` and ``train_seconds``, and the
rollout share ``rollout / (rollout + train)``. Knob: ``PONENTE_BENCH_STEPS`` (steps, default 12).
"""

from __future__ import annotations

import importlib.resources
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.harness import Recorder


def _model(where: Path) -> Path:
    import jax

    import ponente.namedtensor as hax
    from ponente.datacache import load_tokenizer
    from ponente.models import LlamaConfig
    from ponente.models.hf import save_pretrained

    tokenizer_path = str(importlib.resources.files("ponente.trainer.assets") / "shakespeare_tokenizer.json")
    tokenizer = load_tokenizer(tokenizer_path)
    config = LlamaConfig(seq_len=128, hidden_dim=128, intermediate_dim=256, num_layers=2, num_heads=4, num_kv_heads=4)
    model = config.build(hax.Axis("vocab", tokenizer.get_vocab_size()), key=jax.random.PRNGKey(0))
    save_pretrained(model, where)
    (where / "tokenizer.json").write_bytes(Path(tokenizer_path).read_bytes())
    return where


def run(rec: Recorder) -> None:
    from ponente.trainer.main import train_rl

    steps = int(os.environ.get("PONENTE_BENCH_STEPS", "12"))
    tokens = int(os.environ.get("PONENTE_BENCH_RL_TOKENS", "16"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = _model(root / "model")
        metrics = root / "metrics.jsonl"
        argv = [
            "--config_path=rl_arithmetic",
            f"--initialize_from_hf={model}",
            f"--rl.max_new_tokens={tokens}",
            "--rl.stop_tokens=[<|endoftext|>]",
            f"--trainer.num_train_steps={steps}",
            "--trainer.progress_bar=false",
            f"--trainer.run_dir={root / 'runs'}",
            f"--trainer.tracker={{type: json, path: {metrics}}}",
            f"--trainer.checkpointer.base_path={root / 'ckpt'}",
            "--hf_save_path=null",
        ]
        if train_rl.main(argv) != 0:
            raise RuntimeError("ponente-rl failed")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    by_step: dict[int, dict[str, float]] = {}
    for r in records:
        if "step" in r:
            by_step.setdefault(r["step"], {}).update(r)
    later = [r for s, r in sorted(by_step.items()) if s > 1 and "train/rl/rollout_seconds" in r]
    rollout = statistics.median(r["train/rl/rollout_seconds"] for r in later)
    train = statistics.median(r["train/rl/train_seconds"] for r in later)
    extra = {"steps": len(later), "completions_per_step": 64, "max_new_tokens": tokens}
    rec.record(
        "grpo",
        "rollout_tokens_per_second",
        statistics.median(r["train/rl/rollout_tokens_per_second"] for r in later),
        "tokens/s",
        **extra,
    )
    rec.record("grpo", "rollout_seconds", rollout, "s", **extra)
    rec.record("grpo", "train_seconds", train, "s", **extra)
    rec.record("grpo", "rollout_share", rollout / (rollout + train), "fraction", **extra)
    rec.record(
        "grpo",
        "completion_length",
        statistics.median(r["train/rl/completion_length"] for r in later),
        "tokens",
        **extra,
    )
