"""Fuzzing the file readers: random and damaged bytes never hang and never raise, they come out as BadInput.

The contract (module docstring of :mod:`ponente.datacache.source`): :meth:`FileSource.open_shard` yields
``(row, record | BadInput, nbytes)`` for any content; a damaged stream ends with one ``row == -1`` item.
Each example runs under a SIGALRM time limit, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import atexit
import bz2
import gzip
import io
import json
import lzma
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ponente.datacache import BadInput, FileSource, build_cache
from ponente.datacache.errors import MALFORMED_JSON, SKIP_KINDS, BadRecordError
from ponente.datacache.testing import time_limit

EXAMPLE_SECONDS = 10
# per (format, compression) pair: 25 pairs x 30 examples per test; the single-strategy tests take 150
FUZZ_EACH = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
FUZZ = settings(FUZZ_EACH, max_examples=150)
COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "": lambda b: b,
    ".gz": gzip.compress,
    ".zst": lambda b: zstandard.ZstdCompressor().compress(b),
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
}
# (file suffix, txt_mode)
FORMATS = [(".jsonl", "file"), (".json", "file"), (".txt", "file"), (".txt", "line"), (".parquet", "file")]


_DIR = Path(tempfile.mkdtemp(prefix="ponente-fuzz-readers-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)


def read_all(data: bytes, suffix: str, txt_mode: str = "file", start: int = 0) -> list[tuple[int, Any, int]]:
    """Write ``data`` to a file named ``*suffix``, read it with FileSource, and check the item contract."""
    path = _DIR / f"shard{suffix}"
    path.write_bytes(data)
    source = FileSource(str(path), txt_mode=txt_mode)
    with time_limit(EXAMPLE_SECONDS):
        items = list(source.open_shard(source.shard_names[0], start))
    for i, (row, record, nbytes) in enumerate(items):
        assert isinstance(row, int)
        assert isinstance(nbytes, int)
        assert nbytes >= 0
        if isinstance(record, BadInput):
            assert record.kind in SKIP_KINDS, record
            assert str(path) in record.location
        else:
            assert isinstance(record, dict), record
        if row == -1:
            assert isinstance(record, BadInput)
            assert i == len(items) - 1, "row -1 must be the last item"
        else:
            assert row >= start
    rows = [row for row, _, _ in items if row != -1]
    assert rows == sorted(set(rows)), "rows must increase"
    return items


def _parquet_bytes(texts: list[str]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), sink, row_group_size=4)
    return sink.getvalue()


def _valid(suffix: str, docs: list[str]) -> bytes:
    if suffix == ".jsonl":
        return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    if suffix == ".json":
        return json.dumps([{"text": d} for d in docs]).encode()
    if suffix == ".parquet":
        return _parquet_bytes(docs)
    return "\n".join(docs).encode()


@pytest.mark.parametrize("compression", list(COMPRESS))
@pytest.mark.parametrize(("suffix", "txt_mode"), FORMATS)
@FUZZ_EACH
@given(data=st.binary(max_size=2048))
@example(data=b"[" * 100_000)  # deeper than Python's recursion limit
@example(data=b'{"a": ' + b"[" * 100_000 + b"\n")
@example(data=b"\xff\xfe\x00")
@example(data=b"PAR1" + bytes(64) + b"PAR1")
def test_random_bytes_never_raise(suffix: str, txt_mode: str, compression: str, data: bytes) -> None:
    # random bytes as the stored file (not a valid stream when compressed: tests the decompressors' errors)
    read_all(data, suffix + compression, txt_mode)
    # and the same bytes as valid compressed content (tests the format readers behind each decompressor)
    read_all(COMPRESS[compression](data), suffix + compression, txt_mode)


@pytest.mark.parametrize("compression", list(COMPRESS))
@pytest.mark.parametrize(("suffix", "txt_mode"), FORMATS)
@FUZZ_EACH
@given(
    docs=st.lists(st.text(max_size=40), min_size=1, max_size=12),
    flips=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(1, 255)), max_size=4),
    cut=st.none() | st.integers(0, 1 << 30),
    start=st.integers(0, 3),
)
def test_damaged_files_never_raise(
    suffix: str,
    txt_mode: str,
    compression: str,
    docs: list[str],
    flips: list[tuple[int, int]],
    cut: int | None,
    start: int,
) -> None:
    """Valid files with flipped bytes or truncated: the damage reaches deep into the decoders."""
    data = bytearray(COMPRESS[compression](_valid(suffix, docs)))
    for position, xor in flips if data else []:
        data[position % len(data)] ^= xor
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    read_all(bytes(data), suffix + compression, txt_mode, start)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


@FUZZ
@given(lines=st.lists(json_values | st.text(max_size=30), max_size=10), compression=st.sampled_from(list(COMPRESS)))
def test_jsonl_structures_match_json_loads(lines: list[Any], compression: str) -> None:
    """Random JSON (and non-JSON) lines: objects become records equal to ``json.loads``, the rest BadInput."""
    encoded = [json.dumps(v) if not isinstance(v, str) else v.replace("\n", " ").replace("\r", " ") for v in lines]
    text = "".join(line + "\n" for line in encoded)
    items = read_all(COMPRESS[compression](text.encode()), ".jsonl" + compression)
    assert [row for row, _, _ in items] == list(range(len(encoded)))
    for (_, record, _), line in zip(items, encoded):
        try:
            expected: Any = json.loads(line) if line.strip() else None
        except ValueError:
            expected = None
        if isinstance(expected, dict):
            assert record == expected
        else:
            assert isinstance(record, BadInput)
            if line.strip():
                assert record.kind == MALFORMED_JSON


def test_the_fuzzing_catches_an_escaping_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the reader's error handling a damaged gzip stream escapes as ``zlib.error``: the check matters."""
    import zlib

    import ponente.datacache.source as source_module

    good = gzip.compress(b'{"text": "x"}\n' * 200)
    damaged = good[:10] + bytes([good[10] ^ 0xFF]) + good[11:]  # the first deflate byte
    items = read_all(damaged, ".jsonl.gz")
    assert items[-1][0] == -1
    assert isinstance(items[-1][1], BadInput)
    monkeypatch.setattr(source_module, "zlib", type("NoZlib", (), {"error": type("Never", (Exception,), {})}))
    with pytest.raises(zlib.error):
        read_all(damaged, ".jsonl.gz")


records = (
    st.fixed_dictionaries({"text": st.text(max_size=20)})
    | st.fixed_dictionaries({"text": json_values})
    | json_values
    | st.text(max_size=30)
)


@settings(FUZZ, max_examples=25)
@given(lines=st.lists(records, max_size=8), compression=st.sampled_from(["", ".gz", ".zst"]))
def test_builder_raises_only_bad_record_errors(tokenizer_path: Path, lines: list[Any], compression: str) -> None:
    """Through ``build_cache``: ``bad_records="error"`` raises only BadRecordError; ``"skip"`` keeps the good rows."""
    encoded = [json.dumps(v) if not isinstance(v, str) else v.replace("\n", " ").replace("\r", " ") for v in lines]
    text = "".join(line + "\n" for line in encoded)
    good = 0
    for line in encoded:
        try:
            value = json.loads(line)
        except ValueError:
            continue
        good += isinstance(value, dict) and isinstance(value.get("text"), str) and value["text"] != ""
    shard = _DIR / f"build.jsonl{compression}"
    shard.write_bytes(COMPRESS[compression](text.encode()))
    out = Path(tempfile.mkdtemp(dir=_DIR))
    error: BadRecordError | None = None
    with time_limit(60):
        try:
            strict = build_cache(str(shard), out / "error", tokenizer=tokenizer_path, workers=0, progress=False)
        except BadRecordError as e:
            error = e
        skipping = build_cache(
            str(shard), out / "skip", tokenizer=tokenizer_path, workers=0, progress=False, bad_records="skip"
        )
    if error is None:
        assert len(strict) == good
    else:
        assert str(shard) in str(error)
        assert "\n" not in str(error)
    assert len(skipping) == good
    assert sum(skipping.ledger.skipped.values()) == len(encoded) - good
    shutil.rmtree(out)
