"""Loss, perplexity and bits per byte of a language model on some datasets (``ponente-eval-lm``).

Bits per byte divide the summed loss (converted to bits) by the number of UTF-8 bytes of the predicted
tokens, which makes models with different tokenizers comparable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .lm import lm_batch, lm_example

__all__ = ["EvalResult", "evaluate_lm", "token_byte_lengths"]


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


def evaluate_lm(
    model: Any, datasets: Mapping[str, Any], tokenizer: Any, *, batch_size: int, max_batches: int | None = None
) -> dict[str, EvalResult]:
    """Evaluate ``model`` on each dataset of packed token rows; returns the results by dataset name.

    Only full batches count: the rows after the last multiple of ``batch_size`` are left out.

    Args:
        model: a language model.
        datasets: the datasets by name (rows with ``input_ids``, ``segment_ids``, ...).
        tokenizer: the ``tokenizers.Tokenizer`` of the data (for the bytes of each token).
        batch_size: rows per batch.
        max_batches: evaluate at most this many batches per dataset (None: all).

    Raises:
        ValueError: naming the dataset, if it has fewer than ``batch_size`` rows.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from ponente.models import compute_next_token_loss
    from ponente.trainer.data import batch_for_step

    byte_table = jnp.asarray(token_byte_lengths(tokenizer, model.Vocab.size))
    seq_len = model.config.seq_len

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
        num = len(dataset) // batch_size
        if max_batches is not None:
            num = min(num, max_batches)
        if num == 0:
            raise ValueError(f"{name}: fewer than batch_size={batch_size} rows of {seq_len} tokens")
        nats = tokens = nbytes = 0.0
        for step in range(num):
            sums = batch_sums(model, lm_batch(batch_for_step(dataset, step, batch_size)))
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
