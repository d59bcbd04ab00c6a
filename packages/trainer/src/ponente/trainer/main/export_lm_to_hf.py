"""Export a training checkpoint as a Hugging Face model folder: ``python -m ponente.trainer.main.export_lm_to_hf``.

Example::

    ponente-export-lm-to-hf --checkpoint_path ponente_hello/checkpoints/<run id> --output_dir gpt2-nano-hf

Only the model is read from the checkpoint (not the optimizer state). The model and tokenizer come from
the configuration the training run recorded in the checkpoint; ``--config_path`` (e.g. the run's own
training file: its ``trainer``, ``optimizer``, ... sections are ignored) and ``--model.*`` / ``--data.*``
options replace them. A model section that does not describe the checkpoint is an error naming the
parameter and both shapes. The vocabulary size comes from ``data.tokenizer`` (or ``vocab_size``). The
folder loads with ``transformers.AutoModelForCausalLM.from_pretrained`` and, with a tokenizer,
``AutoTokenizer``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ponente.models import Gpt2Config, LmConfig
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig, data_tokenizer, data_vocab_size
from ponente.trainer.run import (
    check_run_inputs,
    export_hf,
    find_checkpoint,
    load_model_from_checkpoint,
    parse_run_command_line,
    run_cli,
)

__all__ = ["ExportLmToHfConfig", "export_lm_to_hf", "load_model_from_checkpoint", "main", "training_config_keys"]


@dataclasses.dataclass(frozen=True)
class ExportLmToHfConfig:
    """Configuration of ``export_lm_to_hf``.

    Attributes:
        checkpoint_path: a checkpoint directory (``.../step-N``) or a run directory (its latest checkpoint).
        output_dir: the Hugging Face folder to write.
        model: the model config of the checkpoint (on the command line: the one the run recorded).
        data: the data config; its tokenizer is saved with the model and gives the vocabulary size (on the
            command line: the one the run recorded).
        vocab_size: the vocabulary size when there is no tokenizer to ask (None: from ``data.tokenizer``).
        save_tokenizer: also write the tokenizer files.
        max_shard_size: the largest safetensors file in bytes.
    """

    checkpoint_path: str = ""
    output_dir: str = ""
    model: LmConfig = dataclasses.field(default_factory=Gpt2Config)
    data: LMDatasetConfig | LMMixtureDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)
    vocab_size: int | None = None
    save_tokenizer: bool = True
    max_shard_size: int = 5 * 1024**3

    def __post_init__(self) -> None:
        if not self.checkpoint_path:
            raise ValueError("checkpoint_path: required (a checkpoint or run directory)")
        if not self.output_dir:
            raise ValueError("output_dir: required (the Hugging Face folder to write)")


def export_lm_to_hf(config: ExportLmToHfConfig) -> str:
    """Export as configured; returns the output folder.

    Raises:
        FileNotFoundError: if there is no committed checkpoint at ``checkpoint_path`` (checked first).
        ConfigError: if ``model`` does not describe the checkpoint (names the parameter and both shapes).
    """
    checkpoint = find_checkpoint(config.checkpoint_path)
    tokenizer = data_tokenizer(config.data) if config.save_tokenizer else None
    vocab_size = config.vocab_size if config.vocab_size is not None else data_vocab_size(config.data)
    model = load_model_from_checkpoint(config.model, vocab_size, checkpoint)
    return export_hf(
        model,
        config.output_dir,
        tokenizer=tokenizer,
        seq_len=config.model.seq_len,
        max_shard_size=config.max_shard_size,
    )


def training_config_keys() -> set[str]:
    """The top-level keys of the training configs (``train_lm``, ``sft``, ``lora_lm``): a training file given to
    a tool that reads its checkpoints may hold them; the tool ignores those it does not use."""
    from ponente.trainer.main.lora_lm import LoraLmConfig
    from ponente.trainer.main.sft import SftConfig  # a TrainLmConfig with more keys

    return {name for cls in (SftConfig, LoraLmConfig) for name in cls.__dataclass_fields__}


def _main(argv: Sequence[str]) -> int:
    config = parse_run_command_line(
        ExportLmToHfConfig, argv, prog="ponente-export-lm-to-hf", training_keys=training_config_keys()
    )
    check_run_inputs(config, splits=())
    print(f"wrote {export_lm_to_hf(config)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and export; returns the exit code (1 and one line on stderr for an error, 2 for a
    configuration error)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
