"""Shared fixtures: a tiny byte-level BPE tokenizer trained locally, and a generator of small corpora."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "data",
    "caches",
    "tokens",
    "into",
    "shards",
    "and",
    "rows",
    "ledger",
    "commit",
    "pointer",
    "resume",
    "reader",
    "writer",
    "zarr",
    "ünïcödé",
    "東京",
    "émoji",
    "🙂",
]


def make_documents(count: int, seed: int = 0, max_words: int = 40) -> list[str]:
    """Deterministic small documents of random words (some non-ASCII)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, max_words)))) for _ in range(count)]


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``tokenizer.json`` of a byte-level BPE (vocabulary 400, special tokens <bos> <eos>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(make_documents(300, seed=123), trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path: Path) -> Tokenizer:
    """The fixture tokenizer, loaded with ``tokenizers`` itself (the reference for token ids)."""
    return Tokenizer.from_file(str(tokenizer_path))


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """``write_jsonl(name, docs, key="text")`` writes documents as a JSON-lines file under ``tmp_path``."""

    def write(name: str, docs: list[str], key: str = "text") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({key: doc}) + "\n")
        return path

    return write


def reference_ids(
    tokenizer: Tokenizer, docs: list[str], bos: int | None = None, eos: int | None = None
) -> list[list[int]]:
    """Token ids of ``docs`` from the raw ``tokenizers`` ``encode_batch``, with optional BOS/EOS ids."""
    pre = [bos] if bos is not None else []
    post = [eos] if eos is not None else []
    return [pre + e.ids + post for e in tokenizer.encode_batch(docs, add_special_tokens=False)]


def tree_digest(root: str | os.PathLike[str]) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root``."""
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(out.items()))


@pytest.fixture
def helpers() -> type:
    """The module-level helpers, for tests (pytest's importlib mode does not let tests import conftest)."""

    class Helpers:
        make_documents = staticmethod(make_documents)
        reference_ids = staticmethod(reference_ids)
        tree_digest = staticmethod(tree_digest)

    return Helpers
