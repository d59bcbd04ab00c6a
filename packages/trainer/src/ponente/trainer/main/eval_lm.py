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
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from ponente.models import Gpt2Config, LmConfig
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig, train_set, validation_sets
from ponente.trainer.main.export_lm_to_hf import training_config_keys
from ponente.trainer.run import (
    check_run_inputs,
    find_checkpoint,
    load_model_from_checkpoint,
    parse_run_command_line,
    run_cli,
)

__all__ = ["EvalLmConfig", "EvalResult", "eval_lm", "main", "token_byte_lengths"]


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


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Evaluation of one dataset.

    Attributes:
        loss: mean next-token loss in nats.
        perplexity: ``exp(loss)``.
        bits_per_byte: summed loss in bits over the UTF-8 bytes of the predicted tokens.
        tokens: predicted tokens counted.
        bytes: their UTF-8 bytes.
    """

    loss: float
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int


def token_byte_lengths(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """The number of UTF-8 bytes each token id stands for (0 for special tokens and padding ids).

    Byte-level BPE tokens spell one byte per character of their vocabulary string; other tokenizers are
    asked to decode each id.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        vocab_size: the length of the table (ids past the tokenizer's vocabulary get 0).

    Returns:
        An int32 array of length ``vocab_size``.
    """
    from tokenizers import pre_tokenizers

    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    byte_level = isinstance(tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel)
    lengths = np.zeros(vocab_size, np.int32)
    for i in range(min(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))):
        token = tokenizer.id_to_token(i)
        if token is None or token in special:
            continue
        lengths[i] = len(token) if byte_level else len(tokenizer.decode([i]).encode("utf-8"))
    return lengths


def _load_model(config: EvalLmConfig, checkpoint: str | None, vocab_size: int) -> Any:
    if checkpoint is None:
        from ponente.models.hf import load_pretrained

        assert config.hf_checkpoint is not None  # checked in __post_init__
        return load_pretrained(config.hf_checkpoint)
    return load_model_from_checkpoint(config.model, vocab_size, checkpoint)


def eval_lm(config: EvalLmConfig) -> dict[str, EvalResult]:
    """Evaluate as configured; returns the results by dataset name.

    Raises:
        FileNotFoundError: if there is no committed checkpoint at ``checkpoint_path`` (checked first).
        ConfigError: if ``model`` does not describe the checkpoint (names the parameter and both shapes).
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from ponente.models import compute_next_token_loss
    from ponente.trainer.data import batch_for_step
    from ponente.trainer.tasks.lm import lm_batch, lm_example

    checkpoint = find_checkpoint(config.checkpoint_path) if config.checkpoint_path is not None else None
    data = config.data
    model = _load_model(config, checkpoint, data.the_vocab_size)
    byte_table = jnp.asarray(token_byte_lengths(data.the_tokenizer, model.Vocab.size))
    seq_len = model.config.seq_len
    if config.split == "validation":
        datasets = validation_sets(data, seq_len)
        if not datasets:
            raise ValueError("data.validation_urls: no validation data to evaluate (or pass --split train)")
    else:
        datasets = {"train": train_set(data, seq_len, seed=0)}

    @eqx.filter_jit
    def batch_sums(model: Any, batch: dict[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
        example = lm_example(batch)
        losses = compute_next_token_loss(model, example, reduction="none").array
        mask = example.loss_mask.array
        targets = jnp.roll(batch["input_ids"].array, -1, axis=-1)
        return jnp.sum(losses), jnp.sum(mask), jnp.sum(mask * byte_table[targets])

    results = {}
    for name, dataset in datasets.items():
        dataset.wait_for_length(None)
        num = len(dataset) // config.batch_size
        if config.max_batches is not None:
            num = min(num, config.max_batches)
        if num == 0:
            raise ValueError(f"{name}: fewer than batch_size={config.batch_size} rows of {seq_len} tokens")
        nats = tokens = nbytes = 0.0
        for step in range(num):
            sums = batch_sums(model, lm_batch(batch_for_step(dataset, step, config.batch_size)))
            nats, tokens, nbytes = (a + float(b) for a, b in zip((nats, tokens, nbytes), sums, strict=True))
        loss = nats / tokens
        results[name] = EvalResult(
            loss=loss,
            perplexity=math.exp(loss),
            bits_per_byte=nats / math.log(2) / nbytes,
            tokens=int(tokens),
            bytes=int(nbytes),
        )
    return results


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
