"""Text of a completion as its tokens arrive: incremental decoding, stop strings, deltas safe to stream."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream", "decode", "encode"]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``: a ``tokenizers.Tokenizer`` (``.encode(text).ids``) or a ``transformers`` tokenizer.

    Special tokens (BOS) are added as the tokenizer's own post-processor says.
    """
    encoded = tokenizer.encode(text)
    return [int(i) for i in getattr(encoded, "ids", encoded)]


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of ``ids``, special tokens skipped (both tokenizer kinds take ``skip_special_tokens``)."""
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))


class TextStream:
    """The text of one completion, grown token by token, cut at the first stop string.

    :meth:`push` returns the text that became final with each token: text that could still turn into a stop
    string, or end in an incomplete UTF-8 character (decoded as U+FFFD), waits for the next token. The
    deltas of all pushes add up to :attr:`text`.

    Args:
        tokenizer: the tokenizer (None: no text; every delta is "").
        stop_strings: cut the text before the first of these.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False

    def push(self, token: int | None, *, final: bool) -> str:
        """Add ``token`` (None: nothing, e.g. a stop token kept out of the text) and return the new final text.

        Args:
            token: the generated id.
            final: no token follows (everything held back is released).

        Returns:
            The text delta; after it, :attr:`stopped` says whether a stop string ended the text.
        """
        if self.tokenizer is None or self.stopped:
            return ""
        if token is not None:
            self.ids.append(int(token))
        full = decode(self.tokenizer, self.ids)
        cut = min((i for i in (full.find(s) for s in self.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(full[:cut])
        if final:
            return self._emit(full)
        safe = len(full.rstrip("\ufffd"))
        held = max((_overlap(full[:safe], s) for s in self.stop_strings), default=0)
        return self._emit(full[: max(safe - held, len(self.text))])

    def _emit(self, upto: str) -> str:
        if not upto.startswith(self.text):  # a decoder that rewrote earlier text: keep what was streamed
            return ""
        delta = upto[len(self.text) :]
        self.text = upto
        return delta


def _overlap(text: str, stop: str) -> int:
    """The length of the longest proper prefix of ``stop`` that ``text`` ends with."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
