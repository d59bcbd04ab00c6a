"""Preference tuning: ``python -m ponente.trainer.main.train_dpo --config_path dpo_tiny`` (``ponente-dpo``).

DPO (and IPO, hinge, SimPO) of a trained model on chosen/rejected pairs (``data.format: preference_chat``), with
Levanter's ``TrainDpoConfig`` keys; with a ``lora:`` section only low-rank adapters train (LoRA-DPO) and the
reference is the model with its adapters switched off. A run:

1. reads the model of ``initialize_from_hf`` (or the Ponente checkpoint ``initialize_from_checkpoint_path``) and
   the frozen reference (``reference_model_path``, default: the initial model);
2. opens (or builds) the pair caches of ``data``, rows of ``train_seq_len`` tokens (at most the model's
   ``seq_len``), holding out ``validation_split_fraction`` of the pairs when ``data`` has no validation set;
3. trains with every trainer feature (mixed precision, FSDP/TP, checkpoints, deterministic resume), logging
   ``train/dpo_loss``, ``train/dpo_accuracy``, ``train/dpo_margin_policy``, ``train/dpo_margin_ref``,
   ``train/dpo_chosen_reward``, ``train/dpo_rejected_reward`` (and the same under ``eval/<name>/``);
4. exports the policy to ``hf_save_path`` (with LoRA: the PEFT adapter to ``peft_save_path`` and the merged
   model to ``merged_hf_save_path``), at the end and every ``hf_save_steps`` steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ponente.models import LlamaConfig, LmConfig
from ponente.models.lora import LoraConfig
from ponente.models.loss import PREFERENCE_LOSS_TYPES, SMOOTHED_LOSS_TYPES
from ponente.trainer import run
from ponente.trainer.data import LMDatasetConfig
from ponente.trainer.optim import AdamConfig, OptimizerConfig
from ponente.trainer.tasks.dpo import DpoTask, with_epochs
from ponente.trainer.trainer import TrainerConfig

__all__ = ["TrainDpoConfig", "main", "train", "with_epochs"]


@dataclasses.dataclass(frozen=True)
class TrainDpoConfig:
    """Everything a preference-tuning run reads (Levanter's ``TrainDpoConfig`` keys, plus ``loss_type``, ...).

    Attributes:
        data: the pairs (``format: preference_chat``) and their tokenizer.
        model: the model config, when it is not read from ``initialize_from_hf``.
        trainer: batch size (pairs per step), steps, mixed precision, mesh, tracker, checkpointer, evaluation.
        optimizer: the optimizer (``optimizer.type``, learning rate, schedule).
        initialize_from_hf: the Hugging Face checkpoint (folder or hub id) the policy starts from.
        allow_pickle: let Hugging Face folders load pickle weights when they have no safetensors.
        use_hf_model_config: take the model config from ``initialize_from_hf`` (false: ``model``).
        initialize_from_checkpoint_path: start from the model of a Ponente checkpoint instead (``model``
            describes it).
        train_seq_len: tokens per sequence (None: the model's ``seq_len``); longer pairs are truncated per
            ``data.format.truncation``.
        reference_model_path: the frozen reference model (None: the initial model).
        reference_is_hf: ``reference_model_path`` is a Hugging Face folder (false: a Ponente checkpoint).
        beta: the temperature of the implicit reward (> 0).
        loss_type: ``sigmoid`` (DPO), ``ipo``, ``hinge`` or ``simpo`` (reference-free, length-normalised).
        label_smoothing: the probability a preference label is flipped (conservative DPO; ``sigmoid``/``simpo``).
        simpo_gamma: SimPO's target reward margin.
        precompute_reference: compute the reference log-probs of every pair once before training (the reference
            is then not kept in memory and a step runs the policy alone).
        validation_split_fraction: hold out this fraction of the training pairs for evaluation when ``data`` has
            no validation set (None or 0: none).
        lora: train low-rank adapters only (``ponente-lora-lm``'s keys; None: every parameter).
        peft_save_path: with ``lora``, write the adapters there as a PEFT adapter.
        merged_hf_save_path: with ``lora``, write the model with the adapters merged there.
        hf_save_path: write the policy there as a Hugging Face folder (None: not written).
        hf_save_steps: also export every this many steps, to ``<path>/step-N`` (None: only at the end).
        hf_save_dtype: the dtype of the exported weights (e.g. ``bfloat16``; None: the parameter dtype).
        data_seed: seed of the data order (None: ``trainer.seed``).
        epoch: train for this many passes over the training pairs, setting ``trainer.num_train_steps`` (0: the
            configured steps, cycling through the pairs).
    """

    data: LMDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)
    model: LmConfig = dataclasses.field(default_factory=LlamaConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    initialize_from_hf: str | None = None
    allow_pickle: bool = False
    use_hf_model_config: bool = True
    initialize_from_checkpoint_path: str | None = None
    train_seq_len: int | None = None
    reference_model_path: str | None = None
    reference_is_hf: bool = True
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    precompute_reference: bool = False
    validation_split_fraction: float | None = 0.1
    lora: LoraConfig | None = None
    peft_save_path: str | None = None
    merged_hf_save_path: str | None = None
    hf_save_path: str | None = None
    hf_save_steps: int | None = None
    hf_save_dtype: str | None = None
    data_seed: int | None = None
    epoch: int = 0

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"beta: the reward temperature must be > 0, got {self.beta}")
        if self.loss_type not in PREFERENCE_LOSS_TYPES:
            raise ValueError(f"loss_type: expected one of {', '.join(PREFERENCE_LOSS_TYPES)}, got {self.loss_type!r}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing: expected a value in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in SMOOTHED_LOSS_TYPES:
            raise ValueError(f"label_smoothing: applies to loss_type sigmoid or simpo, not {self.loss_type}")
        fraction = self.validation_split_fraction
        if fraction is not None and not 0.0 <= fraction < 1.0:
            raise ValueError(f"validation_split_fraction: expected a value in [0, 1), got {fraction}")
        if self.train_seq_len is not None and self.train_seq_len < 2:
            raise ValueError(f"train_seq_len: expected None or >= 2, got {self.train_seq_len}")
        if self.epoch < 0:
            raise ValueError(f"epoch: expected 0 (the configured steps) or a number of passes, got {self.epoch}")
        if self.hf_save_steps is not None and self.hf_save_steps < 1:
            raise ValueError(f"hf_save_steps: expected None or >= 1, got {self.hf_save_steps}")
        if self.lora is None and (self.peft_save_path or self.merged_hf_save_path):
            key = "peft_save_path" if self.peft_save_path else "merged_hf_save_path"
            raise ValueError(f"{key}: needs a lora: section (LoRA-DPO)")
        if self.initialize_from_hf and self.initialize_from_checkpoint_path:
            raise ValueError("initialize_from_hf / initialize_from_checkpoint_path: set one of them, not both")


def train(config: TrainDpoConfig) -> run.TrainResult:
    """Preference-tune as configured (see the module docstring).

    Raises:
        ValueError: naming the key, if nothing says where the model starts, the data is not preference pairs,
            the reference is not the policy's architecture, or the run cannot start.
    """
    if not (config.initialize_from_hf or config.initialize_from_checkpoint_path):
        raise ValueError(
            "initialize_from_hf: preference tuning starts from a trained model; set initialize_from_hf (a Hugging "
            "Face folder or hub id) or initialize_from_checkpoint_path (a Ponente checkpoint)"
        )
    startup = run.start_run(config.trainer)
    if config.epoch:
        config = with_epochs(config)
    return run.Run(DpoTask(config), startup).train()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    return run.command_line_main(train, TrainDpoConfig, argv, prog="ponente-dpo")


if __name__ == "__main__":
    raise SystemExit(main())
