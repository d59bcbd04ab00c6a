"""What to generate (:class:`GenerationConfig`) and what came out (:class:`Completion`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["Completion", "FinishReason", "GenerationConfig"]

FinishReason = Literal["stop", "length"]
"""Why a completion ended: a stop token or stop string (``"stop"``), or its token budget (``"length"``)."""


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to continue one prompt.

    Attributes:
        max_new_tokens: the most tokens to generate (fewer when the model's ``max_seq_len`` is reached first).
        temperature: softmax temperature; ``0`` picks the most likely token (greedy).
        top_k: sample only among the ``top_k`` most likely tokens (None: all).
        top_p: sample only among the most likely tokens whose probabilities add up to ``top_p`` (nucleus
            sampling, after ``top_k``; None: all).
        stop_token_ids: stop after generating one of these ids (e.g. the tokenizer's end-of-sequence id); the id
            ends the completion's ``tokens`` but not its ``text``.
        stop_strings: stop once the text contains one of these; the text is cut before it.
        seed: the random seed; the same prompt, config and seed give the same completion, whatever else is in
            the batch.
        logprobs: report the log-probability of each generated token (under the model's distribution, before
            temperature and filtering, unless ``tempered_logprobs``).
        tempered_logprobs: report the log-probabilities under the distribution the token was drawn from,
            ``log_softmax(logits / temperature)``, still before ``top_k``/``top_p`` (what ``ponente-rl`` needs as the
            old policy's); ignored at temperature 0 (greedy: the model's distribution).

    Example:
        >>> config = GenerationConfig(max_new_tokens=16, temperature=0.7, top_p=0.9, stop_strings=("\\n",))
        >>> config.top_k is None, config.stop_strings
        (True, ('\\n',))
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    logprobs: bool = False
    tempered_logprobs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k: must be None or >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be None or in (0, 1], got {self.top_p}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: ids must be >= 0, got {list(self.stop_token_ids)}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop_strings: must be non-empty strings, got {list(self.stop_strings)}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed: must be in [0, 2**32), got {self.seed}")


@dataclasses.dataclass(frozen=True)
class Completion:
    """The continuation of one prompt.

    Attributes:
        prompt_tokens: the prompt's token ids.
        tokens: the generated ids (ending with the stop token id when one stopped it).
        text: the generated text: ``tokens`` decoded without special tokens and the stop token, cut before a
            stop string ("" without a tokenizer).
        logprobs: the log-probability of each of ``tokens`` (None unless ``GenerationConfig.logprobs``).
        finish_reason: ``"stop"`` (stop token or string) or ``"length"`` (token budget or ``max_seq_len``).
    """

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: FinishReason
