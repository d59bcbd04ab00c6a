"""Sources: lists of named shards of raw records, each openable at a row.

A :class:`Source` says which shards exist (:attr:`Source.shard_names`) and reads one shard from a given row
(:meth:`Source.open_shard`). Reading never raises for bad input: a bad line, a truncated file or an unreadable
path comes out as a :class:`BadInput` in place of a record, and the builder applies its ``bad_records`` policy.
"""

from __future__ import annotations

import bz2
import glob as _glob
import gzip
import io
import json
import lzma
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol, runtime_checkable

from ponente.datacache._braces import expand_braces
from ponente.datacache.errors import INVALID_UTF8, MALFORMED_JSON, TRUNCATED_FILE, UNREADABLE_PATH
from ponente.datacache.storage import filesystem

Record = dict[str, Any]
"""A raw record: a JSON object, a parquet row, or ``{text_key: document}`` for text files."""


@dataclass(frozen=True)
class BadInput:
    """Bad input met while reading a shard, yielded in place of a record.

    Attributes:
        kind: One of :data:`ponente.datacache.errors.BAD_RECORD_KINDS`.
        location: File (shard) name and line or row, e.g. ``"data/a.jsonl, line 7"``.
        detail: What was expected and what was found.
    """

    kind: str
    location: str
    detail: str


SourceItem = tuple[int, "Record | BadInput", int]
"""``(row, record or bad input, size in bytes)`` as yielded by :meth:`Source.open_shard`.

A row of ``-1`` marks a problem with the whole rest of the shard (unreadable path, truncated or damaged
file); nothing follows it.
"""


@runtime_checkable
class Source(Protocol):
    """A list of named shards of records. Custom sources implement these three members."""

    @property
    def shard_names(self) -> Sequence[str]:
        """The shard names, in the order their rows appear in the cache."""
        ...

    def open_shard(self, name: str, row: int = 0) -> Iterator[SourceItem]:
        """Yield ``(row, record_or_bad_input, nbytes)`` for the rows of shard ``name`` from ``row`` on.

        Rows are numbered from 0 in the shard and include bad rows, so that ``open_shard(name, r)`` resumes
        exactly where a reader that consumed rows ``0..r-1`` stopped.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """A JSON-able description of the listing (names, sizes, options), part of the cache fingerprint."""
        ...

    def locate(self, name: str, row: int) -> str:
        """Where row ``row`` of shard ``name`` is, for messages, e.g. ``"a.jsonl, line 8"``."""
        ...


_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".txt": "txt",
    ".text": "txt",
    ".parquet": "parquet",
}
FORMATS = ("jsonl", "json", "txt", "parquet")
"""The file formats :class:`FileSource` reads."""


def infer_format(name: str) -> tuple[str, str | None]:
    """Return ``(format, compression)`` of a file from its extension, e.g. ``("jsonl", "gzip")``.

    Raises:
        ValueError: If the extension is not one of jsonl/ndjson/json/txt/parquet (optionally followed by
            .gz/.zst/.bz2/.xz).
    """
    stem, ext = os.path.splitext(name.lower())
    compression = _COMPRESSIONS.get(ext)
    if compression is not None:
        stem, ext = os.path.splitext(stem)
    if ext not in _FORMATS:
        raise ValueError(
            f"cannot infer the format of {name!r} from its extension {ext!r}: expected one of "
            f"{sorted(_FORMATS)} optionally followed by one of {sorted(_COMPRESSIONS)}; pass format=... to choose"
        )
    return _FORMATS[ext], compression


def expand_inputs(inputs: str | Sequence[str]) -> list[str]:
    """Expand braces and globs of local paths or fsspec URLs into a sorted-per-pattern list of files.

    Each input is brace-expanded (``train.{1..128}-of-128.jsonl.gz``, ``{a,b}``); a result containing glob
    characters (``*?[``) is matched against the file system and must match at least one file. Local paths
    become absolute. The order of the inputs (and of the brace expansion) is kept; each glob's matches are
    sorted; duplicates are dropped.

    Args:
        inputs: One or several paths, globs or URLs.

    Returns:
        The file names.

    Raises:
        FileNotFoundError: If a glob matches nothing.
        ValueError: If no input is given.
    """
    patterns = [inputs] if isinstance(inputs, str) else list(inputs)
    if not patterns:
        raise ValueError("no input given: pass at least one path, glob or URL")
    names: list[str] = []
    for pattern in patterns:
        for expanded in expand_braces(str(pattern)):
            local = "://" not in expanded or expanded.startswith("file://")
            if local:
                expanded = os.path.abspath(expanded.removeprefix("file://"))
            if not any(c in expanded for c in "*?["):
                names.append(expanded)
                continue
            if local:
                matches = sorted(p for p in _glob.glob(expanded) if os.path.isfile(p))
            else:
                fs, path = filesystem(expanded)
                matches = sorted(fs.unstrip_protocol(p) for p in fs.glob(path) if fs.isfile(p))
            if not matches:
                raise FileNotFoundError(f"input pattern {pattern!r} (expanded to {expanded!r}) matched no file")
            names.extend(matches)
    return list(dict.fromkeys(names))


class _ZstdReader(io.RawIOBase):
    """A zstd stream reader that raises ``EOFError`` on a truncated stream (zstandard's readers do not)."""

    def __init__(self, raw: IO[bytes]) -> None:
        import zstandard

        self._raw = raw
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._obj = self._new()
        self._in_frame = False
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while not self._pending:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise EOFError("compressed file ended before the end of the zstd frame (truncated file)")
                return 0
            while chunk:
                self._in_frame = True
                self._pending += self._obj.decompress(chunk)
                chunk = b""
                if self._obj.eof:
                    chunk = self._obj.unused_data
                    self._obj = self._new()
                    self._in_frame = False
        n = min(len(view), len(self._pending))
        view[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _zstd_error() -> type[Exception]:
    import zstandard

    return zstandard.ZstdError


def _open_binary(name: str, compression: str | None) -> IO[bytes]:
    fs, path = filesystem(name)  # an object store without its fsspec package: one line naming the extra
    raw: IO[bytes] = fs.open(path, "rb")
    if compression is None:
        return raw
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if compression == "bz2":
        return bz2.BZ2File(raw, "rb")
    if compression == "xz":
        return lzma.LZMAFile(raw, "rb")
    return io.BufferedReader(_ZstdReader(raw), buffer_size=1 << 20)


def _decode(data: bytes, location: str) -> str | BadInput:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadInput(
            INVALID_UTF8, location, f"expected UTF-8 text, found byte {data[exc.start]:#04x} at {exc.start}"
        )


def _parse_json(text: str, location: str) -> Any:
    """``json.loads(text)``, or a :class:`BadInput` for invalid JSON (nesting too deep for Python included)."""
    try:
        return json.loads(text)
    except ValueError as exc:
        return BadInput(MALFORMED_JSON, location, f"invalid JSON ({exc})")
    except RecursionError:
        return BadInput(MALFORMED_JSON, location, "JSON nested too deeply to parse")


def _json_record(value: Any, location: str) -> Record | BadInput:
    if isinstance(value, dict):
        return value
    return BadInput(MALFORMED_JSON, location, f"expected a JSON object, found {type(value).__name__}")


class FileSource:
    """Files in jsonl, json (an array of records), txt or parquet, optionally compressed, as a source.

    Each file is one shard. The format and compression (gz, zst, bz2, xz) come from the extension.

    Args:
        inputs: Paths, globs or fsspec URLs, with brace expansion (see :func:`expand_inputs`).
        text_key: The key under which text documents (format ``txt``) are put in records.
        txt_mode: ``"file"`` (one document per text file) or ``"line"`` (one document per line).
        format: Force a format instead of inferring it from each file's extension.

    Raises:
        ValueError: On an unknown format or txt mode, or an extension that names no format.
        FileNotFoundError: If a glob matches nothing.

    Examples:
        >>> source = FileSource("corpus/train.{0..1}.jsonl.gz")  # doctest: +SKIP
        >>> source.shard_names  # doctest: +SKIP
        ['/abs/corpus/train.0.jsonl.gz', '/abs/corpus/train.1.jsonl.gz']
    """

    def __init__(
        self, inputs: str | Sequence[str], *, text_key: str = "text", txt_mode: str = "file", format: str | None = None
    ) -> None:
        if txt_mode not in ("file", "line"):
            raise ValueError(f"txt_mode must be 'file' or 'line', found {txt_mode!r}")
        if format is not None and format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, found {format!r}")
        self.text_key = text_key
        self.txt_mode = txt_mode
        self._names = expand_inputs(inputs)
        self._kinds: dict[str, tuple[str, str | None]] = {}
        for name in self._names:
            inferred_format, compression = infer_format(name) if format is None else (format, None)
            if format is not None:
                compression = _COMPRESSIONS.get(os.path.splitext(name.lower())[1])
            self._kinds[name] = (inferred_format, compression)

    @property
    def shard_names(self) -> list[str]:
        """The files, in order."""
        return list(self._names)

    def describe(self) -> dict[str, Any]:
        """Names, sizes (``None`` if unreadable), formats and options: the listing part of the fingerprint."""
        shards = []
        for name in self._names:
            try:
                fs, path = filesystem(name)
                size: int | None = int(fs.size(path))
            except (OSError, ValueError):
                size = None
            shards.append([name, size, *self._kinds[name]])
        uses_text_key = any(kind[0] == "txt" for kind in self._kinds.values())
        options = {"txt_mode": self.txt_mode, "text_key": self.text_key} if uses_text_key else {}
        return {"type": "files", "shards": shards, **options}

    def locate(self, name: str, row: int) -> str:
        """``"NAME, line N"`` for line-based files, ``"NAME, record N"``/``"NAME, row N"`` for json/parquet."""
        fmt = self._kinds[name][0]
        if fmt == "jsonl" or (fmt == "txt" and self.txt_mode == "line"):
            return f"{name}, line {row + 1}"
        if fmt == "txt":
            return name
        return f"{name}, {'record' if fmt == 'json' else 'row'} {row}"

    def open_shard(self, name: str, row: int = 0) -> Iterator[SourceItem]:
        """Yield ``(row, record_or_bad_input, nbytes)`` from ``row`` on; see :meth:`Source.open_shard`."""
        if name not in self._kinds:
            raise KeyError(f"no shard named {name!r} in this source")
        fmt, compression = self._kinds[name]
        try:
            stream = _open_binary(name, compression)
        except (OSError, ValueError) as exc:
            yield -1, BadInput(UNREADABLE_PATH, name, f"cannot open: {exc}"), 0
            return
        try:
            with stream:
                if fmt == "parquet":
                    yield from self._parquet(name, stream, row)
                elif fmt == "json":
                    yield from self._json(name, stream, row)
                elif fmt == "txt" and self.txt_mode == "file":
                    yield from self._text_file(name, stream, row)
                else:
                    yield from self._lines(name, stream, row, jsonl=fmt == "jsonl")
        except (EOFError, OSError, ValueError, zlib.error, lzma.LZMAError, _zstd_error()) as exc:
            # Raised mid-stream by the decompressors (truncation, corrupt data: gzip raises zlib.error, which is
            # neither an OSError nor a ValueError) or the file system.
            kind = TRUNCATED_FILE if compression or fmt == "parquet" else UNREADABLE_PATH
            yield -1, BadInput(kind, name, f"reading stopped with {type(exc).__name__}: {exc}"), 0

    def _lines(self, name: str, stream: IO[bytes], start: int, *, jsonl: bool) -> Iterator[SourceItem]:
        for row, line in enumerate(stream):
            if row < start:
                continue
            location = f"{name}, line {row + 1}"
            text = _decode(line, location)
            if isinstance(text, BadInput):
                yield row, text, len(line)
                continue
            if not jsonl:
                yield row, {self.text_key: text.removesuffix("\n").removesuffix("\r")}, len(line)
                continue
            if not text.strip():
                yield row, BadInput("blank_line", location, "blank line"), len(line)
                continue
            value = _parse_json(text, location)
            yield row, value if isinstance(value, BadInput) else _json_record(value, location), len(line)

    def _text_file(self, name: str, stream: IO[bytes], start: int) -> Iterator[SourceItem]:
        if start > 0:
            return
        data = stream.read()
        text = _decode(data, name)
        yield 0, text if isinstance(text, BadInput) else {self.text_key: text}, len(data)

    def _json(self, name: str, stream: IO[bytes], start: int) -> Iterator[SourceItem]:
        data = stream.read()
        text = _decode(data, name)
        if isinstance(text, BadInput):
            yield -1, text, len(data)
            return
        values = _parse_json(text, name)
        if isinstance(values, BadInput):
            yield -1, values, len(data)
            return
        if not isinstance(values, list):
            found = type(values).__name__
            yield -1, BadInput(MALFORMED_JSON, name, f"expected a JSON array of records, found {found}"), len(data)
            return
        size = len(data) // max(1, len(values))
        for row in range(start, len(values)):
            yield row, _json_record(values[row], f"{name}, record {row}"), size

    def _parquet(self, name: str, stream: IO[bytes], start: int) -> Iterator[SourceItem]:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(stream)
        except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) or OSError on damaged files
            yield -1, BadInput(TRUNCATED_FILE, name, f"not a readable parquet file ({exc})"), 0
            return
        first = 0
        for group in range(parquet.num_row_groups):
            try:
                count = parquet.metadata.row_group(group).num_rows
                if first + count <= start:
                    first += count
                    continue
                table = parquet.read_row_group(group)
                size = table.nbytes // max(1, count)
                records = table.to_pylist()
            except Exception as exc:  # damaged pages: ArrowInvalid, ArrowNotImplementedError, ArrowTypeError, ...
                where = f"{name}, row group {group}"
                yield -1, BadInput(TRUNCATED_FILE, where, f"reading stopped with {type(exc).__name__}: {exc}"), 0
                return
            for offset, record in enumerate(records):
                if first + offset >= start:
                    yield first + offset, record, size
            first += count
