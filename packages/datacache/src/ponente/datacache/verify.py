"""Check a cache end to end: the ledger's own consistency, every offset and every byte of data."""

from __future__ import annotations

import numpy as np
import tensorstore as ts

from ponente.datacache.ledger import fingerprint
from ponente.datacache.store import SHARD_ELEMENTS, CacheDataset, _open_kvstore, open_cache, shard_file

_BLOCK = SHARD_ELEMENTS  # one shard file per block read, so a damaged shard is reported once and the rest still read


def _check_ledger(cache: CacheDataset) -> list[str]:
    ledger = cache.ledger
    problems = []
    if fingerprint(ledger.fingerprint_parts) != ledger.fingerprint:
        problems.append("ledger: the fingerprint does not match the fingerprint parts")
    written = sum(s.rows_written for s in ledger.shards)
    if written != ledger.rows:
        problems.append(f"ledger: shards wrote {written} rows in total but {ledger.rows} rows are committed")
    totals: dict[str, int] = {}
    for shard in ledger.shards:
        for kind, count in shard.skipped.items():
            totals[kind] = totals.get(kind, 0) + count
    if totals != ledger.skipped:
        problems.append(f"ledger: per-shard skip counts {totals} do not add up to the totals {ledger.skipped}")
    started = [i for i, s in enumerate(ledger.shards) if not s.finished and (s.rows_read or s.rows_written)]
    unfinished = [i for i, s in enumerate(ledger.shards) if not s.finished]
    if unfinished and any(s.finished for s in ledger.shards[unfinished[0] :]):
        problems.append(f"ledger: shard {unfinished[0]} is unfinished but a later shard is finished")
    if len(started) > 1:
        problems.append(f"ledger: several shards are in progress at once: {started}")
    if ledger.finished and unfinished:
        problems.append(f"ledger: the cache is marked finished but shard {unfinished[0]} is not")
    return problems


def _missing_shards(cache: CacheDataset, field: str, part: str, elements: int) -> list[str]:
    """Shard files that should hold committed elements but do not exist (reads would silently give zeros)."""
    prefix = f"{field}/{part}/c/"
    listing = _open_kvstore(cache.location).list(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
    keys = {key.decode() for key in listing}
    return [
        f"field {field!r}: shard file {shard_file(cache.location, field, part, index * SHARD_ELEMENTS)} is missing"
        for index in range(-(-elements // SHARD_ELEMENTS))
        if f"{prefix}{index}" not in keys
    ]


def _check_field(cache: CacheDataset, field: str) -> list[str]:
    ledger = cache.ledger
    rows, length = ledger.rows, ledger.lengths.get(field)
    if length is None:
        return [f"field {field!r}: the ledger has no committed length"]
    missing = _missing_shards(cache, field, "offsets", rows + 1) + _missing_shards(cache, field, "data", length)
    if missing:
        return missing
    previous = 0
    for start in range(0, rows + 1, _BLOCK):
        stop = min(start + _BLOCK, rows + 1)
        try:
            offsets = cache.row_offsets(start, stop - 1, field)
        except Exception as exc:  # any read failure (checksum, decode, missing file) is damage to report
            return [f"field {field!r}: offsets {start}..{stop - 1} unreadable: {exc}"]
        if start == 0 and offsets[0] != 0:
            return [f"field {field!r}: offsets[0] is {offsets[0]}, expected 0"]
        steps = np.diff(np.concatenate([[previous], offsets]))
        if (steps < 0).any():
            row = start + int(np.argmax(steps < 0)) - 1
            return [f"field {field!r}: offsets decrease at row {row}"]
        previous = int(offsets[-1])
    if previous != length:
        return [f"field {field!r}: the last offset is {previous} but the ledger commits {length} elements"]
    problems = []
    for start in range(0, length, _BLOCK):  # every chunk of every shard file is decoded (and its checksum checked)
        stop = min(start + _BLOCK, length)
        try:
            cache.read_flat(start, stop, field)
        except Exception as exc:  # any read failure (checksum, decode, missing file) is damage to report
            problems.append(f"field {field!r}: data {start}..{stop} unreadable: {exc}")
    return problems


def verify_cache(location: str) -> list[str]:
    """Re-read a whole cache and return the problems found (an empty list: the cache is sound).

    Checks the ledger (fingerprint, row and skip totals, shard progress order), that every field's offsets
    start at 0, never decrease and end at the committed length, that every shard file holding committed
    elements exists, and that all committed data decodes: every chunk is read, and chunks carry crc32c
    checksums, so a damaged byte is found; the problem names the shard file.

    Args:
        location: The cache location.

    Returns:
        Human-readable problems.

    Raises:
        CacheNotFoundError: If there is no cache at ``location``.
    """
    cache = open_cache(location, cache_bytes=0)
    problems = _check_ledger(cache)
    for field in cache.fields:
        problems.extend(_check_field(cache, field))
    return problems
