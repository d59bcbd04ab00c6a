"""The on-disk cache: jagged arrays in TensorStore zarr3 plus a JSON ledger, and the reader over it.

Layout of a cache at ``LOCATION`` (a local directory, ``memory://name``, ``gs://bucket/path`` or
``s3://bucket/path``)::

    LOCATION/ledger.json             commit pointer, per-shard progress, skips, fingerprint
    LOCATION/<field>/data/...        zarr3 int array: all rows of the field, concatenated
    LOCATION/<field>/offsets/...     zarr3 int64 array: row i spans data[offsets[i]:offsets[i+1]]

Both arrays have a fixed capacity of 2**40 elements (so their metadata never changes), 2**22-element shards
(one file each) of 2**16-element chunks compressed with zstd and checked with crc32c. Only the ledger says
how much of them is committed.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from ponente.datacache.dataset import Dataset
from ponente.datacache.errors import CacheCorruptError, CacheNotFoundError
from ponente.datacache.ledger import LEDGER_KEY, Ledger

CAPACITY = 1 << 40
SHARD_ELEMENTS = 1 << 22
CHUNK_ELEMENTS = 1 << 16

_CONTEXT = ts.Context()  # shared, so that every open of memory://name in this process sees the same store


def kvstore_spec(location: str) -> dict[str, Any]:
    """TensorStore kvstore spec (a directory, with a trailing slash) for a cache location.

    Delegates to :func:`ponente.datacache.storage.kvstore_spec`, which also reads the object-store
    endpoint and credentials from the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``, ...).

    Args:
        location: A local path, ``file://path``, ``memory://name``, ``gs://bucket/path`` or ``s3://bucket/path``.

    Raises:
        ValueError: For any other URL scheme.
    """
    from .storage import kvstore_spec as _storage_kvstore_spec

    return _storage_kvstore_spec(location, what="cache location")


def _subspec(base: dict[str, Any], key: str) -> dict[str, Any]:
    return {**base, "path": base["path"] + key + "/"}


def _array_spec(base: dict[str, Any], field: str, part: str, dtype: str) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": _subspec(base, f"{field}/{part}"),
        "metadata": {
            "shape": [CAPACITY],
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [SHARD_ELEMENTS]}},
            "chunk_key_encoding": {"name": "default"},
            "fill_value": 0,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [CHUNK_ELEMENTS],
                        "codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "zstd", "configuration": {"level": 1}},
                            {"name": "crc32c"},
                        ],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    },
                }
            ],
        },
    }


def shard_file(location: str, field: str, part: str, element: int) -> str:
    """The shard file (one per :data:`SHARD_ELEMENTS` elements) that holds ``element`` of a field's array.

    Args:
        location: The cache location.
        field: The field, e.g. ``"input_ids"``.
        part: ``"data"`` or ``"offsets"``.
        element: An index into the array.
    """
    return f"{location.rstrip('/')}/{field}/{part}/c/{element // SHARD_ELEMENTS}"


def _is_damage(exc: ValueError) -> bool:
    """Whether a TensorStore read error says the stored bytes are damaged (not, say, that a server is down)."""
    text = str(exc)
    return text.startswith(("DATA_LOSS", "FAILED_PRECONDITION")) or "Digest mismatch" in text or "decod" in text


def _read_checked(array: ts.TensorStore, lo: int, hi: int, location: str, field: str, part: str) -> np.ndarray:
    """``array[lo:hi]``, a checksum or decoding failure raised as :class:`CacheCorruptError` naming the shard."""
    try:
        return np.asarray(array[lo:hi].read().result())
    except ValueError as exc:
        if not _is_damage(exc):
            raise
        detail = str(exc).splitlines()[0]
        raise CacheCorruptError(
            f"cache {location}: field {field!r} ({part}) is damaged in shard file "
            f"{shard_file(location, field, part, lo)}: {detail}; rebuild the cache (ponente-cache verify "
            f"{location} checks all of it)"
        ) from exc


def _open_kvstore(location: str) -> ts.KvStore:
    return ts.KvStore.open(kvstore_spec(location), context=_CONTEXT).result()


def read_ledger(location: str) -> Ledger | None:
    """The ledger of the cache at ``location``, or ``None`` if there is none."""
    result = _open_kvstore(location).read(LEDGER_KEY).result()
    if result.state != "value":
        return None
    return Ledger.from_bytes(result.value, f"{location}/{LEDGER_KEY}")


def remove_stale_locks(location: str) -> None:
    """Delete TensorStore ``*.__lock`` temporary files a killed writer may have left in a local cache."""
    spec = kvstore_spec(location)
    if spec["driver"] != "file":
        return
    for root, _, files in os.walk(spec["path"]):
        for name in files:
            if name.endswith(".__lock"):
                os.remove(os.path.join(root, name))


class StoreWriter:
    """Appends rows to the arrays of a cache and commits ledgers. Used by the builder; one writer at a time."""

    def __init__(self, location: str, fields: Mapping[str, str], *, create: bool, keep: str | None = None) -> None:
        """Open the arrays of the cache at ``location``; with ``create``, first delete everything there.

        ``keep`` is a key prefix that ``create`` leaves in place (the builder's lease, ``builder.lease``).
        """
        self.location = location
        base = kvstore_spec(location)
        self._kv = _open_kvstore(location)
        remove_stale_locks(location)
        if create and keep:
            after = keep[:-1] + chr(ord(keep[-1]) + 1)  # the first key past every key starting with ``keep``
            self._kv.delete_range(ts.KvStore.KeyRange(exclusive_max=keep)).result()
            self._kv.delete_range(ts.KvStore.KeyRange(inclusive_min=after)).result()
        elif create:
            self._kv.delete_range(ts.KvStore.KeyRange()).result()
        self._arrays: dict[str, tuple[ts.TensorStore, ts.TensorStore]] = {}
        for field, dtype in fields.items():
            pair = []
            for part, part_dtype in (("data", dtype), ("offsets", "int64")):
                spec = _array_spec(base, field, part, part_dtype)
                pair.append(ts.open(spec, context=_CONTEXT, create=create, open=not create).result())
            self._arrays[field] = (pair[0], pair[1])

    def append(
        self, rows: int, lengths: Mapping[str, int], batch: Mapping[str, tuple[np.ndarray, np.ndarray]]
    ) -> None:
        """Write rows after the first ``rows`` rows; does not commit them.

        Args:
            rows: Committed rows so far.
            lengths: Committed flat length of each field so far.
            batch: Per field, ``(flat, row_lengths)`` of the new rows.
        """
        futures = []
        for field, (flat, row_lengths) in batch.items():
            if len(row_lengths) == 0:
                continue
            data, offsets = self._arrays[field]
            start = lengths[field]
            if len(flat):
                futures.append(data[start : start + len(flat)].write(flat))
            ends = start + np.cumsum(row_lengths, dtype=np.int64)
            futures.append(offsets[rows + 1 : rows + 1 + len(ends)].write(ends))
        for future in futures:
            future.result()

    def commit(self, ledger: Ledger) -> None:
        """Atomically replace the ledger: this is what makes appended rows visible to readers."""
        self._kv.write(LEDGER_KEY, ledger.to_bytes()).result()


class _LruBlocks:
    """A thread-safe LRU of immutable decoded chunks, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._bytes = 0
        self._blocks: collections.OrderedDict[tuple[str, int], np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> np.ndarray | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def put(self, key: tuple[str, int], block: np.ndarray) -> None:
        with self._lock:
            if key in self._blocks:
                return
            self._blocks[key] = block
            self._bytes += block.nbytes
            while self._bytes > self._max and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self._bytes -= old.nbytes


class CacheDataset(Dataset[dict[str, np.ndarray]]):
    """A cache opened for reading: a random-access dataset of rows, each a dict of NumPy arrays.

    Use :func:`open_cache` to get one. Rows appear as the builder commits them (``len`` grows) until the
    cache :attr:`is_finished`. Also provides the flat-array access (:meth:`num_tokens`, :meth:`read_flat`,
    :meth:`row_offsets`, :meth:`wait_until`) that token-window datasets build on. Decoded chunks of committed
    data are kept in an LRU cache of ``cache_bytes``.

    Thread-safe for reading.
    """

    def __init__(self, location: str, *, cache_bytes: int = 256 << 20) -> None:
        self.location = str(location)
        self._kv = _open_kvstore(self.location)
        ledger = self._read_ledger()
        if ledger is None:
            raise CacheNotFoundError(f"no cache at {self.location!r}: it has no {LEDGER_KEY}")
        self._ledger = ledger
        base = kvstore_spec(self.location)
        futures = {
            (field, part): ts.open(
                {"driver": "zarr3", "kvstore": _subspec(base, f"{field}/{part}")}, context=_CONTEXT, open=True
            )
            for field in ledger.fields
            for part in ("data", "offsets")
        }
        self._arrays: dict[str, tuple[ts.TensorStore, ts.TensorStore]] = {
            field: (futures[field, "data"].result(), futures[field, "offsets"].result()) for field in ledger.fields
        }
        self._blocks = _LruBlocks(cache_bytes)
        self._lock = threading.Lock()

    def _read_ledger(self) -> Ledger | None:
        result = self._kv.read(LEDGER_KEY).result()
        if result.state != "value":
            return None
        return Ledger.from_bytes(result.value, f"{self.location}/{LEDGER_KEY}")

    def refresh(self) -> Ledger:
        """Re-read the ledger (a no-op once finished) and return it."""
        if not self._ledger.finished:
            ledger = self._read_ledger()
            if ledger is not None and ledger.rows >= self._ledger.rows:
                with self._lock:
                    self._ledger = ledger
        return self._ledger

    @property
    def ledger(self) -> Ledger:
        """The ledger as last read."""
        return self._ledger

    @property
    def fields(self) -> dict[str, str]:
        """Field names and dtypes, e.g. ``{"input_ids": "int32"}``."""
        return dict(self._ledger.fields)

    @property
    def is_finished(self) -> bool:
        """Whether the build finished (the cache will not grow)."""
        return self.refresh().finished

    def __len__(self) -> int:
        """Committed rows (re-reads the ledger while the cache is being built)."""
        return self.refresh().rows

    def num_tokens(self, field: str = "input_ids") -> int:
        """Committed length of ``field``'s flat data array."""
        self._check_field(field)
        return self.refresh().lengths[field]

    def _check_field(self, field: str) -> None:
        if field not in self._arrays:
            raise KeyError(f"cache {self.location!r} has no field {field!r}; its fields are {sorted(self._arrays)}")

    def _read(self, field: str, part: str, start: int, stop: int, committed: int, finished: bool) -> np.ndarray:
        array = self._arrays[field][0 if part == "data" else 1]
        first, last = start // CHUNK_ELEMENTS, (stop - 1) // CHUNK_ELEMENTS
        pieces = []
        for chunk in range(first, last + 1):
            lo = chunk * CHUNK_ELEMENTS
            hi = min(lo + CHUNK_ELEMENTS, committed)
            immutable = finished or lo + CHUNK_ELEMENTS <= committed
            block = self._blocks.get((field + part, chunk)) if immutable else None
            if block is None:
                if not immutable:
                    pieces.append(_read_checked(array, max(start, lo), min(stop, hi), self.location, field, part))
                    continue
                block = _read_checked(array, lo, hi, self.location, field, part)
                self._blocks.put((field + part, chunk), block)
            pieces.append(block[max(start, lo) - lo : min(stop, hi) - lo])
        return pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces)

    def read_flat(self, start: int, stop: int, field: str = "input_ids") -> np.ndarray:
        """``flat[start:stop]`` of ``field``'s data array (committed part only).

        Raises:
            IndexError: If ``0 <= start <= stop <= num_tokens(field)`` does not hold.
            CacheCorruptError: If a chunk's checksum does not match (the message names the shard file).
        """
        self._check_field(field)
        ledger = self._ledger
        if not 0 <= start <= stop <= ledger.lengths[field]:
            ledger = self.refresh()
            if not 0 <= start <= stop <= ledger.lengths[field]:
                raise IndexError(
                    f"read_flat({start}, {stop}) on field {field!r} of {self.location!r}: expected "
                    f"0 <= start <= stop <= {ledger.lengths[field]} (committed length)"
                )
        if start == stop:
            return np.empty(0, dtype=ledger.fields[field])
        return self._read(field, "data", start, stop, ledger.lengths[field], ledger.finished)

    def row_offsets(self, start_row: int, stop_row: int, field: str = "input_ids") -> np.ndarray:
        """Offsets of rows ``start_row..stop_row`` (inclusive) into ``field``'s flat array, as int64.

        Row ``i`` spans ``flat[off[i - start_row]:off[i - start_row + 1]]``.

        Raises:
            IndexError: If ``0 <= start_row <= stop_row <= len(self)`` does not hold.
            CacheCorruptError: If a chunk's checksum does not match (the message names the shard file).
        """
        self._check_field(field)
        ledger = self._ledger
        if not 0 <= start_row <= stop_row <= ledger.rows:
            ledger = self.refresh()
            if not 0 <= start_row <= stop_row <= ledger.rows:
                raise IndexError(
                    f"row_offsets({start_row}, {stop_row}) on {self.location!r}: expected "
                    f"0 <= start_row <= stop_row <= {ledger.rows} (committed rows)"
                )
        return self._read(field, "offsets", start_row, stop_row + 1, ledger.rows + 1, ledger.finished)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Row ``index`` (negative counts from the committed end) as ``{field: array}``.

        Raises:
            IndexError: If the row is not committed.
            CacheCorruptError: If the row's bytes are damaged (the message names the shard file).
        """
        rows = self._ledger.rows
        if not -rows <= index < rows:
            rows = len(self)
            if not -rows <= index < rows:
                raise IndexError(f"row {index} of cache {self.location!r} out of range: {rows} rows are committed")
        index = index % rows
        out = {}
        for field in self._arrays:
            lo, hi = self.row_offsets(index, index + 1, field)
            out[field] = self.read_flat(int(lo), int(hi), field)
        return out

    def get_batch(self, indices: Iterable[int]) -> list[dict[str, np.ndarray]]:
        """Rows ``indices`` as a list of ``{field: array}``."""
        return [self[int(i)] for i in indices]

    def wait_until(self, *, rows: int | None = None, timeout: float | None = None) -> bool:
        """Block until at least ``rows`` rows are committed or the cache is finished.

        Args:
            rows: Rows to wait for; ``None`` waits until the cache is finished.
            timeout: Seconds to wait at most; ``None`` waits forever.

        Returns:
            ``True`` when the wait ended because the rows are committed or the cache is finished (check
            ``len(self)``: a finished cache may have fewer rows than asked), ``False`` on timeout.
        """
        return self.wait_for_length(rows, timeout=timeout)

    def __repr__(self) -> str:
        ledger = self._ledger
        state = "finished" if ledger.finished else "building"
        return f"CacheDataset({self.location!r}, rows={ledger.rows}, {state})"


def open_cache(location: str | os.PathLike[str], *, cache_bytes: int = 256 << 20) -> CacheDataset:
    """Open the cache at ``location`` for reading (also while it is being built).

    Args:
        location: A local directory, ``memory://name``, ``gs://...`` or ``s3://...``.
        cache_bytes: Size of the in-memory LRU of decoded chunks.

    Returns:
        The cache as a dataset.

    Raises:
        CacheNotFoundError: If there is no cache (no ledger) at ``location``.

    Examples:
        >>> cache = open_cache("/data/cache")  # doctest: +SKIP
        >>> len(cache), cache.is_finished, cache[0]["input_ids"][:5]  # doctest: +SKIP
    """
    return CacheDataset(str(location), cache_bytes=cache_bytes)
