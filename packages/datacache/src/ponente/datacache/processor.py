"""Batch processors: map raw records to rows of NumPy arrays (one array per output field).

A processor is anything with the members of :class:`BatchProcessor`; it must be picklable, because the
builder ships it to worker processes (or Ray actors). Its :meth:`~BatchProcessor.config` is part of the cache
fingerprint, so two processors with the same config must produce the same arrays.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from ponente.datacache.errors import EMPTY, MISSING_FIELD, WRONG_TYPE

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@runtime_checkable
class BatchProcessor(Protocol):
    """Turns a batch of records into rows: one 1-D NumPy array per output field per record."""

    @property
    def fields(self) -> Mapping[str, str]:
        """Output field names and their NumPy dtype names, e.g. ``{"input_ids": "int32"}``."""
        ...

    def config(self) -> dict[str, Any]:
        """A JSON-able description of everything that determines the output (part of the fingerprint)."""
        ...

    def check(self, record: Mapping[str, Any]) -> tuple[str, str] | None:
        """Return ``None`` if ``record`` can be processed, else ``(kind, detail)``.

        ``kind`` is ``"missing_field"``, ``"wrong_type"`` or ``"empty"`` (an empty document: skipped and
        counted, or kept if the builder is asked to keep empty documents).
        """
        ...

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, list[np.ndarray]]:
        """Process checked records: for each field, one 1-D array of dtype ``fields[field]`` per record."""
        ...


def load_tokenizer(tokenizer: str | os.PathLike[str]) -> Tokenizer:
    """Load a Hugging Face ``tokenizers`` tokenizer.

    A hub id is resolved offline-first: its ``tokenizer.json`` is read from the local Hugging Face cache
    (``HF_HUB_CACHE``, else ``HF_HOME/hub``) without touching the network, and downloaded only if it is not
    cached and ``HF_HUB_OFFLINE`` is not set.

    Args:
        tokenizer: A ``tokenizer.json`` file, a directory containing one, or a Hugging Face hub id, optionally
            pinned to a revision: ``"org/name"``, ``"org/name@v1.0"``, ``"org/name@<commit>"``.

    Returns:
        The tokenizer.

    Raises:
        FileNotFoundError: If a local directory has no ``tokenizer.json``, a path does not exist, or a hub id is
            neither cached nor downloadable (offline, unknown id): one line naming the id and, when it is set,
            ``HF_HUB_OFFLINE``.
    """
    from tokenizers import Tokenizer

    from ponente.datacache._hub import hub_file, split_revision

    path = Path(tokenizer)
    if path.is_file():
        return Tokenizer.from_file(str(path))
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"tokenizer directory {str(path)!r} has no tokenizer.json (only the fast-tokenizer JSON format "
                "is supported; save it with tokenizer.save_pretrained or Tokenizer.save)"
            )
        return Tokenizer.from_file(str(file))
    name = os.fspath(tokenizer)
    repo_id, _ = split_revision(name)
    parts = repo_id.split("/")
    if path.exists() or not (1 <= len(parts) <= 2 and all(parts)) or name.startswith((".", "~")) or "\\" in name:
        raise FileNotFoundError(f"tokenizer {name!r}: no such file or directory (nor a hub id 'org/name[@revision]')")
    return Tokenizer.from_file(str(hub_file(name, "tokenizer.json", what="tokenizer")))


def _token_id(tokenizer: Tokenizer, token: str | None, role: str) -> int | None:
    if token is None:
        return None
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
    return int(token_id)


class TokenizerProcessor:
    """Tokenize one text field of each record with a Hugging Face ``tokenizers`` tokenizer.

    Output field ``"input_ids"`` (int32). The BOS/EOS policy is explicit: ``bos``/``eos`` name tokens to put
    before/after every document (``None``: none), and ``add_special_tokens`` says whether the tokenizer's own
    post-processor (e.g. a template that adds BOS) runs. All three are part of the fingerprint.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``, a ``tokenizer.json`` path, a directory containing one, or a hub
            id (see :func:`load_tokenizer`).
        text_key: The record key holding the text.
        bos: Token to prepend to every document, or ``None``.
        eos: Token to append to every document, or ``None``.
        add_special_tokens: Let the tokenizer's post-processor add its special tokens.

    Raises:
        ValueError: If ``bos`` or ``eos`` is not in the vocabulary.

    Examples:
        >>> processor = TokenizerProcessor("tokenizer.json", eos="</s>")  # doctest: +SKIP
        >>> processor([{"text": "hello world"}])["input_ids"]  # doctest: +SKIP
        [array([ 31, 412,   2], dtype=int32)]
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str | os.PathLike[str],
        *,
        text_key: str = "text",
        bos: str | None = None,
        eos: str | None = None,
        add_special_tokens: bool = False,
    ) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.text_key = text_key
        self.bos, self.eos = bos, eos
        self.add_special_tokens = add_special_tokens
        self._bos_id = _token_id(self.tokenizer, bos, "bos")
        self._eos_id = _token_id(self.tokenizer, eos, "eos")
        self._digest = hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()

    @property
    def fields(self) -> Mapping[str, str]:
        """``{"input_ids": "int32"}``."""
        return {"input_ids": "int32"}

    def config(self) -> dict[str, Any]:
        """Tokenizer content hash, vocabulary size, text key and BOS/EOS policy."""
        return {
            "type": "tokenizer",
            "tokenizer_sha256": self._digest,
            "vocab_size": self.tokenizer.get_vocab_size(with_added_tokens=True),
            "text_key": self.text_key,
            "bos": self.bos,
            "eos": self.eos,
            "add_special_tokens": self.add_special_tokens,
        }

    def check(self, record: Mapping[str, Any]) -> tuple[str, str] | None:
        """Require a string under ``text_key``; an empty string is ``"empty"``."""
        if not isinstance(record, Mapping) or self.text_key not in record:
            keys = sorted(record) if isinstance(record, Mapping) else type(record).__name__
            return MISSING_FIELD, f"expected a text field {self.text_key!r}, found keys {keys}"
        text = record[self.text_key]
        if not isinstance(text, str):
            return WRONG_TYPE, f"expected field {self.text_key!r} to be a string, found {type(text).__name__}"
        if not text:
            return EMPTY, "empty document"
        return None

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, list[np.ndarray]]:
        """Tokenize the texts of ``records`` (a batch, in parallel threads inside ``tokenizers``)."""
        texts = [record[self.text_key] for record in records]
        # encode_batch_fast (tokenizers >= 0.21) skips character offsets; the ids are the same.
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encodings = encode(texts, add_special_tokens=self.add_special_tokens)
        prefix = [self._bos_id] if self._bos_id is not None else []
        suffix = [self._eos_id] if self._eos_id is not None else []
        if prefix or suffix:
            rows = [np.array(prefix + e.ids + suffix, dtype=np.int32) for e in encodings]
        else:
            rows = [np.array(e.ids, dtype=np.int32) for e in encodings]
        return {"input_ids": rows}


class PassthroughProcessor:
    """Store pre-tokenized records as they are: each field must hold a list of integers.

    Args:
        fields: Record keys to store and their dtype names, e.g. ``{"input_ids": "int32"}``.

    Examples:
        >>> PassthroughProcessor()([{"input_ids": [5, 6, 7]}])["input_ids"]
        [array([5, 6, 7], dtype=int32)]
    """

    def __init__(self, fields: Mapping[str, str] | None = None) -> None:
        self._fields = dict(fields) if fields is not None else {"input_ids": "int32"}
        for name, dtype in self._fields.items():
            if not np.issubdtype(np.dtype(dtype), np.integer):
                raise ValueError(f"field {name!r}: expected an integer dtype, found {dtype!r}")

    @property
    def fields(self) -> Mapping[str, str]:
        """The stored fields and their dtypes."""
        return dict(self._fields)

    def config(self) -> dict[str, Any]:
        """The field names and dtypes."""
        return {"type": "passthrough", "fields": self._fields}

    def check(self, record: Mapping[str, Any]) -> tuple[str, str] | None:
        """Require every field to be a list of integers (an empty list in every field is ``"empty"``)."""
        if not isinstance(record, Mapping):
            return MISSING_FIELD, f"expected a record with fields {sorted(self._fields)}"
        for name in self._fields:
            if name not in record:
                return MISSING_FIELD, f"expected a field {name!r}, found keys {sorted(record)}"
            value = record[name]
            if not isinstance(value, list | tuple | np.ndarray) or not all(
                isinstance(v, int | np.integer) and not isinstance(v, bool) for v in value
            ):
                return WRONG_TYPE, f"expected field {name!r} to be a list of integers, found {type(value).__name__}"
        if all(len(record[name]) == 0 for name in self._fields):
            return EMPTY, "empty document"
        return None

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, list[np.ndarray]]:
        """Convert each field of each record to an array of its dtype."""
        return {name: [np.asarray(r[name], dtype=dtype) for r in records] for name, dtype in self._fields.items()}
