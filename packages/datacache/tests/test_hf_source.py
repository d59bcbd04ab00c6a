"""Hugging Face datasets source: local save_to_disk (map-style and streaming) and the offline hub error."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from tokenizers import Tokenizer

from ponente.datacache import build_cache
from ponente.datacache.hf_source import HFSource


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    docs = [f"document number {i} " * (i % 5 + 1) for i in range(23)]
    path = tmp_path_factory.mktemp("hf") / "ds"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": docs, "id": list(range(23))}),
            "test": datasets.Dataset.from_dict({"text": ["x"], "id": [0]}),
        }
    ).save_to_disk(str(path))
    return path, docs


@pytest.mark.parametrize("streaming", [False, True])
def test_rows_and_resume_points(saved: tuple[Path, list[str]], streaming: bool) -> None:
    path, docs = saved
    source = HFSource(path, split="train", shard_rows=10, streaming=streaming)
    assert len(source.shard_names) == 3
    records = [(name, row, rec) for name in source.shard_names for row, rec, _ in source.open_shard(name)]
    assert [rec["text"] for _, _, rec in records] == docs  # type: ignore[index]
    name = source.shard_names[1]
    tail = [rec["id"] for _, rec, _ in source.open_shard(name, 4)]  # type: ignore[index]
    assert tail == [r["id"] for n, row, r in records if n == name and row >= 4]  # type: ignore[index]


def test_build_from_hf_matches_encode_batch(
    saved: tuple[Path, list[str]], tmp_path: Path, tokenizer_path: Path, tokenizer: Tokenizer, helpers: type
) -> None:
    path, docs = saved
    cache = build_cache(
        HFSource(path, split="train", shard_rows=8),
        tmp_path / "c",
        tokenizer=tokenizer_path,
        workers=0,
        progress=False,
    )
    assert [r["input_ids"].tolist() for r in cache.get_batch(range(len(cache)))] == helpers.reference_ids(
        tokenizer, docs
    )


def test_split_errors_and_offline_hub(saved: tuple[Path, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = saved
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\]; pass split"):
        HFSource(path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"'someone/some-corpus' is not a local directory.*HF_HUB_OFFLINE"):
        HFSource("someone/some-corpus", split="train")


def test_missing_datasets_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ponente.datacache import MissingExtraError

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingExtraError, match=r"ponente-datacache\[hf\]"):
        HFSource("anything")
