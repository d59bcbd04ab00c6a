"""Sources: formats, compressions, globs/braces, opening at a row, and bad input as BadInput items."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from ponente.datacache import BadInput, FileSource, expand_inputs
from ponente.datacache.errors import BLANK_LINE, INVALID_UTF8, MALFORMED_JSON, TRUNCATED_FILE, UNREADABLE_PATH
from ponente.datacache.source import infer_format

DOCS = ["first document", "zweites Dokument ünï", "東京 third", 'a\ttab and "quotes"', "last one"]
COMPRESS = {
    "": lambda b: b,
    ".gz": gzip.compress,
    ".zst": lambda b: zstandard.ZstdCompressor().compress(b),
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
}


def _encode(fmt: str) -> bytes:
    if fmt == "jsonl":
        return "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)).encode()
    if fmt == "json":
        return json.dumps([{"text": d} for d in DOCS]).encode()
    return "\n".join(DOCS).encode() + b"\n"


def _texts(source: FileSource, name: str, row: int = 0) -> list[str]:
    out = []
    for _, record, _ in source.open_shard(name, row):
        assert not isinstance(record, BadInput), record
        out.append(record["text"])
    return out


@pytest.mark.parametrize("ext", list(COMPRESS))
@pytest.mark.parametrize("fmt", ["jsonl", "json", "txt"])
def test_text_formats_and_compressions(tmp_path: Path, fmt: str, ext: str) -> None:
    path = tmp_path / f"data.{fmt}{ext}"
    path.write_bytes(COMPRESS[ext](_encode(fmt)))
    assert infer_format(str(path))[0] == fmt
    mode = "line" if fmt == "txt" else "file"
    source = FileSource(str(path), txt_mode=mode)
    assert _texts(source, source.shard_names[0]) == DOCS
    assert _texts(source, source.shard_names[0], row=3) == DOCS[3:]


@pytest.mark.parametrize("ext", list(COMPRESS))
def test_txt_one_document_per_file(tmp_path: Path, ext: str) -> None:
    for i, doc in enumerate(DOCS):
        (tmp_path / f"doc{i}.txt{ext}").write_bytes(COMPRESS[ext]((doc + "\nsecond line").encode()))
    source = FileSource(str(tmp_path / f"doc*.txt{ext}"), txt_mode="file", text_key="body")
    assert len(source.shard_names) == len(DOCS)
    for name, doc in zip(source.shard_names, DOCS):
        [(row, record, _)] = list(source.open_shard(name))
        assert row == 0
        assert record == {"body": doc + "\nsecond line"}


def test_parquet_by_row_group_and_row(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    table = pa.table({"text": DOCS, "n": list(range(len(DOCS)))})
    pq.write_table(table, path, row_group_size=2)
    source = FileSource(str(path))
    name = source.shard_names[0]
    assert _texts(source, name) == DOCS
    for row in range(len(DOCS) + 1):
        items = list(source.open_shard(name, row))
        assert [r for r, _, _ in items] == list(range(row, len(DOCS)))
        assert [rec["n"] for _, rec, _ in items] == list(range(row, len(DOCS)))  # type: ignore[index]


def test_globs_and_braces_order(tmp_path: Path) -> None:
    for i in range(1, 13):
        (tmp_path / f"train.{i:02d}-of-12.jsonl").write_text("{}\n")
    names = expand_inputs(str(tmp_path / "train.{01..12}-of-12.jsonl"))
    assert names == [str(tmp_path / f"train.{i:02d}-of-12.jsonl") for i in range(1, 13)]
    globbed = expand_inputs(str(tmp_path / "train.*-of-12.jsonl"))
    assert globbed == sorted(names)
    mixed = expand_inputs([str(tmp_path / "train.1{1,0}-of-12.jsonl"), str(tmp_path / "train.0[12]-of-12.jsonl")])
    assert [Path(n).name for n in mixed] == [
        "train.11-of-12.jsonl",
        "train.10-of-12.jsonl",
        "train.01-of-12.jsonl",
        "train.02-of-12.jsonl",
    ]
    with pytest.raises(FileNotFoundError, match="matched no file"):
        expand_inputs(str(tmp_path / "nothing*.jsonl"))


def test_fsspec_memory_url() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    for i in range(3):
        with fs.open(f"/corpus/part{i}.jsonl.gz", "wb") as f:
            f.write(gzip.compress(json.dumps({"text": DOCS[i]}).encode() + b"\n"))
    source = FileSource("memory://corpus/part{0..2}.jsonl.gz")
    assert [_texts(source, n) for n in source.shard_names] == [[d] for d in DOCS[:3]]
    globbed = FileSource("memory://corpus/part*.jsonl.gz")
    assert [n.split("/corpus/")[1] for n in globbed.shard_names] == [f"part{i}.jsonl.gz" for i in range(3)]
    assert all(n.startswith("memory://") for n in globbed.shard_names)
    assert [_texts(globbed, n) for n in globbed.shard_names] == [[d] for d in DOCS[:3]]


def test_unknown_extension_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("x")
    with pytest.raises(ValueError, match=r"data\.csv.*\.csv"):
        FileSource(str(tmp_path / "data.csv"))
    assert FileSource(str(tmp_path / "data.csv"), format="txt").shard_names


def _items(path: Path) -> list[tuple[int, object]]:
    source = FileSource(str(path), txt_mode="line")
    return [(row, item) for row, item, _ in source.open_shard(source.shard_names[0])]


def test_bad_lines_are_reported_with_their_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": \n\n{"text": "\xff\xfe"}\n[1, 2]\n{"text": "end"}\n')
    items = _items(path)
    assert [row for row, _ in items] == [0, 1, 2, 3, 4, 5]
    kinds = [item.kind if isinstance(item, BadInput) else "ok" for _, item in items]
    assert kinds == ["ok", MALFORMED_JSON, BLANK_LINE, INVALID_UTF8, MALFORMED_JSON, "ok"]
    bad = items[1][1]
    assert isinstance(bad, BadInput)
    assert bad.location == f"{path}, line 2"


@pytest.mark.parametrize("ext", [".gz", ".zst", ".bz2", ".xz"])
def test_truncated_compressed_file(tmp_path: Path, ext: str) -> None:
    raw = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(400)).encode()
    data = COMPRESS[ext](raw)
    path = tmp_path / f"cut.jsonl{ext}"
    path.write_bytes(data[: len(data) * 2 // 3])
    items = _items(path)
    last = items[-1][1]
    assert isinstance(last, BadInput)
    assert last.kind == TRUNCATED_FILE
    assert items[-1][0] == -1
    good = [item for _, item in items[:-1]]
    assert all(isinstance(item, dict) for item in good)
    assert len(good) < 400


def test_unreadable_path(tmp_path: Path) -> None:
    [(row, item)] = _items(tmp_path / "missing.jsonl")
    assert row == -1
    assert isinstance(item, BadInput)
    assert item.kind == UNREADABLE_PATH
    assert "missing.jsonl" in item.location


def test_zstd_with_several_frames(tmp_path: Path) -> None:
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(b"".join(compressor.compress(json.dumps({"text": d}).encode() + b"\n") for d in DOCS))
    source = FileSource(str(path))
    assert _texts(source, source.shard_names[0]) == DOCS
