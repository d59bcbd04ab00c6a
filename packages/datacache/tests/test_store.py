"""The store and the cache dataset: layout, reads against a NumPy reference, commit visibility, waiting."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ponente.datacache import CacheDataset, CacheNotFoundError, PassthroughProcessor, build_cache, open_cache
from ponente.datacache.dataset import TokenStore
from ponente.datacache.ledger import Ledger
from ponente.datacache.source import SourceItem
from ponente.datacache.store import CHUNK_ELEMENTS, StoreWriter, kvstore_spec


class ListSource:
    """An in-memory source of pre-tokenized rows: each shard is a list of id lists."""

    def __init__(self, shards: dict[str, list[list[int]]]) -> None:
        self.shards = shards

    @property
    def shard_names(self) -> list[str]:
        return list(self.shards)

    def open_shard(self, name: str, row: int = 0) -> Iterator[SourceItem]:
        for i in range(row, len(self.shards[name])):
            yield i, {"input_ids": self.shards[name][i]}, 4 * len(self.shards[name][i])

    def describe(self) -> dict[str, Any]:
        return {"type": "list", "shards": [[n, len(v)] for n, v in self.shards.items()]}

    def locate(self, name: str, row: int) -> str:
        return f"{name}[{row}]"


def _random_rows(seed: int, count: int, max_len: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, size=int(rng.integers(1, max_len))).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def big_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[CacheDataset, list[list[int]]]:
    rows = _random_rows(0, 400, 1200)  # ~240k tokens: several 65536-element chunks
    source = ListSource({"a": rows[:150], "b": rows[150:]})
    out = tmp_path_factory.mktemp("store") / "cache"
    cache = build_cache(source, out, processor=PassthroughProcessor(), workers=0, progress=False, batch_rows=37)
    return cache, rows


def test_rows_and_flat_reads_match_numpy(big_cache: tuple[CacheDataset, list[list[int]]]) -> None:
    cache, rows = big_cache
    flat = np.concatenate([np.asarray(r, dtype=np.int32) for r in rows])
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    assert flat.size > 3 * CHUNK_ELEMENTS
    assert len(cache) == len(rows)
    assert cache.num_tokens() == flat.size
    assert isinstance(cache, TokenStore)
    rng = np.random.default_rng(1)
    for _ in range(50):
        start = int(rng.integers(0, flat.size))
        stop = int(rng.integers(start, min(flat.size, start + 3 * CHUNK_ELEMENTS) + 1))
        np.testing.assert_array_equal(cache.read_flat(start, stop), flat[start:stop])
        lo = int(rng.integers(0, len(rows) + 1))
        hi = int(rng.integers(lo, len(rows) + 1))
        got = cache.row_offsets(lo, hi)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, offsets[lo : hi + 1])
    np.testing.assert_array_equal(cache.read_flat(0, flat.size), flat)
    for i in (0, 1, 199, len(rows) - 1, -1):
        assert cache[i]["input_ids"].tolist() == rows[i]
    assert [r["input_ids"].tolist() for r in cache.get_batch(np.array([5, 3, 5]))] == [rows[5], rows[3], rows[5]]


def test_out_of_range_reads_are_clear_errors(big_cache: tuple[CacheDataset, list[list[int]]]) -> None:
    cache, _rows = big_cache
    with pytest.raises(IndexError, match="out of range: 400 rows are committed"):
        cache[400]
    with pytest.raises(IndexError, match="committed length"):
        cache.read_flat(0, cache.num_tokens() + 1)
    with pytest.raises(IndexError, match="committed rows"):
        cache.row_offsets(3, 401)
    with pytest.raises(KeyError, match="no field 'labels'"):
        cache.read_flat(0, 1, field="labels")
    with pytest.raises(CacheNotFoundError, match="no cache"):
        open_cache("memory://nothing/here")


def test_few_files(big_cache: tuple[CacheDataset, list[list[int]]]) -> None:
    cache, _ = big_cache
    files = sorted(str(p.relative_to(cache.location)) for p in Path(cache.location).rglob("*") if p.is_file())
    assert files == [
        "input_ids/data/c/0",
        "input_ids/data/zarr.json",
        "input_ids/offsets/c/0",
        "input_ids/offsets/zarr.json",
        "ledger.json",
    ]


def test_only_committed_rows_are_visible_and_chunks_refresh(tmp_path: Path) -> None:
    fields = {"input_ids": "int32"}
    writer = StoreWriter(str(tmp_path / "c"), fields, create=True)
    ledger = Ledger.new({"x": 1}, fields, ["s"])
    writer.commit(ledger)
    reader = open_cache(tmp_path / "c")
    assert len(reader) == 0
    assert not reader.is_finished
    expected: list[int] = []
    for step in range(4):
        new = [list(range(step * 10, step * 10 + 7)), [step] * 3]
        flat = np.array([t for r in new for t in r], dtype=np.int32)
        lengths = np.array([len(r) for r in new], dtype=np.int64)
        writer.append(ledger.rows, ledger.lengths, {"input_ids": (flat, lengths)})
        assert len(reader) == 2 * step  # written but not committed: invisible
        ledger.rows += 2
        ledger.lengths["input_ids"] += flat.size
        writer.commit(ledger)
        expected += flat.tolist()
        assert len(reader) == 2 * step + 2
        # The chunk read earlier was not complete; the reader must not serve stale data from it.
        assert reader.read_flat(0, len(expected)).tolist() == expected
    ledger.finished = True
    writer.commit(ledger)
    assert reader.is_finished


def test_wait_until(tmp_path: Path) -> None:
    fields = {"input_ids": "int32"}
    writer = StoreWriter(str(tmp_path / "c"), fields, create=True)
    ledger = Ledger.new({"x": 1}, fields, ["s"])
    writer.commit(ledger)
    reader = open_cache(tmp_path / "c")
    assert reader.wait_until(rows=0, timeout=0)
    assert reader.wait_until(rows=1, timeout=0.05) is False
    assert reader.wait_until(timeout=0.05) is False

    def grow() -> None:
        writer.append(0, {"input_ids": 0}, {"input_ids": (np.array([1, 2], np.int32), np.array([2], np.int64))})
        ledger.rows, ledger.lengths = 1, {"input_ids": 2}
        writer.commit(ledger)
        ledger.finished = True
        writer.commit(ledger)

    timer = threading.Timer(0.1, grow)
    timer.start()
    assert reader.wait_until(rows=1, timeout=30)
    assert reader.wait_until(rows=5, timeout=30)  # finished with fewer rows: the wait ends
    assert len(reader) == 1
    assert reader.is_finished
    timer.join()


def test_locations() -> None:
    assert kvstore_spec("memory://a/b") == {"driver": "memory", "path": "a/b/"}
    assert kvstore_spec("gs://bucket/some/dir") == {"driver": "gcs", "bucket": "bucket", "path": "some/dir/"}
    assert kvstore_spec("/tmp/x")["path"] == "/tmp/x/"
    with pytest.raises(ValueError, match="unsupported cache location 'ftp://x'"):
        kvstore_spec("ftp://x")
