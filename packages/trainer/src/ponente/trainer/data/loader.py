"""Batches as a pure function of the step, and a loader that prefetches them in a background thread.

The data position of a run is its step: batch ``s`` holds rows ``s * B .. s * B + B - 1`` of the dataset,
so resuming at step ``s`` needs no iterator state. Once the dataset is finished (its length final), row
indices past its end wrap modulo the length, so epochs repeat deterministically: an index below the final
length is never remapped, whatever the timing of a background build.

Multi-host runs (where each process loads only its part of every global batch) pass ``rows``: a slice of
the ``B`` positions of the global batch, e.g. ``slice(8, 16)`` for the second of four processes with
``B = 32``. Only those rows are read.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import numpy as np

from ponente.datacache import Dataset

__all__ = ["DataLoader", "batch_for_step"]

logger = logging.getLogger(__name__)

_PUT_POLL_SECONDS = 0.05
_WAIT_SLICE = 0.25


def step_indices(step: int, batch_size: int, rows: slice | None = None) -> np.ndarray:
    """Global row indices of batch ``step`` (before wrapping), restricted to the positions ``rows``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    indices = step * batch_size + np.arange(batch_size, dtype=np.int64)
    return indices if rows is None else indices[rows]


def batch_for_step(
    dataset: Dataset[dict[str, np.ndarray]],
    step: int,
    batch_size: int,
    *,
    rows: slice | None = None,
    timeout: float | None = None,
) -> dict[str, np.ndarray]:
    """The batch of training step ``step``: rows ``step * batch_size .. step * batch_size + batch_size - 1``.

    Waits for rows of a dataset that is still growing. Once the dataset is finished, indices wrap modulo
    its length (the next epoch starts over in the same order).

    Args:
        dataset: A dataset of dict rows with equal shapes per key (e.g. a data config's ``train_set``).
        step: The training step, ``>= 0``.
        batch_size: Rows per (global) batch.
        rows: Only these positions of the global batch (a slice of ``range(batch_size)``), for a process
            that loads its own part of the batch; ``None``: all.
        timeout: The most seconds to wait for missing rows; ``None`` waits as long as it takes.

    Returns:
        ``{key: array of shape (rows, *row_shape)}``, e.g. ``input_ids`` and ``segment_ids`` of shape
        ``(batch_size, seq_len)``.

    Raises:
        TimeoutError: If the rows did not become available within ``timeout``.
        ValueError: If the dataset finished empty, or for a negative step or non-positive batch size.

    Example:
        ```python
        from ponente.datacache import InMemoryTokenStore, TokenSeqDataset
        from ponente.trainer.data import batch_for_step

        ds = TokenSeqDataset(InMemoryTokenStore.from_documents([list(range(12))]), seq_len=2)  # 6 rows
        batch_for_step(ds, 1, 4)["input_ids"][:, 0].tolist()  # rows 4, 5, 0, 1: [8, 10, 0, 2]
        ```
    """
    indices = step_indices(step, batch_size, rows)
    if indices.size == 0:
        raise ValueError(f"rows={rows} selects no row of a batch of {batch_size}")
    needed = int(indices.max()) + 1
    if not dataset.wait_for_length(needed, timeout=timeout):
        raise TimeoutError(
            f"step {step}: rows up to {needed - 1} were not available within {timeout} s (only {len(dataset)} so far)"
        )
    available = len(dataset)
    if available < needed:
        if available == 0:
            raise ValueError(f"step {step}: the dataset is finished and empty (is seq_len longer than the corpus?)")
        indices = indices % available
    return _stack(dataset.get_batch(indices))


def _stack(examples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.stack([ex[key] for ex in examples]) for key in examples[0]}


class DataLoader:
    """Iterates ``(step, batch)`` from ``start_step`` on, reading batches ahead in a background thread.

    Batch ``s`` is exactly ``batch_for_step(dataset, s, batch_size, rows=rows)``. An exception in the
    background thread is raised by the ``next`` call that would have returned its batch. Close the loader
    (or use it as a context manager) to stop the thread.

    Args:
        dataset: The dataset of dict rows.
        batch_size: Rows per global batch.
        start_step: The first step (to resume a run).
        prefetch: Batches read ahead, at least 1.
        stop_step: Stop before this step; ``None``: iterate forever (a finished dataset wraps around).
        rows: Only these positions of every global batch (see `batch_for_step`).

    Attributes:
        wait_time: Seconds the last ``next`` call waited for its batch (data-loading stalls of the loop).
        total_wait_time: Sum of ``wait_time`` over all batches so far.

    Example:
        ```python
        from ponente.datacache import InMemoryTokenStore, TokenSeqDataset
        from ponente.trainer.data import DataLoader

        ds = TokenSeqDataset(InMemoryTokenStore.from_documents([list(range(32))]), seq_len=4)
        with DataLoader(ds, batch_size=2, start_step=1, stop_step=3) as loader:
            steps = [step for step, batch in loader]
        assert steps == [1, 2]
        ```
    """

    def __init__(
        self,
        dataset: Dataset[dict[str, np.ndarray]],
        batch_size: int,
        *,
        start_step: int = 0,
        prefetch: int = 2,
        stop_step: int | None = None,
        rows: slice | None = None,
    ) -> None:
        """Start the prefetch thread."""
        if prefetch < 1:
            raise ValueError(f"DataLoader: prefetch must be >= 1, got {prefetch}")
        step_indices(start_step, batch_size, rows)  # validates step, batch size and rows early
        self.dataset = dataset
        self.batch_size = batch_size
        self.rows = rows
        self.stop_step = stop_step
        self.wait_time = 0.0
        self.total_wait_time = 0.0
        self._next_step = start_step
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, args=(start_step,), name="DataLoader", daemon=True)
        self._thread.start()

    def _produce(self, step: int) -> None:
        while not self._stop.is_set() and (self.stop_step is None or step < self.stop_step):
            try:
                # Wait in slices, so that close() is not blocked by a wait for rows of a growing dataset.
                item: Any = batch_for_step(self.dataset, step, self.batch_size, rows=self.rows, timeout=_WAIT_SLICE)
            except TimeoutError:
                continue
            except BaseException as exc:  # handed to the consumer, which re-raises it
                self._put((step, exc))
                return
            if not self._put((step, item)):
                return
            step += 1
        self._put((step, StopIteration()))

    def _put(self, item: tuple[int, Any]) -> bool:
        """Put ``item`` unless the loader is closed first; returns whether it was put."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_PUT_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """The loader is its own iterator."""
        return self

    def __next__(self) -> tuple[int, dict[str, np.ndarray]]:
        """The next ``(step, batch)``; records the time waited in `wait_time`.

        Raises:
            StopIteration: At ``stop_step`` or after `close`.
            Exception: Whatever reading the batch raised in the background thread.
        """
        if self._done or self._stop.is_set():
            raise StopIteration
        start = time.perf_counter()
        step, item = self._queue.get()
        self.wait_time = time.perf_counter() - start
        self.total_wait_time += self.wait_time
        if isinstance(item, BaseException):
            self._done = True
            self.close()
            if isinstance(item, StopIteration):
                raise StopIteration
            raise item
        self._next_step = step + 1
        return step, item

    @property
    def next_step(self) -> int:
        """The step of the batch the next ``next`` call returns."""
        return self._next_step

    def close(self) -> None:
        """Stop the prefetch thread and wait for it to end (a read in progress finishes first)."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def is_alive(self) -> bool:
        """Whether the prefetch thread is still running."""
        return self._thread.is_alive()

    def __enter__(self) -> DataLoader:
        """Use as a context manager that closes the loader on exit."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Close the loader."""
        self.close()
