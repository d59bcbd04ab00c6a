"""Train a language model: ``python -m ponente.trainer.main.train_lm --config_path gpt2_nano`` (``ponente-train``).

The configuration is a :class:`TrainLmConfig` (``data``, ``model``, ``trainer``, ``optimizer`` sections with
Levanter's key names) read from YAML files and dotted overrides; ``--help`` lists every field. A run:

1. opens (or builds, in the background) the token caches of ``data`` and packs rows of ``model.seq_len``;
2. builds the model and optimizer state (or resumes from the latest committed checkpoint of the run);
3. trains for ``trainer.num_train_steps`` steps, logging to the trackers, evaluating every
   ``trainer.steps_per_eval`` steps and checkpointing per ``trainer.checkpointer``;
4. saves a final checkpoint (and a Hugging Face export if ``hf_save_path`` is set), samples a short
   text when ``sample.num_tokens > 0``, and prints where everything went.

With a ``viz_logprobs:`` section, it also draws the first validation rows as an HTML page of token
log-probabilities at each evaluation (``ponente.trainer.run.VizLogprobsConfig``). With an ``eval_harness:``
section, it scores lm-eval tasks every ``eval_harness.every`` steps and logs ``lm_eval/<task>/<metric>``
(``ponente.trainer.eval_harness.EvalHarnessConfig``; needs ``pip install 'ponente-trainer[eval]'``).

What is trained is a :class:`~ponente.trainer.tasks.lm.LmTask`; the run (provenance, restore, signals, export, ...)
is :class:`ponente.trainer.run.Run`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from ponente.models import Gpt2Config, LmConfig
from ponente.trainer import run
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig
from ponente.trainer.eval_harness import EvalHarnessConfig
from ponente.trainer.optim import AdamConfig, OptimizerConfig
from ponente.trainer.run import PREEMPTED_EXIT_CODE, Run, SampleConfig, TrainResult, config_differences
from ponente.trainer.tasks.lm import LmTask
from ponente.trainer.trainer import TrainerConfig

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "SampleConfig",
    "TrainLmConfig",
    "TrainResult",
    "config_differences",
    "main",
    "train",
]


@dataclasses.dataclass(frozen=True)
class TrainLmConfig:
    """Everything a language-model training run reads (Levanter's ``TrainLmConfig`` keys).

    Attributes:
        data: where the text is, its tokenizer and cache (a single dataset or a mixture).
        model: the model config; ``model.type`` picks the architecture (``gpt2``, ``llama``, ...).
        trainer: batch size, steps, mixed precision, mesh, tracker, checkpointer, evaluation cadence.
        optimizer: ``optimizer.type`` (``adam``, ``lion``, ``sophia-h``, ``muon``), learning rate, schedule.
        initialize_from_hf: a Hugging Face checkpoint folder, or hub id (``org/name`` or ``org/name@revision``, read
            from the local hub cache first), whose weights start the run.
        allow_pickle: let ``initialize_from_hf`` load pickle weights (``pytorch_model*.bin``, read by torch with
            ``weights_only=True``) when it has no safetensors (default: refused).
        use_hf_model_config: with ``initialize_from_hf``, take the model config from the checkpoint.
        z_loss_weight: weight of the z-loss ``logsumexp(logits)**2`` (0: none).
        cross_entropy_block_size: how the loss avoids materializing the full logits (None: the plain loss;
            ``auto``: from ``ponente.models.loss.FUSED_LOSS_MIN_VOCAB`` (65536) vocabulary entries on, where the model
            allows it, the fused loss, chunks of positions with the gradient computed in the forward pass; a
            number: the vocabulary-blocked loss with blocks of that many entries, least memory, one more product).
        data_seed: seed of the data order (None: ``trainer.seed``).
        hf_save_path: if set, export the final model as a Hugging Face folder there.
        hf_save_steps: also export every this many steps (needs ``hf_save_path``).
        sample: the text sampled at the end of the run.
        viz_logprobs: write an HTML page of the log-probabilities of some validation rows during training
            (None: none; see :class:`ponente.trainer.run.VizLogprobsConfig`).
        eval_harness: lm-eval tasks scored every ``eval_harness.every`` steps (None: none; see
            :class:`ponente.trainer.eval_harness.EvalHarnessConfig`).
    """

    data: LMDatasetConfig | LMMixtureDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)
    model: LmConfig = dataclasses.field(default_factory=Gpt2Config)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    initialize_from_hf: str | None = None
    allow_pickle: bool = False
    use_hf_model_config: bool = False
    z_loss_weight: float = 0.0
    cross_entropy_block_size: int | Literal["auto"] | None = "auto"
    data_seed: int | None = None
    hf_save_path: str | None = None
    hf_save_steps: int | None = None
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
    viz_logprobs: run.VizLogprobsConfig | None = None
    eval_harness: EvalHarnessConfig | None = None

    def __post_init__(self) -> None:
        if self.hf_save_steps is not None and self.hf_save_path is None:
            raise ValueError("hf_save_steps is set but hf_save_path is not; set hf_save_path too")
        if self.use_hf_model_config and self.initialize_from_hf is None:
            raise ValueError("use_hf_model_config needs initialize_from_hf")


def train(config: TrainLmConfig) -> TrainResult:
    """Run training as configured (see the module docstring).

    Args:
        config: the resolved configuration.

    Returns:
        What the run produced.

    Raises:
        ValueError: for a configuration that cannot run (no training data, bad sizes, a resume that
            changes a field that must stay fixed, ...).
        FileNotFoundError: if ``trainer.load_checkpoint`` is true and there is no checkpoint.
    """
    startup = run.start_run(config.trainer)
    return Run(LmTask(config, use_hf_model_config=config.use_hf_model_config), startup).train()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    return run.command_line_main(train, TrainLmConfig, argv, prog="ponente-train")


if __name__ == "__main__":
    raise SystemExit(main())
