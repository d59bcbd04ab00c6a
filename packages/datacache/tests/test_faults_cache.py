"""Damaged caches: a flipped byte in a shard file is found before its rows are used, and ``verify`` reports it."""

from __future__ import annotations

import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ponente.datacache import CacheCorruptError, PassthroughProcessor, build_cache, open_cache
from ponente.datacache.cli import main
from ponente.datacache.source import SourceItem
from ponente.datacache.store import CHUNK_ELEMENTS, SHARD_ELEMENTS
from ponente.datacache.token_seq import TokenSeqDataset
from ponente.datacache.verify import verify_cache

_CHUNKS_PER_SHARD = SHARD_ELEMENTS // CHUNK_ELEMENTS


class _Rows:
    """An in-memory source of pre-tokenized rows (one shard)."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    @property
    def shard_names(self) -> list[str]:
        return ["rows"]

    def open_shard(self, name: str, row: int = 0) -> Iterator[SourceItem]:
        for i in range(row, len(self.rows)):
            yield i, {"input_ids": self.rows[i]}, 4 * len(self.rows[i])

    def describe(self) -> dict[str, Any]:
        return {"type": "rows", "count": len(self.rows)}

    def locate(self, name: str, row: int) -> str:
        return f"{name}[{row}]"


@pytest.fixture(scope="module")
def sound(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A finished cache of ~3.5 chunks of tokens (random ids, so zstd cannot shrink a chunk to nothing)."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 50_000, size=int(rng.integers(100, 1000))).tolist() for _ in range(420)]
    out = tmp_path_factory.mktemp("faults") / "cache"
    build_cache(_Rows(rows), out, processor=PassthroughProcessor(), workers=0, progress=False, batch_rows=50)
    return out, rows


def _chunk_extents(shard: Path) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of every chunk of a zarr3 shard file, read from its index (at the end of the file).

    The index is ``_CHUNKS_PER_SHARD`` little-endian uint64 pairs followed by a 4-byte crc32c; an absent chunk
    has offset and size 2**64 - 1.
    """
    raw = shard.read_bytes()
    index = raw[-(16 * _CHUNKS_PER_SHARD + 4) : -4]
    pairs = struct.unpack(f"<{2 * _CHUNKS_PER_SHARD}Q", index)
    return [(pairs[2 * i], pairs[2 * i + 1]) for i in range(_CHUNKS_PER_SHARD) if pairs[2 * i] != 2**64 - 1]


def _flip_in_chunk(location: Path, chunk: int) -> Path:
    """Flip one byte in the middle of data chunk ``chunk`` of ``input_ids``; returns the shard file."""
    shard = location / "input_ids/data/c/0"
    offset, nbytes = _chunk_extents(shard)[chunk]
    data = bytearray(shard.read_bytes())
    data[offset + nbytes // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard


def _damaged_copy(sound: tuple[Path, list[list[int]]], tmp_path: Path, chunk: int) -> tuple[Path, Path]:
    location = tmp_path / "damaged"
    shutil.copytree(sound[0], location)
    return location, _flip_in_chunk(location, chunk)


def test_sound_cache_reads_and_verifies(sound: tuple[Path, list[list[int]]]) -> None:
    location, rows = sound
    cache = open_cache(location)
    assert cache.num_tokens() > 3 * CHUNK_ELEMENTS  # the flips below land in chunks 1 and 3
    assert len(_chunk_extents(location / "input_ids/data/c/0")) == -(-cache.num_tokens() // CHUNK_ELEMENTS)
    assert [r["input_ids"].tolist() for r in cache.get_batch(range(len(cache)))] == rows
    assert verify_cache(str(location)) == []


def test_flipped_byte_raises_naming_the_shard_before_the_rows_are_used(
    sound: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    location, shard = _damaged_copy(sound, tmp_path, chunk=1)
    rows = sound[1]
    starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    hit = int(np.searchsorted(starts, CHUNK_ELEMENTS + CHUNK_ELEMENTS // 2, side="right")) - 1  # a row in chunk 1
    cache = open_cache(location)
    assert cache[0]["input_ids"].tolist() == rows[0]  # chunk 0 is intact and still reads
    with pytest.raises(CacheCorruptError, match=rf"field 'input_ids' \(data\) is damaged in shard file {shard}"):
        cache[hit]
    # the training view of the cache (fixed-length token windows) fails the same way, never yields the bytes
    windows = TokenSeqDataset(open_cache(location), seq_len=64)
    with pytest.raises(CacheCorruptError, match=str(shard)):
        windows[(CHUNK_ELEMENTS + CHUNK_ELEMENTS // 2) // 64]


@pytest.mark.parametrize("chunk", [1, 3])
def test_verify_reads_every_chunk(sound: tuple[Path, list[list[int]]], tmp_path: Path, chunk: int) -> None:
    location, shard = _damaged_copy(sound, tmp_path, chunk)
    problems = verify_cache(str(location))
    assert len(problems) == 1, problems
    assert str(shard) in problems[0], problems


def test_verify_reports_a_missing_shard_file(sound: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    location = tmp_path / "missing"
    shutil.copytree(sound[0], location)
    (location / "input_ids/data/c/0").unlink()  # reads of a missing shard give the fill value, zeros, silently
    assert open_cache(location)[0]["input_ids"].tolist() == [0] * len(sound[1][0])
    problems = verify_cache(str(location))
    assert problems == [f"field 'input_ids': shard file {location}/input_ids/data/c/0 is missing"]


def test_cli_verify_exits_1_naming_the_shard(
    sound: tuple[Path, list[list[int]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(sound[0])]) == 0
    capsys.readouterr()
    location, shard = _damaged_copy(sound, tmp_path, chunk=2)
    assert main(["verify", str(location)]) == 1
    assert str(shard) in capsys.readouterr().out
