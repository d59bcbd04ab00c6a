"""Export a training checkpoint as a Hugging Face model folder: ``python -m ponente.trainer.main.export_lm_to_hf``.

Example::

    python -m ponente.trainer.main.export_lm_to_hf --config_path gpt2_nano \\
        --checkpoint_path ponente_hello/checkpoints/<run id> --output_dir gpt2-nano-hf

Only the model is read from the checkpoint (not the optimizer state). ``model`` must describe the
checkpoint's architecture (the training config's ``model:`` section does); the vocabulary size comes
from ``data.tokenizer`` (or ``vocab_size``). The folder loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and, with a tokenizer, ``AutoTokenizer``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ponente.models import Gpt2Config, LmConfig
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig
from ponente.trainer.run import export_hf, load_model_from_checkpoint, parse_command_line

__all__ = ["ExportLmToHfConfig", "export_lm_to_hf", "load_model_from_checkpoint", "main"]


@dataclasses.dataclass(frozen=True)
class ExportLmToHfConfig:
    """Configuration of ``export_lm_to_hf``.

    Attributes:
        checkpoint_path: a checkpoint directory (``.../step-N``) or a run directory (its latest checkpoint).
        output_dir: the Hugging Face folder to write.
        model: the model config of the checkpoint.
        data: the data config; its tokenizer is saved with the model and gives the vocabulary size.
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
    """Export as configured; returns the output folder."""
    tokenizer = config.data.the_tokenizer if config.save_tokenizer else None
    vocab_size = config.vocab_size if config.vocab_size is not None else config.data.the_vocab_size
    model = load_model_from_checkpoint(config.model, vocab_size, config.checkpoint_path)
    return export_hf(
        model,
        config.output_dir,
        tokenizer=tokenizer,
        seq_len=config.model.seq_len,
        max_shard_size=config.max_shard_size,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and export; returns the exit code."""
    config = parse_command_line(ExportLmToHfConfig, argv, prog="export_lm_to_hf")
    print(f"wrote {export_lm_to_hf(config)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
