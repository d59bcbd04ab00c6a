"""Build a cache: read a source, process batches on a backend, commit rows in source order.

Batches are cut from the shards in order, processed in parallel (local processes or Ray actors), and
committed strictly in order by this process, which alone writes to the store: array data first, then the
ledger (the commit pointer). So the bytes of the cache depend only on the inputs and the processor, a
reader sees every row as soon as it is committed, and a build killed at any instant resumes from its last
committed batch (finished shards are never redone, no row is lost or repeated).

Several processes (or hosts) asked to build the same cache agree on one builder through the builder lease
(:mod:`ponente.datacache.lease`): the holder builds or resumes; the others wait, reading the cache as it
grows, and return it once it is finished, unless the holder dies, in which case one of them takes the lease
over once it expired and resumes from the last commit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ponente.datacache.backends import BACKENDS, Processed, make_backend, map_ordered
from ponente.datacache.errors import BAD_RECORD_KINDS, EMPTY, BadRecordError, FingerprintMismatchError
from ponente.datacache.lease import DEFAULT_LEASE_SECONDS, LEASE_KEY, BuilderLease
from ponente.datacache.ledger import FORMAT_VERSION, MAX_SKIP_EXAMPLES, Ledger, describe_differences, fingerprint
from ponente.datacache.processor import BatchProcessor, TokenizerProcessor
from ponente.datacache.source import BadInput, FileSource, Source
from ponente.datacache.storage import check_access
from ponente.datacache.store import CacheDataset, StoreWriter, open_cache, read_ledger

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

BAD_RECORD_POLICIES = ("error", "skip")
"""Values of ``bad_records``."""


@dataclass
class _Batch:
    shard: int
    next_row: int
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    nbytes: int = 0
    shard_done: bool = False


def _batches(
    source: Source,
    ledger: Ledger,
    processor: BatchProcessor,
    *,
    bad_records: str,
    keep_empty: bool,
    batch_rows: int,
    batch_bytes: int,
) -> Iterator[_Batch]:
    """Cut the unfinished shards into batches, applying the bad-record policy; see the module docstring."""
    for index, progress in enumerate(ledger.shards):
        if progress.finished:
            continue
        batch = _Batch(index, progress.rows_read)
        for row, item, nbytes in source.open_shard(progress.name, progress.rows_read):
            batch.nbytes += nbytes
            if isinstance(item, BadInput):
                problem: tuple[str, str, str] | None = (item.kind, item.location, item.detail)
            else:
                checked = processor.check(item)
                problem = None if checked is None else (checked[0], source.locate(progress.name, row), checked[1])
            if problem is None or (problem[0] == EMPTY and keep_empty):
                batch.records.append(item)  # type: ignore[arg-type]
            else:
                kind, location, detail = problem
                if kind in BAD_RECORD_KINDS and bad_records == "error":
                    if batch.records or batch.skipped:
                        yield batch  # keep the work before the bad record; a resumed build starts at it
                    raise BadRecordError(kind, location, detail)
                batch.skipped[kind] = batch.skipped.get(kind, 0) + 1
                if len(batch.examples) < MAX_SKIP_EXAMPLES:
                    batch.examples.append(f"{location}: {kind}: {detail}")
            if row >= 0:
                batch.next_row = row + 1
            if len(batch.records) >= batch_rows or batch.nbytes >= batch_bytes:
                yield batch
                batch = _Batch(index, batch.next_row)
        batch.shard_done = True
        yield batch


class _Progress:
    """A tqdm bar with rows/s, tokens/s and input MB/s (silent when disabled)."""

    def __init__(self, enabled: bool, rows: int, shards: int) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(initial=rows, unit=" rows", unit_scale=True, dynamic_ncols=True, desc="building")
        self._start = time.monotonic()
        self._tokens = 0
        self._bytes = 0
        self._shards = shards

    def update(self, rows: int, tokens: int, nbytes: int, shards_done: int) -> None:
        self._tokens += tokens
        self._bytes += nbytes
        if self._bar is None:
            return
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix_str(
            f"{self._tokens / elapsed:,.0f} tok/s, {self._bytes / elapsed / 1e6:.1f} MB/s, "
            f"shards {shards_done}/{self._shards}",
            refresh=False,
        )
        self._bar.update(rows)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _resolve_processor(
    tokenizer: Tokenizer | str | os.PathLike[str] | None,
    processor: BatchProcessor | None,
    text_key: str,
    bos: str | None,
    eos: str | None,
) -> BatchProcessor:
    if (tokenizer is None) == (processor is None):
        raise ValueError("pass exactly one of tokenizer=... (to tokenize text) or processor=... (any BatchProcessor)")
    if processor is not None:
        if bos is not None or eos is not None:
            raise ValueError("bos/eos apply to tokenizer=...; configure them on the processor you pass")
        return processor
    assert tokenizer is not None
    return TokenizerProcessor(tokenizer, text_key=text_key, bos=bos, eos=eos)


def build_cache(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Source,
    output: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    processor: BatchProcessor | None = None,
    text_key: str = "text",
    bos: str | None = None,
    eos: str | None = None,
    backend: str = "local",
    workers: int | None = None,
    bad_records: str = "error",
    keep_empty: bool = False,
    rebuild: bool = False,
    txt_mode: str = "file",
    format: str | None = None,
    progress: bool = True,
    batch_rows: int = 1024,
    batch_bytes: int = 4 << 20,
    commit_interval: float = 0.5,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    lease_heartbeat: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> CacheDataset:
    """Build (or resume, or just open when finished) the cache of ``inputs`` at ``output``.

    One process at a time builds a given ``output``: the one holding its builder lease. Another process
    calling this meanwhile waits (the cache can be read, with :func:`~ponente.datacache.open_cache`, while it
    grows) and returns the cache once the holder finished it; if the holder dies, the waiter takes the lease
    over after it expired (``lease_seconds``) and resumes the build from the last commit.

    Args:
        inputs: Paths, globs or fsspec URLs with brace expansion (jsonl, json, txt, parquet; gz, zst, bz2, xz),
            or any :class:`~ponente.datacache.source.Source` (e.g. :class:`~ponente.datacache.HFSource`).
        output: Cache location: a local directory, ``memory://name``, ``gs://...`` or ``s3://...``.
        tokenizer: Tokenize the ``text_key`` field with this tokenizer (``tokenizer.json``, a directory
            containing one, a hub id, or a ``tokenizers.Tokenizer``). Exclusive with ``processor``.
        processor: Any :class:`~ponente.datacache.processor.BatchProcessor` instead of a tokenizer.
        text_key: Record field holding the text (and the key given to documents of txt files).
        bos: Token to put before every document (with ``tokenizer``), or ``None``.
        eos: Token to put after every document (with ``tokenizer``), or ``None``.
        backend: ``"local"`` (worker processes on this machine) or ``"ray"`` (joins ``RAY_ADDRESS`` or starts
            a local Ray).
        workers: Worker processes or actors; ``0`` processes in this process; default: the CPU count.
        bad_records: ``"error"`` stops at the first bad record naming file and line (the cache stays
            resumable); ``"skip"`` skips bad records and counts them per kind in the ledger.
        keep_empty: Keep empty documents as (short) rows instead of skipping and counting them.
        rebuild: Delete whatever is at ``output`` and build from scratch. A process that finds another one
            holding the builder lease does not delete its work: it waits, and rebuilds only if the cache there
            is not of this request.
        txt_mode: For txt files: ``"file"`` (one document per file) or ``"line"`` (one per line).
        format: Force the input format (``jsonl``, ``json``, ``txt``, ``parquet``) instead of the extension's.
        progress: Show a progress bar (rows/s, tokens/s, MB/s) on stderr.
        batch_rows: Most records per batch (unit of work and of commit).
        batch_bytes: Most input bytes per batch.
        commit_interval: Seconds between ledger commits: written batches become visible to readers at the
            next commit (and at the end of the build). ``0`` commits after every batch.
        lease_seconds: How long the builder lease lasts without renewal: the longest time a builder that
            died keeps the others waiting.
        lease_heartbeat: Seconds between renewals of the lease (default ``lease_seconds / 4``; less than
            ``lease_seconds / 2``). Waiting processes look at the lease and the ledger as often (at most 1 s).
        should_stop: Called between batches; when it returns True the build commits what it wrote and raises
            :class:`BuildStopped` (the cache stays resumable). For a process that must exit while a build runs
            in a background thread.

    Returns:
        The finished cache, opened for reading.

    Raises:
        FingerprintMismatchError: If ``output`` holds a cache of other inputs/processor/options (the message
            lists what differs) and ``rebuild`` is false.
        BadRecordError: On bad input under ``bad_records="error"``; rows before it are committed.
        LeaseLostError: If this process stopped renewing its lease long enough for another to take the build
            over (that process continues it; nothing more is committed here).
        ValueError: On invalid options.
        KeyboardInterrupt: On Ctrl-C, after stopping the workers; the cache stays resumable.
        BuildStopped: When ``should_stop()`` returned True; the cache stays resumable.

    Examples:
        >>> cache = build_cache("corpus/*.jsonl.gz", "/data/cache", tokenizer="tokenizer.json")  # doctest: +SKIP
        >>> len(cache), cache[0]["input_ids"]  # doctest: +SKIP
    """
    if bad_records not in BAD_RECORD_POLICIES:
        raise ValueError(f"bad_records must be one of {BAD_RECORD_POLICIES}, found {bad_records!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, found {backend!r}")
    if workers is not None and workers < 0:
        raise ValueError(f"workers must be >= 0 (0: process in this process), found {workers}")
    if batch_rows < 1 or batch_bytes < 1:
        raise ValueError(f"batch_rows and batch_bytes must be positive, found {batch_rows} and {batch_bytes}")
    output = str(output)
    chosen = _resolve_processor(tokenizer, processor, text_key, bos, eos)
    if isinstance(inputs, Source):
        source = inputs
    else:
        paths = [str(inputs)] if isinstance(inputs, str | os.PathLike) else [str(p) for p in inputs]
        source = FileSource(paths, text_key=text_key, txt_mode=txt_mode, format=format)
    parts = {
        "format_version": FORMAT_VERSION,
        "source": source.describe(),
        "processor": chosen.config(),
        "keep_empty": keep_empty,
    }

    check_access(output)  # an object store that refuses us fails here, in one line, not in the lease loop
    lease = BuilderLease(output, seconds=lease_seconds, heartbeat=lease_heartbeat)
    waited_for: str | None = None
    while True:
        if rebuild and waited_for is not None and _ledger_fingerprint(output) == fingerprint(parts):
            rebuild = False  # the builder we waited for has just built what we asked for
        existing = _existing_ledger(output, parts, rebuild)
        if existing is not None and existing.finished:
            logger.info("cache at %s is finished (%d rows)", output, existing.rows)
            return open_cache(output)
        if lease.try_acquire():
            break
        if should_stop is not None and should_stop():
            raise BuildStopped(f"the build of the cache at {output} was asked to stop while waiting for the lease")
        holder = lease.other.holder if lease.other is not None else "another process"
        if holder != waited_for:
            logger.info("the cache at %s is being built by %s: waiting for it to finish", output, holder)
            waited_for = holder
        time.sleep(min(lease.heartbeat, 1.0))
    with lease:
        existing = _existing_ledger(output, parts, rebuild)  # again: it may have changed before we got the lease
        if existing is not None and existing.finished:
            logger.info("cache at %s is finished (%d rows)", output, existing.rows)
            return open_cache(output)
        _build(
            output,
            source,
            chosen,
            existing or Ledger.new(parts, dict(chosen.fields), list(source.shard_names)),
            lease,
            create=existing is None,
            bad_records=bad_records,
            keep_empty=keep_empty,
            backend=backend,
            workers=workers,
            progress=progress,
            batch_rows=batch_rows,
            batch_bytes=batch_bytes,
            commit_interval=commit_interval,
            should_stop=should_stop,
        )
    return open_cache(output)


class BuildStopped(Exception):  # noqa: N818 -- an outcome the caller asked for, not an error
    """A build ended early because its ``should_stop`` said so; what it wrote is committed and resumable."""


def _ledger_fingerprint(output: str) -> str | None:
    with contextlib.suppress(ValueError):
        ledger = read_ledger(output)
        return None if ledger is None else ledger.fingerprint
    return None


def _existing_ledger(output: str, parts: dict[str, Any], rebuild: bool) -> Ledger | None:
    """The ledger at ``output`` to resume from: ``None`` to build from scratch.

    Raises:
        FingerprintMismatchError: If it describes a cache of something else and ``rebuild`` is false.
        ValueError: If it is damaged and ``rebuild`` is false.
    """
    if rebuild:
        return None
    existing = read_ledger(output)
    if existing is not None and existing.fingerprint != fingerprint(parts):
        differences = describe_differences(existing.fingerprint_parts, parts) or ["fingerprint hash"]
        raise FingerprintMismatchError(
            f"the cache at {output!r} was built from something else; what differs: {'; '.join(differences)}. "
            "Pass rebuild=True (--rebuild) to delete it and build again, or choose another output."
        )
    return existing


def _build(
    output: str,
    source: Source,
    chosen: BatchProcessor,
    ledger: Ledger,
    lease: BuilderLease,
    *,
    create: bool,
    bad_records: str,
    keep_empty: bool,
    backend: str,
    workers: int | None,
    progress: bool,
    batch_rows: int,
    batch_bytes: int,
    commit_interval: float,
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """Build from scratch (``create``: a new ``ledger``) or resume from ``ledger``, holding ``lease``."""
    fields = dict(chosen.fields)
    lease.check()
    writer = StoreWriter(output, fields, create=create, keep=LEASE_KEY)

    def commit() -> None:
        lease.check()  # never commit once another builder may have taken over
        writer.commit(ledger)

    if create:
        commit()
    else:
        logger.info("resuming the cache at %s from row %d", output, ledger.rows)
    worker_count = (os.cpu_count() or 1) if workers is None else workers
    pool = make_backend(backend, chosen, worker_count)
    bar = _Progress(progress, ledger.rows, len(ledger.shards))
    first_field = next(iter(fields))

    def empty() -> Processed:
        return {name: (np.empty(0, dtype=dtype), np.empty(0, dtype=np.int64)) for name, dtype in fields.items()}

    batches = _batches(
        source,
        ledger,
        chosen,
        bad_records=bad_records,
        keep_empty=keep_empty,
        batch_rows=batch_rows,
        batch_bytes=batch_bytes,
    )
    last_commit = time.monotonic()
    consistent = True
    try:
        for batch, result in map_ordered(pool, batches, lambda b: b.records, empty):
            if should_stop is not None and should_stop():
                raise BuildStopped(f"the build of the cache at {output} stopped at row {ledger.rows}, as asked")
            lease.check()
            writer.append(ledger.rows, ledger.lengths, result)
            consistent = False  # the ledger is being updated for this batch
            rows = len(result[first_field][1])
            ledger.rows += rows
            for name, (flat, _) in result.items():
                ledger.lengths[name] += len(flat)
            shard = ledger.shards[batch.shard]
            shard.rows_read = batch.next_row
            shard.rows_written += rows
            shard.finished = batch.shard_done
            for kind, count in batch.skipped.items():
                shard.skipped[kind] = shard.skipped.get(kind, 0) + count
                ledger.skipped[kind] = ledger.skipped.get(kind, 0) + count
            room = MAX_SKIP_EXAMPLES - len(ledger.skip_examples)
            ledger.skip_examples.extend(batch.examples[: max(0, room)])
            consistent = True
            if time.monotonic() - last_commit >= commit_interval:
                commit()
                last_commit = time.monotonic()
            done = batch.shard + 1 if batch.shard_done else batch.shard
            bar.update(rows, len(result[first_field][0]), batch.nbytes, done)
        ledger.finished = True
        commit()
    except BaseException:
        pool.close(abort=True)
        if consistent:  # it describes only data already written: commit it to keep the work done so far
            with contextlib.suppress(Exception):
                commit()
        raise
    finally:
        bar.close()
    pool.close(abort=False)
    if ledger.skipped:
        logger.warning(
            "cache %s: skipped records by kind: %s (first: %s)",
            output,
            dict(sorted(ledger.skipped.items())),
            ledger.skip_examples[:3],
        )
    logger.info("cache %s finished: %d rows, %s", output, ledger.rows, ledger.lengths)
