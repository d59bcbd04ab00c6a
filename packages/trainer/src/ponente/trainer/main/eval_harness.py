"""Score a model on lm-eval tasks: ``ponente-eval-harness --hf_checkpoint <folder> --tasks [hellaswag]``.

The model is a Hugging Face folder (``hf_checkpoint``) or a Ponente training checkpoint (``checkpoint_path``: a
``step-N`` folder or a run directory; its saved configuration gives the architecture and tokenizer). Tasks are
lm-eval's by name, or local task YAML files under ``include_path``. The results (lm-eval's dictionary: scores
per task, task configs, versions; with ``log_samples`` every request and answer) are written as JSON to
``output_path`` and the scores printed. Example, a local multiple-choice task over a jsonl file::

    ponente-eval-harness --hf_checkpoint exported/ --include_path my_tasks/ --tasks '[my_task]' \\
        --limit 100 --output_path results.json

Needs the ``eval`` extra: ``pip install 'ponente-trainer[eval]'``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ponente.models import LmConfig
from ponente.trainer.eval_harness import EvalHarnessConfig, harness_metrics, run_harness, task_manager, write_results
from ponente.trainer.run import parse_command_line, run_cli

__all__ = ["EvalHarnessRunConfig", "eval_harness", "main"]


@dataclasses.dataclass(frozen=True)
class EvalHarnessRunConfig(EvalHarnessConfig):
    """Configuration of ``ponente-eval-harness``: :class:`EvalHarnessConfig`'s keys (``every`` unused), plus these.

    Attributes:
        hf_checkpoint: a Hugging Face model folder (or hub id).
        checkpoint_path: a Ponente training checkpoint or run directory (instead of ``hf_checkpoint``).
        model: the architecture of ``checkpoint_path`` (None: from the checkpoint's saved configuration).
        tokenizer: a ``tokenizer.json`` file or a folder holding one (None: the model folder's, or the checkpoint's
            ``data.tokenizer``).
        vocab_size: the vocabulary size of ``checkpoint_path`` (None: from its configuration or tokenizer).
        output_path: where to write the results as JSON.
        log_samples: also write every request and the model's answer.
    """

    hf_checkpoint: str | None = None
    checkpoint_path: str | None = None
    model: LmConfig | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    output_path: str = "lm_eval_results.json"
    log_samples: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.checkpoint_path is None) == (self.hf_checkpoint is None):
            raise ValueError("checkpoint_path / hf_checkpoint: set exactly one of them")


def _tokenizer_folder(config: EvalHarnessRunConfig) -> str | None:
    """The folder whose ``tokenizer_config.json`` names the special tokens (None: none known)."""
    if config.tokenizer is not None:
        path = Path(config.tokenizer)
        return str(path if path.is_dir() else path.parent)
    return config.hf_checkpoint


def eval_harness(config: EvalHarnessRunConfig) -> dict[str, Any]:
    """Load the model, run the tasks, write the results; returns lm-eval's results dictionary.

    Raises:
        ImportError: if ``lm_eval`` is not installed.
        ValueError: if a task is unknown (checked before the model loads, naming ``--tasks``), or the model comes
            without a tokenizer (pass ``tokenizer``).
    """
    from ponente.trainer.eval_harness.adapter import PonenteLM
    from ponente.trainer.inference import load_model

    manager = task_manager(config.include_path, list(config.tasks), key="--tasks")
    path = config.hf_checkpoint if config.hf_checkpoint is not None else config.checkpoint_path
    assert path is not None  # checked in __post_init__
    model, tokenizer = load_model(
        path, vocab_size=config.vocab_size, model_config=config.model, tokenizer=config.tokenizer
    )
    if tokenizer is None:
        raise ValueError(f"tokenizer: {path} has no tokenizer; pass a tokenizer.json file or folder")
    lm = PonenteLM(
        model,
        tokenizer,
        batch_size=config.batch_size,
        max_length=config.max_length,
        max_gen_toks=config.max_gen_toks,
        tokenizer_folder=_tokenizer_folder(config),
    )
    results = run_harness(lm, config, log_samples=config.log_samples, manager=manager)
    write_results(results, os.path.abspath(config.output_path))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, evaluate, print the scores; returns the exit code.

    Errors print one line ``error: <message>`` on stderr (exit status 2 for a configuration error, 1 for another;
    ``--debug`` adds the traceback).
    """

    def run_main(args: list[str]) -> int:
        config = parse_command_line(EvalHarnessRunConfig, args, prog="ponente-eval-harness")
        results = eval_harness(config)
        for name, value in sorted(harness_metrics(results).items()):
            print(f"{name}: {value:.6g}")
        print(f"results written to {os.path.abspath(config.output_path)}")
        return 0

    return run_cli(run_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
