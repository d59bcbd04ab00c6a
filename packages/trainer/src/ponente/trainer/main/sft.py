"""Supervised fine-tuning: ``python -m ponente.trainer.main.sft --config_path sft_alpaca`` (``ponente-sft``).

Full-parameter fine-tuning of a trained model on instruction (``data.format: supervised``) or chat
(``data.format: chat``) data, where only the response (assistant) tokens are trained on (``data.mask_inputs``)
and short examples are packed into rows (``data.pack``). The configuration is a :class:`SftConfig`: the keys of
``TrainLmConfig`` plus ``max_train_length``. A run:

1. reads the model config from ``initialize_from_hf`` (a Hugging Face folder, or a hub id fetched unless
   offline; ``use_hf_model_config: false`` keeps ``model``), or starts from the model of a Ponente checkpoint
   (``trainer.initialize_from``, with ``model`` describing it);
2. opens (or builds) the example caches of ``data`` and packs rows of ``max_train_length`` tokens (at most the
   model's ``seq_len``);
3. trains with every trainer feature (mixed precision, FSDP/TP by axis mapping, checkpoints, deterministic
   resume, trackers), exporting a Hugging Face checkpoint to ``hf_save_path`` at the end and to
   ``hf_save_path/step-N`` every ``hf_save_steps`` steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ponente.trainer import run
from ponente.trainer.main.train_lm import TrainLmConfig
from ponente.trainer.tasks.lm import LmTask

__all__ = ["SftConfig", "main", "train"]


@dataclasses.dataclass(frozen=True)
class SftConfig(TrainLmConfig):
    """Everything a supervised fine-tuning run reads: ``TrainLmConfig``'s keys, plus those below.

    Attributes:
        use_hf_model_config: with ``initialize_from_hf``, take the model config from the checkpoint (None: yes
            when ``initialize_from_hf`` is set).
        max_train_length: train on rows of at most this many tokens (None: the model's ``seq_len``).
    """

    use_hf_model_config: bool | None = None  # type: ignore[assignment]
    max_train_length: int | None = None


def train(config: SftConfig) -> run.TrainResult:
    """Fine-tune as configured (see the module docstring).

    Args:
        config: the resolved configuration.

    Returns:
        What the run produced.

    Raises:
        ValueError: if neither ``initialize_from_hf`` nor ``trainer.initialize_from`` says where the weights
            come from, there is no training data, or the run cannot start (see ``train_lm.train``).
    """
    if config.initialize_from_hf is None and config.trainer.initialize_from is None:
        raise ValueError(
            "initialize_from_hf: fine-tuning starts from a trained model; set initialize_from_hf (a Hugging Face "
            "folder or hub id) or trainer.initialize_from (a Ponente checkpoint)"
        )
    startup = run.start_run(config.trainer)
    task = LmTask(
        config,
        use_hf_model_config=config.use_hf_model_config is not False,
        max_train_length=config.max_train_length,
        hint="--config_path sft_alpaca",
    )
    return run.Run(task, startup).train()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    return run.command_line_main(train, SftConfig, argv, prog="ponente-sft")


if __name__ == "__main__":
    raise SystemExit(main())
