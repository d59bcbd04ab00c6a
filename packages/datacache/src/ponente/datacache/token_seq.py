"""Fixed-length token windows over the concatenated documents of a token store, cut at read time.

Window ``i`` is ``flat[i * seq_len : (i + 1) * seq_len]`` of the store's flat token array (all documents
end to end), so changing ``seq_len`` re-reads the same cache and never retokenizes. Each example carries
``segment_ids`` that tell documents apart inside the window, from which the trainer builds segment
(document) attention masks.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import numpy.typing as npt

from ponente.datacache.dataset import Dataset, Indices, TokenStore, _as_index, _as_index_array

__all__ = ["TokenSeqDataset"]


class TokenSeqDataset(Dataset[dict[str, np.ndarray]]):
    """Windows of ``seq_len`` consecutive tokens of a `TokenStore`, with document segment ids.

    Example ``i`` is a dict with:

    - ``"input_ids"``: ``flat[i * seq_len : (i + 1) * seq_len]``, shape ``(seq_len,)``, the store's dtype;
    - ``"segment_ids"``: int32, shape ``(seq_len,)``: ``0`` for the document the window starts in,
      then ``+1`` at each document start inside the window. Two tokens may attend to each other in a
      document-masked model iff their segment ids are equal.

    The length is the number of *full* windows of the committed tokens (a trailing partial window is
    never returned); it grows while the cache builds. The document starts of the store are mirrored in
    memory (8 bytes per non-empty document) and extended incrementally as rows commit.

    Args:
        cache: the token store (e.g. ``open_cache(DIR)`` or an `InMemoryTokenStore`).
        seq_len: tokens per window, at least 1.

    Raises:
        ValueError: if ``seq_len < 1``.

    Example:
        ```python
        from ponente.datacache import InMemoryTokenStore, TokenSeqDataset

        store = InMemoryTokenStore.from_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
        ds = TokenSeqDataset(store, seq_len=4)
        ex = ds[1]
        ex["input_ids"].tolist()  # [5, 6, 7, 8]
        ex["segment_ids"].tolist()  # [0, 1, 1, 1]
        ```
    """

    def __init__(self, cache: TokenStore, seq_len: int) -> None:
        """Wrap ``cache``; reads the row offsets committed so far."""
        if seq_len < 1:
            raise ValueError(f"TokenSeqDataset: seq_len must be at least 1, got {seq_len}")
        self.cache = cache
        self.seq_len = int(seq_len)
        self._lock = threading.Lock()
        self._rows = 0
        self._bounds = np.zeros(1, dtype=np.int64)
        self._finished = False
        self._refresh()

    def _refresh(self) -> npt.NDArray[np.int64]:
        """Extend the mirrored document starts with rows committed since the last call; return them.

        Returns the distinct row offsets (empty documents add none), ending with the committed token count.
        """
        if self._finished:
            return self._bounds
        with self._lock:
            # Read the flag before the length: if the store was finished then, the length read after is final.
            finished = self.cache.is_finished
            rows = len(self.cache)
            if rows > self._rows:
                new = np.asarray(self.cache.row_offsets(self._rows, rows), dtype=np.int64)
                if new.size != rows - self._rows + 1 or new[0] != self._bounds[-1] or np.any(np.diff(new) < 0):
                    raise RuntimeError(
                        f"TokenSeqDataset: the store's row offsets for rows {self._rows}..{rows} do not continue "
                        f"the ones read before (expected {int(self._bounds[-1])} first, got {new[:1].tolist()}); "
                        "the cache changed under a reader"
                    )
                self._bounds = np.concatenate([self._bounds, new[1:][np.diff(new) > 0]])
                self._rows = rows
            self._finished = finished
            return self._bounds

    @property
    def is_finished(self) -> bool:
        """Whether the store is finished (and so the number of windows final)."""
        self._refresh()
        return self._finished

    def __len__(self) -> int:
        """Number of full windows of the committed tokens."""
        return int(self._refresh()[-1]) // self.seq_len

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Block until ``length`` windows are committed or the store is finished (waits on the store).

        Returns:
            ``True`` if satisfied, ``False`` on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            bounds = self._refresh()
            if self._finished or (length is not None and int(bounds[-1]) // self.seq_len >= length):
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            # The token count of future rows is unknown: wait for one more row at a time.
            self.cache.wait_until(rows=self._rows + 1, timeout=remaining)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Window ``index`` as ``{"input_ids", "segment_ids"}``."""
        _as_index(index, len(self), name="TokenSeqDataset")
        batch = self.get_batch_arrays([index])
        return {key: value[0] for key, value in batch.items()}

    def get_batch(self, indices: Indices) -> list[dict[str, np.ndarray]]:
        """Windows at ``indices``, one dict per window (views into one batch array; see `get_batch_arrays`)."""
        batch = self.get_batch_arrays(indices)
        ids, segs = batch["input_ids"], batch["segment_ids"]
        return [{"input_ids": ids[k], "segment_ids": segs[k]} for k in range(ids.shape[0])]

    def get_batch_arrays(self, indices: Indices) -> dict[str, np.ndarray]:
        """Windows at ``indices`` as stacked arrays: the fast path for training.

        Args:
            indices: window indices, each in ``[0, len(self))``.

        Returns:
            ``{"input_ids": (batch, seq_len) array, "segment_ids": (batch, seq_len) int32 array}``.

        Raises:
            IndexError: naming the first index that is negative or not (yet) available.
        """
        bounds = self._refresh()
        length = int(bounds[-1]) // self.seq_len
        idx = _as_index_array(indices, length, name="TokenSeqDataset")
        seq_len = self.seq_len
        starts = idx * seq_len
        pieces = [self.cache.read_flat(int(s), int(s) + seq_len) for s in starts]
        if pieces:
            input_ids = np.stack(pieces)
        else:
            input_ids = np.zeros((0, seq_len), dtype=self.cache.read_flat(0, 0).dtype)
        return {"input_ids": input_ids, "segment_ids": _segment_ids(bounds, starts, seq_len)}


def _segment_ids(bounds: npt.NDArray[np.int64], starts: npt.NDArray[np.int64], seq_len: int) -> np.ndarray:
    """Segment ids of windows ``[s, s + seq_len)`` for each ``s`` in ``starts``, given distinct document starts.

    The ids of a window are runs ``0, 1, 2, ...`` cut at the document starts strictly inside it (``bounds``
    values ``b`` with ``s < b < s + seq_len``). Built as one ``np.repeat`` of run values over run lengths for
    the whole batch.
    """
    batch = starts.size
    first = np.searchsorted(bounds, starts, side="right")
    last = np.searchsorted(bounds, starts + seq_len, side="left")
    inner_counts = np.maximum(last - first, 0)
    window = np.repeat(np.arange(batch, dtype=np.int64), inner_counts)
    # For each window w, the indices first[w], first[w] + 1, ..., last[w] - 1 of its inner document starts.
    rank = np.arange(window.size) - np.repeat(np.cumsum(inner_counts) - inner_counts, inner_counts)
    inner = bounds[np.repeat(first, inner_counts) + rank]
    # Run starts in the flattened (batch * seq_len) output: each window's start, then its inner cuts.
    cuts = np.concatenate([np.arange(batch, dtype=np.int64) * seq_len, window * seq_len + inner - starts[window]])
    cuts.sort(kind="stable")
    runs = inner_counts + 1
    values = np.arange(cuts.size) - np.repeat(np.cumsum(runs) - runs, runs)
    lengths = np.diff(cuts, append=batch * seq_len)
    return np.repeat(values.astype(np.int32), lengths).reshape(batch, seq_len)
