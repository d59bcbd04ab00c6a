"""Evaluate a language model on a dataset: ``python -m ponente.trainer.main.eval_lm``.

Reports, per validation set (or the training split with ``split: train``), the mean next-token loss
(nats), perplexity and bits per byte. The model comes from a training checkpoint (``checkpoint_path``, a step
folder or a run folder) or a Hugging Face folder (``hf_checkpoint``). Example::

    ponente-eval-lm --checkpoint_path ponente_hello/checkpoints/<run id>

With a checkpoint, the model and data (tokenizer, validation sets) are those the training run recorded in
it; ``--config_path`` (e.g. the run's own training file: its ``trainer``, ``optimizer``, ... sections are
ignored) and ``--model.*`` / ``--data.*`` options replace them.

Bits per byte divide the summed loss (converted to bits) by the number of UTF-8 bytes of the predicted
tokens, which makes models with different tokenizers comparable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from ponente.models import Gpt2Config, LmConfig
from ponente.trainer.data import (
    LMDatasetConfig,
    LMMixtureDatasetConfig,
    data_tokenizer,
    train_set,
    validation_sets,
)
from ponente.trainer.main.export_lm_to_hf import training_config_keys
from ponente.trainer.run import check_run_inputs, find_checkpoint, load_model_of, parse_run_command_line, run_cli
from ponente.trainer.tasks.lm_eval import EvalResult, evaluate_lm

__all__ = ["EvalLmConfig", "eval_lm", "main"]


@dataclasses.dataclass(frozen=True)
class EvalLmConfig:
    """Configuration of ``eval_lm``.

    Attributes:
        data: the dataset (its validation split by default) and tokenizer (on the command line: those the run
            of ``checkpoint_path`` recorded).
        model: the model config of ``checkpoint_path`` (on the command line: the one the run recorded; ignored
            with ``hf_checkpoint``).
        checkpoint_path: a training checkpoint or run directory.
        hf_checkpoint: a Hugging Face model folder (instead of ``checkpoint_path``).
        split: which split to evaluate.
        batch_size: rows per batch.
        max_batches: evaluate at most this many batches per dataset (None: all).
    """

    data: LMDatasetConfig | LMMixtureDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)
    model: LmConfig = dataclasses.field(default_factory=Gpt2Config)
    checkpoint_path: str | None = None
    hf_checkpoint: str | None = None
    split: Literal["validation", "train"] = "validation"
    batch_size: int = 8
    max_batches: int | None = None

    def __post_init__(self) -> None:
        if (self.checkpoint_path is None) == (self.hf_checkpoint is None):
            raise ValueError("checkpoint_path / hf_checkpoint: set exactly one of them")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")


def eval_lm(config: EvalLmConfig) -> dict[str, EvalResult]:
    """Evaluate as configured (:func:`~ponente.trainer.tasks.lm_eval.evaluate_lm`); returns the results by dataset.

    Raises:
        FileNotFoundError: if there is no committed checkpoint at ``checkpoint_path`` (checked first).
        ConfigError: if ``model`` does not describe the checkpoint (names the parameter and both shapes).
    """
    if config.checkpoint_path is not None:
        find_checkpoint(config.checkpoint_path)
    model = load_model_of(config)
    seq_len = model.config.seq_len
    if config.split == "validation":
        datasets = validation_sets(config.data, seq_len)
        if not datasets:
            raise ValueError("data.validation_urls: no validation data to evaluate (or pass --split train)")
    else:
        datasets = {"train": train_set(config.data, seq_len, seed=0)}
    return evaluate_lm(
        model, datasets, data_tokenizer(config.data), batch_size=config.batch_size, max_batches=config.max_batches
    )


def _main(argv: Sequence[str]) -> int:
    config = parse_run_command_line(EvalLmConfig, argv, prog="ponente-eval-lm", training_keys=training_config_keys())
    check_run_inputs(config, splits=(config.split,))
    for name, r in eval_lm(config).items():
        print(
            f"{name}: loss {r.loss:.4f}  perplexity {r.perplexity:.2f}  bits/byte {r.bits_per_byte:.4f}  "
            f"({r.tokens} tokens, {r.bytes} bytes)"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, evaluate and print the results; returns the exit code (1 and one line on stderr
    for an error, 2 for a configuration error)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
