"""Preference pairs of chat conversations: a processor that tokenizes them as TRL does, and their training rows.

A record holds a ``chosen`` and a ``rejected`` conversation (lists of ``{role, content}`` messages), in TRL's
conversational preference format, either

- with an explicit prompt: ``{"prompt": [...], "chosen": [{"role": "assistant", ...}], "rejected": [...]}``, or
- with an implicit one: ``{"chosen": [...], "rejected": [...]}`` whose shared leading messages are the prompt
  (TRL's ``extract_prompt``).

`PreferenceChatProcessor` tokenizes a pair as TRL's ``DPOTrainer`` does for conversational data: the prompt is
``render(prompt, add_generation_prompt=True)``, each response is what ``render(prompt + response)`` adds to it,
and where the tokenized prompt is not a prefix of the tokenized whole (the template renders the prompt alone
differently, or tokens merge across the boundary) the response starts where they diverge. A record is stored as
one token sequence, ``prompt + chosen + rejected``, with a ``pair_part`` field (0, 1, 2) saying which is which.

`PreferencePairDataset` cuts the rows of a training step from such a cache: one pair per row, as four int32
arrays of ``seq_len`` (``chosen_input_ids``, ``chosen_loss_mask``, ``rejected_input_ids``, ``rejected_loss_mask``;
the masks target-aligned: 1 on the response tokens the sequence log-prob sums).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ponente.datacache.dataset import Dataset, Indices, TokenStore, _as_index, _as_index_array
from ponente.datacache.errors import BAD_PAIR, MISSING_FIELD, WRONG_TYPE
from ponente.datacache.packing import wait_for_rows
from ponente.datacache.sft import ChatProcessor, message_problem

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["PAIR_FIELDS", "PreferenceChatProcessor", "PreferencePairDataset", "split_pair", "truncate_pair"]

logger = logging.getLogger(__name__)

PAIR_FIELDS = ("chosen_input_ids", "chosen_loss_mask", "rejected_input_ids", "rejected_loss_mask")
"""The fields of a pair row (int32 ``[seq_len]``; the masks target-aligned)."""

PROMPT, CHOSEN, REJECTED = 0, 1, 2
TRUNCATION_MODES = ("truncate", "error")


def split_pair(
    record: Mapping[str, Any], prompt_field: str, chosen_field: str, rejected_field: str
) -> tuple[list[Any], list[Any], list[Any]]:
    """``(prompt, chosen, rejected)`` message lists of a checked record: the explicit prompt, or else the
    messages ``chosen`` and ``rejected`` share at their start (TRL's ``extract_prompt``)."""
    chosen, rejected = list(record[chosen_field]), list(record[rejected_field])
    if prompt_field in record:
        return list(record[prompt_field]), chosen, rejected
    shared = 0
    while shared < min(len(chosen), len(rejected)) and dict(chosen[shared]) == dict(rejected[shared]):
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PreferenceChatProcessor(ChatProcessor):
    """Tokenize chosen/rejected chat pairs with a chat template (see the module docstring).

    Bad records (reported by `check`, so the builder's ``bad_records`` policy names file and row): a missing
    ``chosen_field``/``rejected_field``, or malformed messages, are ``missing_field``/``wrong_type`` as for chat
    data; a response whose last message is not the assistant's, an empty response, and a pair whose chosen and
    rejected responses are the same are ``bad_pair``. Each message names the field.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``, a ``tokenizer.json`` path, a directory containing one, or a hub id.
        chat_template: The Jinja chat template text.
        prompt_field: The record field of the explicit prompt (used when present).
        chosen_field: The record field of the preferred conversation (or response).
        rejected_field: The record field of the dispreferred conversation (or response).
        bos: The template's ``bos_token`` (``None``: an empty string).
        eos: The template's ``eos_token`` (``None``: an empty string).
        template_key: How errors name the chat template (the trainer passes ``data.format.chat_template``).

    Example:
        ```python
        template = (
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
        processor = PreferenceChatProcessor("tokenizer.json", chat_template=template, eos="</s>")
        user = {"role": "user", "content": "2+2?"}
        record = {
            "chosen": [user, {"role": "assistant", "content": "4"}],
            "rejected": [user, {"role": "assistant", "content": "5"}],
        }
        out = processor([record])  # input_ids: prompt + chosen + rejected; pair_part: 0..., 1..., 2...
        ```
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str | os.PathLike[str],
        *,
        chat_template: str | None,
        prompt_field: str = "prompt",
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        bos: str | None = None,
        eos: str | None = None,
        template_key: str = "chat_template",
    ) -> None:
        super().__init__(tokenizer, chat_template=chat_template, bos=bos, eos=eos, template_key=template_key)
        self.prompt_field, self.chosen_field, self.rejected_field = prompt_field, chosen_field, rejected_field

    @property
    def fields(self) -> Mapping[str, str]:
        """``{"input_ids": "int32", "pair_part": "uint8"}``."""
        return {"input_ids": "int32", "pair_part": "uint8"}

    def config(self) -> dict[str, Any]:
        """Tokenizer hash, the three field names, template text and BOS/EOS."""
        return {
            "type": "preference_chat",
            **self._base_config(),
            "prompt_field": self.prompt_field,
            "chosen_field": self.chosen_field,
            "rejected_field": self.rejected_field,
            "chat_template": self._template_source,
            "bos": self.bos,
            "eos": self.eos,
        }

    def check(self, record: Mapping[str, Any]) -> tuple[str, str] | None:
        """Require two well-formed conversations that end with different assistant responses."""
        if not isinstance(record, Mapping):
            return MISSING_FIELD, f"expected a record with fields {self.chosen_field!r} and {self.rejected_field!r}"
        for field in (self.chosen_field, self.rejected_field):
            if field not in record:
                return MISSING_FIELD, f"expected a field {field!r}, found keys {sorted(record)}"
        fields = [self.chosen_field, self.rejected_field]
        if self.prompt_field in record:
            fields.insert(0, self.prompt_field)
        for field in fields:
            problem = message_problem(record[field], field)
            if problem is not None:
                return problem
        prompt, chosen, rejected = split_pair(record, self.prompt_field, self.chosen_field, self.rejected_field)
        for field, response in ((self.chosen_field, chosen), (self.rejected_field, rejected)):
            if not response:
                return BAD_PAIR, f"field {field!r}: no response after the prompt (both conversations are the same)"
            if response[-1]["role"] != "assistant":
                return (
                    BAD_PAIR,
                    f"field {field!r}: the last message is from {response[-1]['role']!r}, not the assistant",
                )
        if [dict(m) for m in chosen] == [dict(m) for m in rejected]:
            return BAD_PAIR, f"fields {self.chosen_field!r} and {self.rejected_field!r} hold the same response"
        if not all(isinstance(m, Mapping) for m in prompt):
            return WRONG_TYPE, f"field {self.prompt_field!r}: expected a list of messages"
        return None

    def tokenize_pair(self, record: Mapping[str, Any]) -> tuple[list[int], list[int], list[int]]:
        """``(prompt, chosen, rejected)`` token ids of a checked record, as TRL's ``DPOTrainer`` cuts them."""
        prompt, chosen, rejected = split_pair(record, self.prompt_field, self.chosen_field, self.rejected_field)
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        texts = [
            self.render(prompt, add_generation_prompt=True),
            self.render(prompt + chosen),
            self.render(prompt + rejected),
        ]
        prompt_ids, with_chosen, with_rejected = (e.ids for e in encode(texts, add_special_tokens=False))
        shared = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
        return list(prompt_ids[:shared]), list(with_chosen[shared:]), list(with_rejected[shared:])

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, list[np.ndarray]]:
        """``input_ids`` (prompt, chosen, rejected end to end) and ``pair_part`` of checked records."""
        ids, parts = [], []
        for record in records:
            pieces = self.tokenize_pair(record)
            ids.append(np.array([t for piece in pieces for t in piece], dtype=np.int32))
            parts.append(np.repeat(np.arange(3, dtype=np.uint8), [len(p) for p in pieces]))
        return {"input_ids": ids, "pair_part": parts}


def truncate_pair(prompt: int, chosen: int, rejected: int, seq_len: int) -> tuple[int, int, int]:
    """How many tokens of each part a row of ``seq_len`` keeps: ``(prompt kept from its end, chosen kept from its
    start, rejected kept from its start)``.

    When ``prompt + longer response`` exceeds ``seq_len``, the prompt is cut from the left (its end, next to the
    response, is kept), down to ``seq_len - longer response`` but never below half the row (or the prompt's
    length); then the responses are cut at their end to the room left. This is TRL's rule of ``max_length`` with
    ``max_prompt_length = seq_len // 2`` and the prompt truncated from the left.
    """
    longer = max(chosen, rejected)
    if prompt + longer <= seq_len:
        return prompt, chosen, rejected
    keep_prompt = min(prompt, max(seq_len - longer, seq_len // 2))
    room = seq_len - keep_prompt
    return keep_prompt, min(chosen, room), min(rejected, room)


class PreferencePairDataset(Dataset[dict[str, np.ndarray]]):
    """One pair per row from a cache of `PreferenceChatProcessor` (see the module docstring).

    Pairs longer than ``seq_len`` are cut by `truncate_pair` and counted in `truncated` (the first one logged);
    with ``truncation="error"`` the first such pair raises instead, naming it.

    Args:
        cache: A token store with ``input_ids`` and ``pair_part`` fields.
        seq_len: Tokens per row, at least 2.
        truncation: ``"truncate"`` or ``"error"``.
        pad_id: The token id of padding (its mask is 0).
        name: What the pairs are, for messages (e.g. the cache's path).

    Raises:
        ValueError: For a ``seq_len`` below 2, an unknown ``truncation``, a cache without ``pair_part``, or (with
            ``truncation="error"``) a pair longer than ``seq_len``.
    """

    def __init__(
        self, cache: TokenStore, seq_len: int, *, truncation: str = "truncate", pad_id: int = 0, name: str = "pairs"
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"PreferencePairDataset: seq_len must be at least 2, got {seq_len}")
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation: expected one of {', '.join(TRUNCATION_MODES)}, got {truncation!r}")
        self.cache, self.seq_len, self.truncation, self.pad_id, self.name = (
            cache,
            int(seq_len),
            truncation,
            pad_id,
            name,
        )
        self._lock = threading.Lock()
        self._offsets = np.zeros(1, dtype=np.int64)
        self._lengths = np.zeros((0, 3), dtype=np.int64)  # prompt, chosen, rejected tokens of each pair
        self._truncated = 0
        self._finished = False
        self._refresh()

    @property
    def truncated(self) -> int:
        """How many pairs read so far were longer than ``seq_len`` (and so cut)."""
        self._refresh()
        return self._truncated

    def _refresh(self) -> int:
        if self._finished:
            return int(self._lengths.shape[0])
        with self._lock:
            finished = self.cache.is_finished
            pairs = len(self.cache)
            seen = self._offsets.size - 1
            if pairs > seen:
                new = np.asarray(self.cache.row_offsets(seen, pairs), dtype=np.int64)
                try:
                    parts = np.asarray(self.cache.read_flat(int(new[0]), int(new[-1]), "pair_part"))
                except KeyError as exc:
                    raise ValueError(
                        f"{self.name}: the cache has no pair_part field; it was not built from preference pairs "
                        "(data.format: preference_chat)"
                    ) from exc
                owner = np.repeat(np.arange(pairs - seen), np.diff(new))
                counts = np.zeros((pairs - seen, 3), dtype=np.int64)
                np.add.at(counts, (owner, parts.astype(np.int64)), 1)
                self._count_truncations(counts, seen)
                self._lengths = np.concatenate([self._lengths, counts])
                self._offsets = np.concatenate([self._offsets, new[1:]])
            self._finished = finished
            return int(self._lengths.shape[0])

    def _count_truncations(self, counts: np.ndarray, first: int) -> None:
        long = np.flatnonzero(counts[:, 0] + counts[:, 1:].max(axis=1) > self.seq_len)
        if long.size == 0:
            return
        k = int(long[0])
        prompt, chosen, rejected = (int(x) for x in counts[k])
        what = (
            f"{self.name}: pair {first + k} has {prompt} prompt + {chosen} chosen / {rejected} rejected tokens, more "
            f"than the row's {self.seq_len}"
        )
        if self.truncation == "error":
            raise ValueError(f"{what}; raise train_seq_len, or set data.format.truncation: truncate")
        if self._truncated == 0:
            logger.warning("%s; the prompt is cut from the left, then the responses (later pairs counted)", what)
        self._truncated += int(long.size)

    @property
    def is_finished(self) -> bool:
        """Whether the cache is finished (and so the number of pairs final)."""
        self._refresh()
        return self._finished

    def __len__(self) -> int:
        """Number of pairs."""
        return self._refresh()

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Block until ``length`` pairs are readable or the cache is finished."""
        # one record per pair: wait for the next record (or for the ``length`` asked for)
        return wait_for_rows(self, length, timeout, lambda: self._offsets.size if length is None else length)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Pair ``index`` as the four arrays of `PAIR_FIELDS`."""
        _as_index(index, len(self), name="PreferencePairDataset")
        return self.get_batch([index])[0]

    def get_batch(self, indices: Indices) -> list[dict[str, np.ndarray]]:
        """Pairs at ``indices``, one dict of `PAIR_FIELDS` arrays per row."""
        idx = _as_index_array(indices, self._refresh(), name="PreferencePairDataset")
        with self._lock:
            offsets, lengths = self._offsets, self._lengths
        out = []
        for row in idx.tolist():
            tokens = np.asarray(self.cache.read_flat(int(offsets[row]), int(offsets[row + 1])), dtype=np.int32)
            prompt, chosen, rejected = (int(x) for x in lengths[row])
            keep_p, keep_c, keep_r = truncate_pair(prompt, chosen, rejected, self.seq_len)
            head = tokens[prompt - keep_p : prompt]
            item = {}
            for name, start, keep in (("chosen", prompt, keep_c), ("rejected", prompt + chosen, keep_r)):
                ids = np.full(self.seq_len, self.pad_id, dtype=np.int32)
                mask = np.zeros(self.seq_len, dtype=np.int32)
                n = keep_p + keep
                ids[:n] = np.concatenate([head, tokens[start : start + keep]])
                mask[keep_p:n] = 1
                item[f"{name}_input_ids"], item[f"{name}_loss_mask"] = ids, mask
            out.append(item)
        return out
