"""The random-access dataset abstraction, the `TokenStore` protocol, and an in-memory token store.

Random access by index is the primitive: a dataset has a length and returns example ``i`` on request.
Every wrapper (windows, shuffles, epochs, mixtures) maps an index to indices of the datasets below it,
so any position of a data pipeline can be recomputed from an index alone, with no iterator state.

A dataset may *grow*: while a cache is being built, ``len()`` counts the examples available now and
``is_finished`` says whether more will come. ``wait_for_length`` blocks until enough examples exist, and
``get_batch_async`` waits for the rows it needs without blocking an event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["Dataset", "InMemoryTokenStore", "TokenStore"]

T = TypeVar("T")

#: Indices accepted by ``get_batch``: a sequence of ints or a 1-D integer NumPy array.
Indices = Sequence[int] | npt.NDArray[np.integer]


@runtime_checkable
class TokenStore(Protocol):
    """What a token cache provides to the datasets layer: one flat token array cut into rows by offsets.

    The on-disk cache returned by ``open_cache`` implements this protocol, and so does
    `InMemoryTokenStore`. Only *committed* rows are ever visible; while the cache is being built, the
    number of rows grows and ``is_finished`` is ``False``.
    """

    @property
    def is_finished(self) -> bool:
        """Whether the store is complete (no more rows will be committed)."""
        ...

    def __len__(self) -> int:
        """Number of committed rows."""
        ...

    def num_tokens(self, field: str = "input_ids") -> int:
        """Committed length of the flat data array of ``field``."""
        ...

    def read_flat(self, start: int, stop: int, field: str = "input_ids") -> np.ndarray:
        """Return ``flat[start:stop]`` of the flat data array of ``field``."""
        ...

    def row_offsets(self, start_row: int, stop_row: int) -> np.ndarray:
        """Return the ``stop_row - start_row + 1`` offsets of rows ``start_row..stop_row`` (int64).

        Row ``i`` spans ``flat[off[i]:off[i + 1]]``. Valid for ``0 <= start_row <= stop_row <= len(self)``.
        """
        ...

    def wait_until(self, *, rows: int | None = None, timeout: float | None = None) -> bool:
        """Block until at least ``rows`` rows are committed or the store is finished.

        ``rows=None`` waits until the store is finished. Returns ``True`` if satisfied, ``False`` on timeout.
        """
        ...


def _as_index_array(indices: Indices, length: int, *, name: str) -> npt.NDArray[np.int64]:
    """Validate ``indices`` against ``length`` and return them as a 1-D int64 array.

    Raises:
        TypeError: if the indices are not integers.
        IndexError: naming the first offending index if one is negative or ``>= length``.
    """
    arr = np.asarray(indices)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise TypeError(f"{name}: expected a 1-D sequence of indices, got an array of shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: indices must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    bad = (arr < 0) | (arr >= length)
    if bad.any():
        first = int(arr[np.argmax(bad)])
        raise IndexError(_out_of_range_message(name, first, length))
    return arr


def _as_index(index: int, length: int, *, name: str) -> int:
    """Validate a single index against ``length`` and return it as a Python int.

    Raises:
        TypeError: if ``index`` is not an integer.
        IndexError: if ``index`` is negative or ``>= length``.
    """
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        raise TypeError(f"{name}: index must be an integer, got {type(index).__name__}")
    i = int(index)
    if i < 0 or i >= length:
        raise IndexError(_out_of_range_message(name, i, length))
    return i


def _out_of_range_message(name: str, index: int, length: int) -> str:
    if index < 0:
        return f"{name}: negative index {index} (datasets may grow, so indices count from the start only)"
    return f"{name}: index {index} is out of range for a dataset with {length} examples available"


class Dataset(ABC, Generic[T]):
    """A random-access dataset: a length and example ``i`` on request, possibly growing.

    Subclasses implement `__len__` and `__getitem__`; they may override `get_batch` to read a batch
    faster than one example at a time, and `is_finished` / `wait_for_length` if they can grow.

    Example:
        ```python
        from ponente.datacache import InMemoryTokenStore, TokenSeqDataset

        store = InMemoryTokenStore.from_documents([[1, 2, 3], [4, 5, 6, 7, 8]])
        ds = TokenSeqDataset(store, seq_len=4)
        assert len(ds) == 2 and ds.is_finished
        ds[1]["input_ids"].tolist()  # [5, 6, 7, 8]
        ```
    """

    @abstractmethod
    def __len__(self) -> int:
        """Number of examples available now (grows while the underlying cache builds)."""

    @abstractmethod
    def __getitem__(self, index: int) -> T:
        """Return example ``index``.

        Raises:
            IndexError: if ``index`` is negative or not (yet) available.
        """

    @property
    def is_finished(self) -> bool:
        """Whether the length is final. Datasets over a cache that is still building return ``False``."""
        return True

    def get_batch(self, indices: Indices) -> list[T]:
        """Return the examples at ``indices``, in order (duplicates allowed).

        Args:
            indices: example indices, each in ``[0, len(self))``.

        Returns:
            A list with one example per index.

        Raises:
            IndexError: naming the first index that is negative or not available.
        """
        idx = _as_index_array(indices, len(self), name=type(self).__name__)
        return [self[int(i)] for i in idx]

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Block until at least ``length`` examples are available or the dataset is finished.

        The default implementation polls; datasets over a growing store override it to wait on the store.

        Args:
            length: the number of examples to wait for; ``None`` waits until the dataset is finished.
            timeout: the most seconds to wait; ``None`` waits forever.

        Returns:
            ``True`` if ``length`` examples are available or the dataset is finished, ``False`` on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            if self.is_finished or (length is not None and len(self) >= length):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            remaining = 0.25 if deadline is None else max(0.0, deadline - time.monotonic())
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.25)

    async def get_batch_async(self, indices: Indices, *, timeout: float | None = None) -> list[T]:
        """Like `get_batch`, but first wait (without blocking the event loop) until the indices exist.

        Waiting and reading run in a worker thread, so a training loop can prefetch batches of a cache
        that is still being built.

        Args:
            indices: example indices; they need not be available yet.
            timeout: the most seconds to wait for the examples; ``None`` waits forever.

        Returns:
            The examples at ``indices``.

        Raises:
            TimeoutError: if the examples did not become available within ``timeout`` seconds.
            IndexError: if the dataset finished without reaching the largest index.
        """
        idx = np.asarray(indices)
        # Non-integer indices are not waited for; get_batch below rejects them with a clear error.
        needed = int(idx.max()) + 1 if idx.size and np.issubdtype(idx.dtype, np.integer) else 0
        ok = await asyncio.to_thread(self.wait_for_length, needed, timeout=timeout)
        if not ok:
            raise TimeoutError(
                f"{type(self).__name__}: {needed} examples were not available within {timeout} s "
                f"(only {len(self)} so far)"
            )
        return await asyncio.to_thread(self.get_batch, idx)

    async def getitem_async(self, index: int, *, timeout: float | None = None) -> T:
        """Like ``self[index]``, but first wait (without blocking the event loop) until it exists.

        Raises:
            TimeoutError: if the example did not become available within ``timeout`` seconds.
            IndexError: if the dataset finished without reaching ``index``.
        """
        (example,) = await self.get_batch_async([index], timeout=timeout)
        return example


class InMemoryTokenStore(Dataset[dict[str, np.ndarray]]):
    """A `TokenStore` held in memory, optionally growing: for tests, examples and small corpora.

    Rows are documents of token ids (one field, ``"input_ids"`` by default). Rows can be appended from
    another thread while readers wait for them, which mimics a cache that is being built. As a dataset,
    row ``i`` is ``{field: tokens}``.

    Args:
        dtype: dtype of the token ids.
        field: name of the single field.

    Example:
        ```python
        from ponente.datacache import InMemoryTokenStore

        store = InMemoryTokenStore(finished=False)
        store.append([[1, 2], [3]])
        store.finish()
        assert len(store) == 2 and store.num_tokens() == 3
        store[1]["input_ids"].tolist()  # [3]
        ```
    """

    def __init__(self, *, dtype: npt.DTypeLike = np.int32, field: str = "input_ids", finished: bool = False) -> None:
        """Create an empty store; ``finished=True`` makes it final (and so forever empty)."""
        self._dtype = np.dtype(dtype)
        self._field = field
        self._chunks: list[np.ndarray] = []
        self._flat = np.zeros(0, dtype=self._dtype)
        self._offsets = np.zeros(1, dtype=np.int64)
        self._finished = finished
        self._cond = threading.Condition()

    @classmethod
    def from_documents(
        cls,
        documents: Sequence[npt.ArrayLike],
        *,
        dtype: npt.DTypeLike = np.int32,
        field: str = "input_ids",
        finished: bool = True,
    ) -> InMemoryTokenStore:
        """Build a store from a list of token-id sequences (one row each).

        Args:
            documents: the rows, each a 1-D sequence of token ids (may be empty).
            dtype: dtype of the token ids.
            field: name of the single field.
            finished: whether the store is final; pass ``False`` to `append` more rows later.

        Returns:
            The store.
        """
        store = cls(dtype=dtype, field=field)
        store.append(documents)
        if finished:
            store.finish()
        return store

    def append(self, documents: Sequence[npt.ArrayLike]) -> None:
        """Commit more rows and wake readers waiting for them.

        Raises:
            RuntimeError: if the store is finished.
            ValueError: naming the row if a document is not a 1-D sequence of integers.
        """
        arrays = []
        for k, doc in enumerate(documents):
            arr = np.asarray(doc)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise ValueError(
                    f"InMemoryTokenStore.append: document {k} must be a 1-D sequence of integer token ids, "
                    f"got shape {arr.shape} and dtype {arr.dtype}"
                )
            arrays.append(arr.astype(self._dtype))
        with self._cond:
            if self._finished:
                raise RuntimeError("InMemoryTokenStore.append: the store is finished; no rows can be added")
            if not arrays:
                return
            lengths = np.array([a.size for a in arrays], dtype=np.int64)
            # Replace (never mutate) the arrays, so readers holding the old ones see a consistent snapshot.
            self._flat = np.concatenate([self._flat, *arrays])
            self._offsets = np.concatenate([self._offsets, self._offsets[-1] + np.cumsum(lengths)])
            self._cond.notify_all()

    def finish(self) -> None:
        """Mark the store final and wake every waiting reader."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    @property
    def is_finished(self) -> bool:
        """Whether `finish` has been called."""
        return self._finished

    def __len__(self) -> int:
        """Number of committed rows."""
        return len(self._offsets) - 1

    def _check_field(self, field: str) -> None:
        if field != self._field:
            raise KeyError(f"InMemoryTokenStore: no field {field!r}; this store has only {self._field!r}")

    def num_tokens(self, field: str = "input_ids") -> int:
        """Committed length of the flat token array."""
        self._check_field(field)
        return int(self._offsets[-1])

    def read_flat(self, start: int, stop: int, field: str = "input_ids") -> np.ndarray:
        """Return ``flat[start:stop]`` (a read-only view).

        Raises:
            IndexError: if the range is not within the committed tokens.
        """
        self._check_field(field)
        flat = self._flat
        if not 0 <= start <= stop <= flat.size:
            raise IndexError(f"InMemoryTokenStore.read_flat: range [{start}, {stop}) not within [0, {flat.size})")
        view = flat[start:stop]
        view.flags.writeable = False
        return view

    def row_offsets(self, start_row: int, stop_row: int) -> np.ndarray:
        """Offsets of rows ``start_row..stop_row`` into the flat array (``stop_row - start_row + 1`` values).

        Raises:
            IndexError: if not ``0 <= start_row <= stop_row <= len(self)``.
        """
        offsets = self._offsets
        if not 0 <= start_row <= stop_row <= offsets.size - 1:
            raise IndexError(
                f"InMemoryTokenStore.row_offsets: rows [{start_row}, {stop_row}] not within "
                f"[0, {offsets.size - 1}] committed rows"
            )
        return offsets[start_row : stop_row + 1].copy()

    def wait_until(self, *, rows: int | None = None, timeout: float | None = None) -> bool:
        """Block until ``rows`` rows are committed or the store is finished (``rows=None``: finished)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._finished or (rows is not None and len(self) >= rows), timeout=timeout
            )

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Dataset view of `wait_until`: rows are the examples."""
        return self.wait_until(rows=length, timeout=timeout)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Row ``index`` as ``{field: tokens}``."""
        offsets = self._offsets
        i = _as_index(index, offsets.size - 1, name="InMemoryTokenStore")
        return {self._field: self.read_flat(int(offsets[i]), int(offsets[i + 1]), self._field)}
