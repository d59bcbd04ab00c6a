"""Whole examples packed into fixed-length rows, with segment ids, restarting positions and a loss mask.

Unlike `TokenSeqDataset`, which cuts the token stream into windows anywhere, `PackedExampleDataset`
never splits an example across rows: supervised and chat examples (a prompt and its response) must be
seen whole. Packing is greedy and in order, so the rows are a function of the examples alone and do not
change while the cache grows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ponente.datacache.dataset import Dataset, Indices, TokenStore, _as_index, _as_index_array

__all__ = ["PAD_SEGMENT_ID", "PackedExampleDataset"]

logger = logging.getLogger(__name__)

PAD_SEGMENT_ID = -1
"""The segment id of padding (no example has it, so padding never attends to, or is attended by, an example)."""

_KEYS = ("input_ids", "segment_ids", "loss_mask", "position_ids")


class PackedExampleDataset(Dataset[dict[str, np.ndarray]]):
    """Rows of ``seq_len`` tokens, each holding whole examples of a cache, padded at the end.

    Row ``i`` is a dict of four int32 arrays of shape ``(seq_len,)``:

    - ``"input_ids"``: the tokens of the row's examples end to end, then ``pad_id``;
    - ``"segment_ids"``: ``0, 1, 2, ...`` per example inside the row, `PAD_SEGMENT_ID` (-1) on padding;
    - ``"loss_mask"``: *target-aligned* (1 = the token is a training target): the cache's ``loss_mask``
      field, or all ones for a cache without one; 0 on padding;
    - ``"position_ids"``: ``0, 1, 2, ...`` restarting at each example; 0 on padding.

    Packing (``pack=True``) is greedy in cache order: an example goes into the current row if it fits, else
    it starts the next row. A row is complete once the next example does not fit, once it is full, or
    once the cache is finished, so its contents depend only on the examples before it and ``len`` grows
    with the cache like `TokenSeqDataset`. With ``pack=False`` every example gets a row of its own.
    Examples longer than ``seq_len`` are truncated to their first ``seq_len`` tokens and counted in
    `truncated` (logged once); empty examples are dropped.

    The example offsets of the cache are mirrored in memory (8 bytes per example) plus the first example
    of each row.

    Args:
        cache: A token store with an ``input_ids`` field and, optionally, a ``loss_mask`` field with the same
            row lengths (e.g. a cache built by `SupervisedProcessor` or `ChatProcessor`).
        seq_len: Tokens per row, at least 1.
        pack: Pack several examples per row (``False``: one example per row, padded).
        pad_id: The token id of padding.

    Raises:
        ValueError: If ``seq_len < 1``.

    Example:
        ```python
        from ponente.datacache import InMemoryTokenStore, PackedExampleDataset

        store = InMemoryTokenStore.from_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
        ds = PackedExampleDataset(store, seq_len=6)
        len(ds)  # 2: [1, 2, 3, 4, 5] and [6, 7, 8, 9]
        ds[0]["segment_ids"].tolist()  # [0, 0, 0, 1, 1, -1]
        ds[0]["position_ids"].tolist()  # [0, 1, 2, 0, 1, 0]
        ```
    """

    def __init__(self, cache: TokenStore, seq_len: int, *, pack: bool = True, pad_id: int = 0) -> None:
        """Wrap ``cache``; packs the examples committed so far."""
        if seq_len < 1:
            raise ValueError(f"PackedExampleDataset: seq_len must be at least 1, got {seq_len}")
        self.cache = cache
        self.seq_len = int(seq_len)
        self.pack = bool(pack)
        self.pad_id = int(pad_id)
        self._has_mask = _has_field(cache, "loss_mask")
        self._lock = threading.Lock()
        self._offsets = np.zeros(1, dtype=np.int64)  # of the examples scanned so far
        self._row_starts = np.zeros(0, dtype=np.int64)  # first example of each row, the open row included
        self._fill = 0  # tokens in the last row
        self._truncated = 0
        self._finished = False
        self._refresh()

    @property
    def truncated(self) -> int:
        """How many examples scanned so far were longer than ``seq_len`` (and so cut)."""
        return self._truncated

    def _complete_rows(self) -> int:
        rows = self._row_starts.size
        if rows and self.pack and not self._finished and self._fill < self.seq_len:
            return rows - 1  # the last row may still take more examples
        return rows

    def _refresh(self) -> int:
        """Pack the examples committed since the last call; return the number of complete rows."""
        if self._finished:
            return self._row_starts.size
        with self._lock:
            finished = self.cache.is_finished  # before the length: if finished then, the length is final
            examples = len(self.cache)
            seen = self._offsets.size - 1
            if examples > seen:
                new = np.asarray(self.cache.row_offsets(seen, examples), dtype=np.int64)
                if new.size != examples - seen + 1 or new[0] != self._offsets[-1] or np.any(np.diff(new) < 0):
                    raise RuntimeError(
                        f"PackedExampleDataset: the store's row offsets for rows {seen}..{examples} do not continue "
                        f"the ones read before (expected {int(self._offsets[-1])} first, got {new[:1].tolist()}); "
                        "the cache changed under a reader"
                    )
                self._pack(np.diff(new), seen)
                self._offsets = np.concatenate([self._offsets, new[1:]])
            self._finished = finished
            return self._complete_rows()

    def _pack(self, lengths: npt.NDArray[np.int64], first: int) -> None:
        """Assign the examples ``first, first + 1, ...`` of ``lengths`` to rows (greedy, in order)."""
        seq_len, fill, starts = self.seq_len, self._fill, []
        for k, length in enumerate(lengths.tolist()):
            if length == 0:
                continue  # no tokens: belongs to whichever row is open, and adds nothing to it
            if length > seq_len:
                if self._truncated == 0:
                    logger.warning(
                        "PackedExampleDataset: example %d has %d tokens, more than seq_len=%d; it is truncated "
                        "(later truncations are counted in .truncated, not logged)",
                        first + k,
                        length,
                        seq_len,
                    )
                self._truncated += 1
                length = seq_len
            if not self.pack or fill == 0 or fill + length > seq_len:
                starts.append(first + k)
                fill = length
            else:
                fill += length
        self._fill = fill
        if starts:
            self._row_starts = np.concatenate([self._row_starts, np.asarray(starts, dtype=np.int64)])

    @property
    def is_finished(self) -> bool:
        """Whether the cache is finished (and so the number of rows final)."""
        self._refresh()
        return self._finished

    def __len__(self) -> int:
        """Number of complete rows."""
        return self._refresh()

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Block until ``length`` rows are complete or the cache is finished (waits on the cache).

        Returns:
            ``True`` if satisfied, ``False`` on timeout.
        """
        # How many examples the next row needs is unknown: wait for one more example at a time.
        return wait_for_rows(self, length, timeout, lambda: self._offsets.size)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Row ``index`` as ``{"input_ids", "segment_ids", "loss_mask", "position_ids"}``."""
        _as_index(index, len(self), name="PackedExampleDataset")
        batch = self.get_batch_arrays([index])
        return {key: value[0] for key, value in batch.items()}

    def get_batch(self, indices: Indices) -> list[dict[str, np.ndarray]]:
        """Rows at ``indices``, one dict per row (views into one batch array; see `get_batch_arrays`)."""
        batch = self.get_batch_arrays(indices)
        return [{key: batch[key][k] for key in _KEYS} for k in range(batch["input_ids"].shape[0])]

    def get_batch_arrays(self, indices: Indices) -> dict[str, np.ndarray]:
        """Rows at ``indices`` as stacked ``(batch, seq_len)`` int32 arrays.

        Raises:
            IndexError: Naming the first index that is negative or not (yet) available.
        """
        rows = self._refresh()
        idx = _as_index_array(indices, rows, name="PackedExampleDataset")
        with self._lock:  # a consistent snapshot: a concurrent refresh replaces both arrays (never mutates them)
            offsets, starts = self._offsets, self._row_starts
        seq_len = self.seq_len
        out = {
            "input_ids": np.full((idx.size, seq_len), self.pad_id, dtype=np.int32),
            "segment_ids": np.full((idx.size, seq_len), PAD_SEGMENT_ID, dtype=np.int32),
            "loss_mask": np.zeros((idx.size, seq_len), dtype=np.int32),
            "position_ids": np.zeros((idx.size, seq_len), dtype=np.int32),
        }
        for k, row in enumerate(idx.tolist()):
            first = int(starts[row])
            stop = int(starts[row + 1]) if row + 1 < starts.size else offsets.size - 1
            lengths = np.diff(offsets[first : stop + 1])
            lengths = lengths[lengths > 0]
            if lengths.sum() > seq_len:  # one truncated example (it has a row of its own)
                lengths = np.array([seq_len], dtype=np.int64)
            lo = int(offsets[first])
            hi = lo + int(lengths.sum())
            n = hi - lo
            out["input_ids"][k, :n] = self.cache.read_flat(lo, hi)
            if self._has_mask:
                out["loss_mask"][k, :n] = self.cache.read_flat(lo, hi, "loss_mask")
            else:
                out["loss_mask"][k, :n] = 1
            out["segment_ids"][k, :n] = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)
            ends = np.cumsum(lengths)
            out["position_ids"][k, :n] = np.arange(n) - np.repeat(ends - lengths, lengths)
        return out


def wait_for_rows(ds: Any, length: int | None, timeout: float | None, next_examples: Callable[[], int]) -> bool:
    """``wait_for_length`` of a dataset cut from a growing cache: refresh, and wait on the cache until ``length``
    rows are readable or it is finished.

    Args:
        ds: the dataset: its ``_refresh()`` returns the rows readable now, ``_finished`` says the cache is finished,
            ``cache`` is the token store.
        length: the rows to wait for (None: until the cache is finished).
        timeout: seconds (None: no limit).
        next_examples: how many examples of the cache to wait for next.

    Returns:
        ``True`` if satisfied, ``False`` on timeout.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        rows = ds._refresh()
        if ds._finished or (length is not None and rows >= length):
            return True
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        ds.cache.wait_until(rows=next_examples(), timeout=remaining)


def _has_field(cache: TokenStore, field: str) -> bool:
    """Whether ``cache`` stores ``field`` (probed with an empty read; stores raise ``KeyError`` for unknown ones)."""
    try:
        cache.read_flat(0, 0, field)
    except KeyError:
        return False
    return True
