"""What the harness evaluates: :class:`EvalHarnessConfig` (no ``lm_eval`` import, so configs load without it)."""

from __future__ import annotations

import dataclasses

__all__ = ["MISSING_EXTRA", "EvalHarnessConfig"]

MISSING_EXTRA = "lm_eval is not installed: pip install 'ponente-trainer[eval]'"
"""The message of the error raised when the ``eval`` extra is missing."""


@dataclasses.dataclass(frozen=True)
class EvalHarnessConfig:
    """Tasks of EleutherAI's ``lm-eval`` harness, run standalone or every ``every`` training steps.

    Attributes:
        tasks: task (or group) names, e.g. ``[hellaswag, arc_easy]`` or those of YAML files under ``include_path``.
        every: during training, evaluate every this many steps (and once at the end).
        limit: evaluate at most this many documents per task (None: all).
        include_path: a folder of task YAML files (local tasks); searched before lm-eval's own tasks.
        num_fewshot: few-shot examples per prompt (None: each task's default).
        batch_size: sequences scored per forward pass.
        max_length: the longest context in tokens (None: the model's ``seq_len``).
        max_gen_toks: the most tokens ``generate_until`` produces when a task does not say.
        bootstrap_iters: bootstrap resamples of the standard errors (0: none, the fastest).
        seed: the seed of lm-eval's sampling of few-shot examples and documents.
    """

    tasks: list[str] = dataclasses.field(default_factory=list)
    every: int = 1000
    limit: int | None = None
    include_path: str | None = None
    num_fewshot: int | None = None
    batch_size: int = 8
    max_length: int | None = None
    max_gen_toks: int = 256
    bootstrap_iters: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("eval_harness.tasks: name at least one task")
        if self.every < 1:
            raise ValueError(f"eval_harness.every: must be >= 1, got {self.every}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"eval_harness.limit: must be None or >= 1, got {self.limit}")
        if self.batch_size < 1:
            raise ValueError(f"eval_harness.batch_size: must be >= 1, got {self.batch_size}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"eval_harness.max_length: must be None or >= 2, got {self.max_length}")
        if self.max_gen_toks < 1:
            raise ValueError(f"eval_harness.max_gen_toks: must be >= 1, got {self.max_gen_toks}")
