"""LoRA fine-tuning: ``python -m ponente.trainer.main.lora_lm --config_path lora_llama2`` (``ponente-lora-lm``).

The Hugging Face checkpoint ``initialize_from_hf`` (a local folder, or a hub id fetched unless offline) gets
low-rank adapters on the linear layers that ``lora.target_modules`` selects (default: every linear layer of
attention and MLP); only the adapters train, so the optimizer holds state for them alone. The configuration
is a :class:`LoraLmConfig`, with Levanter's ``lora_lm`` keys, so Levanter's ``lora_llama2.yaml`` runs as it is
apart from its paths. A run:

1. reads the model config and weights of ``initialize_from_hf`` and adds the adapters (``lora``);
2. opens (or builds) the caches of ``data`` (text, or instruction/chat data with ``data.format``) and packs
   rows of ``max_train_length`` tokens (at most the model's ``seq_len``);
3. trains the adapters with every trainer feature (mixed precision, FSDP/TP, checkpoints, deterministic resume);
4. writes the adapters as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``, loadable by
   ``peft.PeftModel.from_pretrained``) to ``peft_save_path`` and the model with the adapters merged in as a
   Hugging Face checkpoint to ``merged_hf_save_path``: at the end, and to ``<path>/step-N`` every
   ``hf_save_steps`` steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ponente.models.lora import LoraConfig
from ponente.trainer import run
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig
from ponente.trainer.eval_harness import EvalHarnessConfig
from ponente.trainer.optim import AdamConfig, OptimizerConfig
from ponente.trainer.tasks.lora import LoraTask
from ponente.trainer.trainer import TrainerConfig

__all__ = ["LoraLmConfig", "main", "train"]


@dataclasses.dataclass(frozen=True)
class LoraLmConfig:
    """Everything a LoRA fine-tuning run reads (Levanter's ``LoraLmConfig`` keys).

    Attributes:
        initialize_from_hf: the Hugging Face checkpoint to adapt: a local folder or a hub id (``org/name`` or
            ``org/name@revision``, read from the local hub cache first) (required).
        allow_pickle: let ``initialize_from_hf`` load pickle weights (``pytorch_model*.bin``, read by torch with
            ``weights_only=True``) when it has no safetensors (default: refused).
        lora: the adapters: ``r``, ``alpha``, ``dropout``, ``target_modules``.
        data: the training (and validation) data and its tokenizer (a single dataset or a mixture).
        trainer: batch size, steps, mixed precision, mesh, tracker, checkpointer, evaluation cadence.
        optimizer: the optimizer of the adapters (``optimizer.type``, learning rate, schedule).
        peft_save_path: write the adapters there as a PEFT adapter (None: not written).
        merged_hf_save_path: write the model with the adapters merged there as a Hugging Face checkpoint (None:
            not written).
        hf_save_steps: also write both every this many steps, to ``<path>/step-N`` (None: only at the end).
        max_train_length: train on rows of at most this many tokens (None: the model's ``seq_len``).
        data_seed: seed of the data order (None: ``trainer.seed``).
        viz_logprobs: write an HTML page of the log-probabilities of some validation rows during training
            (None: none; see :class:`ponente.trainer.run.VizLogprobsConfig`).
        eval_harness: lm-eval tasks scored every ``eval_harness.every`` steps (None: none; see
            :class:`ponente.trainer.eval_harness.EvalHarnessConfig`).
    """

    initialize_from_hf: str | None = None
    allow_pickle: bool = False
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    data: LMDatasetConfig | LMMixtureDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    peft_save_path: str | None = None
    merged_hf_save_path: str | None = None
    hf_save_steps: int | None = 1000
    max_train_length: int | None = None
    data_seed: int | None = None
    viz_logprobs: run.VizLogprobsConfig | None = None
    eval_harness: EvalHarnessConfig | None = None

    def __post_init__(self) -> None:
        if self.hf_save_steps is not None and self.hf_save_steps < 1:
            raise ValueError(f"hf_save_steps must be None or >= 1, got {self.hf_save_steps}")


def train(config: LoraLmConfig) -> run.TrainResult:
    """Fine-tune the adapters as configured (see the module docstring).

    Args:
        config: the resolved configuration.

    Returns:
        What the run produced (``outputs`` names the PEFT adapter and the merged export).

    Raises:
        ValueError: if ``initialize_from_hf`` is not set, there is no training data, ``lora`` does not fit the
            model (a target that matches no layer, a rank too large), or the run cannot start.
    """
    if not config.initialize_from_hf:
        raise ValueError("initialize_from_hf: the Hugging Face checkpoint (folder or hub id) to adapt is not set")
    startup = run.start_run(config.trainer)
    return run.Run(LoraTask(config), startup).train()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    return run.command_line_main(train, LoraLmConfig, argv, prog="ponente-lora-lm")


if __name__ == "__main__":
    raise SystemExit(main())
