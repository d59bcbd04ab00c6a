"""The ledger: a cache's JSON record of what is committed, per-shard progress, skips and its fingerprint.

The ledger is the commit pointer: the builder writes array data first and then replaces the ledger in one
atomic write, so a reader that trusts ``rows`` and ``lengths`` only ever sees fully written rows. It holds
nothing that depends on how the cache was built (no times, worker counts or backends), so a finished cache
is byte-identical however it was built.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1
"""Version of the on-disk format; part of the fingerprint."""

LEDGER_KEY = "ledger.json"
MAX_SKIP_EXAMPLES = 20


def fingerprint(parts: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of the fingerprint parts (source listing, processor, options, format)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def describe_differences(cached: Any, requested: Any, path: str = "") -> list[str]:
    """Human-readable differences between two fingerprint parts, e.g. ``"processor.eos: cache has ..."``.

    Shard listings (lists of ``[name, size, ...]``) are compared by name, reporting added, removed and
    changed shards.
    """
    if isinstance(cached, dict) and isinstance(requested, dict):
        out = []
        for key in sorted(set(cached) | set(requested)):
            where = f"{path}.{key}" if path else key
            if key not in requested:
                out.append(f"{where}: cache has {_short(cached[key])}, the request has nothing")
            elif key not in cached:
                out.append(f"{where}: cache has nothing, the request has {_short(requested[key])}")
            else:
                out.extend(describe_differences(cached[key], requested[key], where))
        return out
    if path.endswith("shards") and isinstance(cached, list) and isinstance(requested, list):
        old = {s[0]: s for s in cached}
        new = {s[0]: s for s in requested}
        out = [f"{path}: shard {n!r} is in the cache but not in the request" for n in old if n not in new]
        out += [f"{path}: shard {n!r} is in the request but not in the cache" for n in new if n not in old]
        out += [
            f"{path}: shard {n!r} differs (cache {_short(old[n][1:])}, request {_short(new[n][1:])})"
            for n in old
            if n in new and old[n] != new[n]
        ]
        if not out and cached != requested:
            out.append(f"{path}: the shards are listed in a different order")
        return out
    if cached != requested:
        return [f"{path}: cache has {_short(cached)}, the request has {_short(requested)}"]
    return []


@dataclass
class ShardProgress:
    """Progress of one source shard.

    Attributes:
        name: The shard name.
        rows_read: Source rows consumed (good or bad); a resumed build reopens the shard at this row.
        rows_written: Cache rows this shard produced.
        finished: The whole shard is committed.
        skipped: Skipped records of this shard by kind.
    """

    name: str
    rows_read: int = 0
    rows_written: int = 0
    finished: bool = False
    skipped: dict[str, int] = field(default_factory=dict)


@dataclass
class Ledger:
    """Everything a cache knows about itself besides the arrays.

    Attributes:
        format_version: :data:`FORMAT_VERSION` of the writer.
        fingerprint: :func:`fingerprint` of ``fingerprint_parts``.
        fingerprint_parts: Source listing, processor config, options and format version.
        fields: Output fields and their dtypes.
        rows: Committed rows (the commit pointer).
        lengths: Committed length of each field's flat data array.
        shards: Per-shard progress, in source order.
        skipped: Skipped records by kind over all shards.
        skip_examples: The first few skipped records (location, kind, detail), to report.
        finished: Every shard is committed; the cache will not grow.
    """

    format_version: int
    fingerprint: str
    fingerprint_parts: dict[str, Any]
    fields: dict[str, str]
    rows: int = 0
    lengths: dict[str, int] = field(default_factory=dict)
    shards: list[ShardProgress] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    skip_examples: list[str] = field(default_factory=list)
    finished: bool = False

    @classmethod
    def new(cls, parts: dict[str, Any], fields: dict[str, str], shard_names: list[str]) -> Ledger:
        """An empty ledger for a new build."""
        return cls(
            format_version=FORMAT_VERSION,
            fingerprint=fingerprint(parts),
            fingerprint_parts=parts,
            fields=dict(fields),
            lengths=dict.fromkeys(fields, 0),
            shards=[ShardProgress(name) for name in shard_names],
        )

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, indented), deterministic for equal ledgers."""
        return (json.dumps(asdict(self), sort_keys=True, indent=1) + "\n").encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "ledger") -> Ledger:
        """Parse a ledger.

        Raises:
            ValueError: If the JSON is damaged or has a newer format version.
        """
        try:
            raw = json.loads(data)
            shards = [ShardProgress(**s) for s in raw.pop("shards")]
            ledger = cls(**raw, shards=shards)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{where} is not a valid ponente.datacache ledger: {exc}") from exc
        if ledger.format_version > FORMAT_VERSION:
            raise ValueError(
                f"{where} has format version {ledger.format_version}; this ponente-datacache reads up to "
                f"{FORMAT_VERSION}: upgrade the package"
            )
        return ledger
