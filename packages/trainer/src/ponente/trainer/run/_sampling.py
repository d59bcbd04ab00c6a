"""A short text sampled from the model at the end of a run, to see what it learned."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["SampleConfig", "sample_text"]


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """Text sampled from the trained model at the end of a run.

    Attributes:
        num_tokens: tokens to generate (0: no sample).
        prompt: the text to continue.
        temperature: softmax temperature (0: greedy).
        top_k: sample among the ``top_k`` most likely tokens (None: all).
    """

    num_tokens: int = 0
    prompt: str = "\n"
    temperature: float = 0.8
    top_k: int | None = 40


def sample_text(model: Any, tokenizer: Any, vocab_size: int, cfg: SampleConfig, key: Any) -> str:
    """The prompt followed by ``cfg.num_tokens`` tokens sampled from ``model``.

    Args:
        model: a language model.
        tokenizer: a ``tokenizers.Tokenizer`` (an empty prompt starts from token 0).
        vocab_size: the tokenizer's vocabulary size (ids past it, padding of the vocab axis, are never drawn).
        cfg: what to sample.
        key: the PRNG key.
    """
    from ponente.trainer.sample import sample_tokens

    prompt = tokenizer.encode(cfg.prompt).ids or [0]
    ids = sample_tokens(
        model,
        prompt,
        num_tokens=cfg.num_tokens,
        key=key,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        vocab_size=vocab_size,
    )
    return cfg.prompt + tokenizer.decode(ids)
