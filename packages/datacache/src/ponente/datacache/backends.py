"""Where batches are processed: in this process, in local worker processes, or on Ray actors.

A backend only runs ``processor(records)`` on batches and hands results back in submission order; the
builder alone writes to the store. That is why the output bytes never depend on the backend or on the
number of workers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ponente.datacache.errors import MissingExtraError
from ponente.datacache.processor import BatchProcessor

logger = logging.getLogger(__name__)

BACKENDS = ("local", "ray")
"""Names of the builder backends."""

Processed = dict[str, tuple[np.ndarray, np.ndarray]]
"""Per field, ``(flat, row_lengths)`` of a processed batch."""

T = TypeVar("T")


def process_batch(processor: BatchProcessor, records: Sequence[Mapping[str, Any]]) -> Processed:
    """Run ``processor`` on ``records`` and flatten each field into ``(flat, row_lengths)``.

    Raises:
        ValueError: If the processor does not return one 1-D array per record for every field.
    """
    fields = processor.fields
    if not records:
        return {name: (np.empty(0, dtype=dtype), np.empty(0, dtype=np.int64)) for name, dtype in fields.items()}
    out = processor(records)
    result: Processed = {}
    for name, dtype in fields.items():
        rows = out.get(name)
        if rows is None or len(rows) != len(records):
            found = "nothing" if rows is None else f"{len(rows)} rows"
            raise ValueError(f"processor returned {found} for field {name!r}; expected {len(records)} rows")
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        result[name] = (np.concatenate(rows).astype(dtype, copy=False), lengths)
    return result


class Backend(Protocol):
    """Runs batches and returns their results in submission order."""

    def submit(self, records: list[dict[str, Any]]) -> Any:
        """Start processing a batch; returns a handle."""
        ...

    def result(self, handle: Any) -> Processed:
        """Wait for and return the result of a handle."""
        ...

    def close(self, *, abort: bool) -> None:
        """Release the workers; ``abort`` stops them at once (Ctrl-C, errors)."""
        ...

    @property
    def window(self) -> int:
        """How many batches to keep in flight."""
        ...


class InProcessBackend:
    """Processes batches in one background thread of this process (``workers=0``).

    Tokenizers release the GIL and parallelise inside a batch, so reading and writing in the main thread
    overlap with processing in this thread.
    """

    window = 2

    def __init__(self, processor: BatchProcessor) -> None:
        self._processor = processor
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ponente-datacache")

    def submit(self, records: list[dict[str, Any]]) -> Any:
        return self._pool.submit(process_batch, self._processor, records)

    def result(self, handle: Any) -> Processed:
        return handle.result()

    def close(self, *, abort: bool) -> None:
        self._pool.shutdown(wait=not abort, cancel_futures=abort)


_WORKER_PROCESSOR: BatchProcessor | None = None


def _init_worker(processor: BatchProcessor, threads: int) -> None:
    global _WORKER_PROCESSOR
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    for name in ("RAYON_NUM_THREADS", "RAYON_RS_NUM_CPUS"):  # tokenizers' thread pool starts lazily
        os.environ[name] = str(threads)
    _WORKER_PROCESSOR = processor


def _process_in_worker(records: list[dict[str, Any]]) -> Processed:
    assert _WORKER_PROCESSOR is not None  # set by _init_worker
    return process_batch(_WORKER_PROCESSOR, records)


class LocalBackend:
    """A pool of ``workers`` spawned processes on this machine."""

    def __init__(self, processor: BatchProcessor, workers: int) -> None:
        threads = max(1, (os.cpu_count() or 1) // workers)
        context = multiprocessing.get_context("spawn")
        self._pool = context.Pool(workers, initializer=_init_worker, initargs=(processor, threads))
        self.window = 2 * workers

    def submit(self, records: list[dict[str, Any]]) -> Any:
        return self._pool.apply_async(_process_in_worker, (records,))

    def result(self, handle: Any) -> Processed:
        return handle.get()

    def close(self, *, abort: bool) -> None:
        if abort:
            self._pool.terminate()
        else:
            self._pool.close()
        self._pool.join()


class _RayWorker:
    def __init__(self, processor: BatchProcessor, threads: int) -> None:
        _init_worker(processor, threads)
        self._processor = processor

    def process(self, records: list[dict[str, Any]]) -> Processed:
        return process_batch(self._processor, records)


class RayBackend:
    """``workers`` Ray actors. Joins the cluster at ``RAY_ADDRESS`` if set, else starts a local Ray."""

    def __init__(self, processor: BatchProcessor, workers: int) -> None:
        try:
            import ray
        except ImportError as exc:
            raise MissingExtraError(
                "backend 'ray' needs Ray, which is not installed: pip install 'ponente-datacache[ray]'"
            ) from exc
        self._ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            address = os.environ.get("RAY_ADDRESS")
            if address:
                logger.info("joining the Ray cluster at %s", address)
                ray.init(address=address, logging_level=logging.WARNING)
            else:
                # "local": a new in-process cluster, never one a stale `ray start` left in /tmp/ray.
                ray.init(address="local", num_cpus=workers, include_dashboard=False, logging_level=logging.WARNING)
        threads = max(1, (os.cpu_count() or 1) // workers)
        actor: Any = ray.remote(num_cpus=1)(_RayWorker)
        processor_ref = ray.put(processor)
        self._actors: list[Any] = [actor.remote(processor_ref, threads) for _ in range(workers)]
        self._next = 0
        self.window = 2 * workers

    def submit(self, records: list[dict[str, Any]]) -> Any:
        actor = self._actors[self._next % len(self._actors)]
        self._next += 1
        return actor.process.remote(records)

    def result(self, handle: Any) -> Processed:
        return self._ray.get(handle)

    def close(self, *, abort: bool) -> None:
        del abort
        for actor in self._actors:
            self._ray.kill(actor)
        if self._started:
            self._ray.shutdown()


def make_backend(name: str, processor: BatchProcessor, workers: int) -> Backend:
    """The backend ``name`` (``"local"`` or ``"ray"``) with ``workers`` workers (``0``: in this process).

    Raises:
        ValueError: On an unknown backend or a negative worker count.
        MissingExtraError: For ``"ray"`` when Ray is not installed.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, found {name!r}")
    if workers < 0:
        raise ValueError(f"workers must be >= 0, found {workers}")
    if name == "ray":
        return RayBackend(processor, max(1, workers))
    if workers == 0:
        return InProcessBackend(processor)
    return LocalBackend(processor, workers)


def map_ordered(
    backend: Backend,
    items: Iterable[T],
    records: Callable[[T], list[dict[str, Any]]],
    empty: Callable[[], Processed],
) -> Iterator[tuple[T, Processed]]:
    """Yield ``(item, result)`` in order, keeping up to ``backend.window`` batches in flight.

    If pulling the next item raises (a bad record under the ``error`` policy), the batches already in
    flight are still yielded before the exception propagates, so the work before the error is kept.
    """
    pending: collections.deque[tuple[T, Any, bool]] = collections.deque()
    iterator = iter(items)
    error: BaseException | None = None
    exhausted = False
    while True:
        while not exhausted and error is None and len(pending) < backend.window:
            try:
                item = next(iterator)
            except StopIteration:
                exhausted = True
                break
            except Exception as exc:
                error = exc
                break
            batch = records(item)
            pending.append((item, backend.submit(batch) if batch else None, bool(batch)))
        if not pending:
            break
        item, handle, submitted = pending.popleft()
        yield item, backend.result(handle) if submitted else empty()
    if error is not None:
        raise error
