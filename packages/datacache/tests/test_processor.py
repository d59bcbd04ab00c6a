"""Processors: the tokenizer processor against raw ``tokenizers`` output, BOS/EOS, checks, passthrough."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from ponente.datacache import BatchProcessor, PassthroughProcessor, TokenizerProcessor, load_tokenizer
from ponente.datacache.errors import EMPTY, MISSING_FIELD, WRONG_TYPE


def test_tokenizer_processor_matches_encode_batch(tokenizer_path: Path, tokenizer: Tokenizer, helpers: type) -> None:
    docs = helpers.make_documents(50, seed=1)
    processor = TokenizerProcessor(tokenizer_path, text_key="body")
    assert isinstance(processor, BatchProcessor)
    out = processor([{"body": d} for d in docs])["input_ids"]
    assert [row.dtype for row in out] == [np.dtype(np.int32)] * len(docs)
    assert [row.tolist() for row in out] == helpers.reference_ids(tokenizer, docs)


def test_bos_eos_policy(tokenizer_path: Path, tokenizer: Tokenizer, helpers: type) -> None:
    docs = ["hello there", "x"]
    bos, eos = tokenizer.token_to_id("<bos>"), tokenizer.token_to_id("<eos>")
    both = TokenizerProcessor(tokenizer_path, bos="<bos>", eos="<eos>")
    assert [r.tolist() for r in both([{"text": d} for d in docs])["input_ids"]] == helpers.reference_ids(
        tokenizer, docs, bos, eos
    )
    only_eos = TokenizerProcessor(tokenizer_path, eos="<eos>")
    assert [r.tolist() for r in only_eos([{"text": d} for d in docs])["input_ids"]] == helpers.reference_ids(
        tokenizer, docs, None, eos
    )
    assert both.config() != only_eos.config()
    with pytest.raises(ValueError, match="'<nope>' is not in the tokenizer's vocabulary"):
        TokenizerProcessor(tokenizer_path, eos="<nope>")


def test_checks(tokenizer_path: Path) -> None:
    processor = TokenizerProcessor(tokenizer_path)
    assert processor.check({"text": "fine"}) is None
    assert processor.check({"other": "x"})[0] == MISSING_FIELD  # type: ignore[index]
    assert processor.check({"text": 5})[0] == WRONG_TYPE  # type: ignore[index]
    assert processor.check({"text": None})[0] == WRONG_TYPE  # type: ignore[index]
    assert processor.check({"text": ""})[0] == EMPTY  # type: ignore[index]


def test_load_tokenizer_from_file_directory_and_offline_hub(
    tokenizer_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = Tokenizer.from_file(str(tokenizer_path)).encode("some text").ids
    assert load_tokenizer(tokenizer_path).encode("some text").ids == reference
    assert load_tokenizer(tokenizer_path.parent).encode("some text").ids == reference
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"some-org/some-tokenizer.*HF_HUB_OFFLINE"):
        load_tokenizer("some-org/some-tokenizer")


def test_tokenizer_fingerprint_depends_on_content_not_path(tokenizer_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.json"
    copy.write_bytes(tokenizer_path.read_bytes())
    assert TokenizerProcessor(copy).config() == TokenizerProcessor(tokenizer_path).config()


def test_passthrough() -> None:
    processor = PassthroughProcessor({"input_ids": "int32", "labels": "int64"})
    records = [{"input_ids": [1, 2, 3], "labels": [4]}, {"input_ids": [], "labels": [5, 6]}]
    out = processor(records)
    assert [r.tolist() for r in out["input_ids"]] == [[1, 2, 3], []]
    assert [r.dtype for r in out["labels"]] == [np.dtype(np.int64)] * 2
    assert processor.check(records[0]) is None
    assert processor.check({"input_ids": [1]})[0] == MISSING_FIELD  # type: ignore[index]
    assert processor.check({"input_ids": "abc", "labels": []})[0] == WRONG_TYPE  # type: ignore[index]
    assert processor.check({"input_ids": [1.5], "labels": []})[0] == WRONG_TYPE  # type: ignore[index]
    assert processor.check({"input_ids": [], "labels": []})[0] == EMPTY  # type: ignore[index]
    with pytest.raises(ValueError, match="integer dtype"):
        PassthroughProcessor({"x": "float32"})
