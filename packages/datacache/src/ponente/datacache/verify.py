"""Check a cache end to end: the ledger's own consistency, every offset and every byte of data."""

from __future__ import annotations

import numpy as np

from ponente.datacache.ledger import fingerprint
from ponente.datacache.store import CacheDataset, open_cache

_BLOCK = 1 << 22


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


def _check_field(cache: CacheDataset, field: str) -> list[str]:
    ledger = cache.ledger
    rows, length = ledger.rows, ledger.lengths.get(field)
    if length is None:
        return [f"field {field!r}: the ledger has no committed length"]
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
    for start in range(0, length, _BLOCK):
        stop = min(start + _BLOCK, length)
        try:
            cache.read_flat(start, stop, field)
        except Exception as exc:  # any read failure (checksum, decode, missing file) is damage to report
            return [f"field {field!r}: data {start}..{stop} unreadable: {exc}"]
    return []


def verify_cache(location: str) -> list[str]:
    """Re-read a whole cache and return the problems found (an empty list: the cache is sound).

    Checks the ledger (fingerprint, row and skip totals, shard progress order), that every field's offsets
    start at 0, never decrease and end at the committed length, and that all committed data decodes (chunks
    carry crc32c checksums, so damaged bytes are found).

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
