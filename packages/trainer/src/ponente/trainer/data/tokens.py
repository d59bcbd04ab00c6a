"""The tokenizer of a data config and its BOS/EOS policy, as resolved by the builder for a format's processor."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ponente.datacache import load_tokenizer
from ponente.trainer.data.cache_build import resolve_url

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["TokenizerSpec", "load_data_tokenizer"]

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "<|endoftext|>")


@functools.lru_cache(maxsize=16)
def load_data_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of a ``data.tokenizer`` value (file, folder, ``package://`` URL or hub id), once per process."""
    return load_tokenizer(resolve_url(spec))


def specials(tokenizer: Tokenizer) -> set[str]:
    """The contents of the tokenizer's special added tokens."""
    return {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}


def maybe_special(tokenizer: Tokenizer, candidates: Sequence[str]) -> str | None:
    """The first of ``candidates`` that is a special token of ``tokenizer``, or ``None``."""
    found = specials(tokenizer)
    return next((token for token in candidates if token in found), None)


def vocab_size(tokenizer: Tokenizer, configured: int | None, where: str) -> int:
    """``configured`` if set (checked against the tokenizer), else the tokenizer's size with added tokens."""
    actual = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if configured is None:
        return actual
    if configured < actual:
        raise ValueError(f"{where}.vocab_size: {configured} is smaller than the tokenizer's vocabulary ({actual})")
    return configured


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What a format's processor needs from its data config: the tokenizer and the BOS/EOS policy.

    Built by the data builder from ``data.tokenizer``, ``data.enforce_bos``/``enforce_eos`` and
    ``data.bos_token``/``eos_token``; a format never loads a tokenizer itself.

    Attributes:
        tokenizer: The loaded ``tokenizers.Tokenizer``.
        location: ``data.tokenizer`` resolved to a path or hub id (its folder may hold a chat template).
        spec: ``data.tokenizer`` as written (for messages).
        enforce_eos: Append EOS to every document / example.
        enforce_bos: Prepend BOS to every document / example.
        eos_token: ``data.eos_token`` (None: pick among the usual EOS tokens).
        bos_token: ``data.bos_token`` (None: pick among the usual BOS tokens).
    """

    tokenizer: Tokenizer
    location: str
    spec: str
    enforce_eos: bool = True
    enforce_bos: bool = False
    eos_token: str | None = None
    bos_token: str | None = None

    def _special(self, explicit: str | None, candidates: Sequence[str], key: str) -> str:
        if explicit is not None:
            if self.tokenizer.token_to_id(explicit) is None:
                raise ValueError(f"{key}: token {explicit!r} is not in the tokenizer's vocabulary")
            return explicit
        found = specials(self.tokenizer)
        for token in candidates:
            if token in found:
                return token
        raise ValueError(
            f"{key} is not set and none of {list(candidates)} is a special token of the tokenizer (its special "
            f"tokens are {sorted(found)}): set {key}, or turn off the enforce_* option that needs it"
        )

    @property
    def eos(self) -> str | None:
        """The EOS token appended per ``enforce_eos`` (``None`` when off).

        Raises:
            ValueError: naming ``data.eos_token`` when no EOS token can be found.
        """
        return self._special(self.eos_token, EOS_CANDIDATES, "data.eos_token") if self.enforce_eos else None

    @property
    def bos(self) -> str | None:
        """The BOS token prepended per ``enforce_bos`` (``None`` when off).

        Raises:
            ValueError: naming ``data.bos_token`` when no BOS token can be found.
        """
        return self._special(self.bos_token, BOS_CANDIDATES, "data.bos_token") if self.enforce_bos else None
