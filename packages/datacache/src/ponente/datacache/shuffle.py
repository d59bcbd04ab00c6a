"""Era shuffle (shuffling a dataset that is still growing) and epochs (repetition, reshuffled each time).

Both are pure index maps built on `FeistelPermutation`, so example ``i`` depends on ``i`` and the seed only.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import numpy.typing as npt

from ponente.datacache.dataset import Dataset, Indices, _as_index, _as_index_array
from ponente.datacache.permutation import FeistelPermutation, _derive_seed

__all__ = ["EpochDataset", "EraShuffleDataset"]

T = TypeVar("T")


def _gather(dataset: Dataset[T], inner: npt.NDArray[np.int64]) -> list[T]:
    return dataset.get_batch(inner) if inner.size else []


class EraShuffleDataset(Dataset[T]):
    """Shuffle within consecutive *eras* of ``era_length`` examples, each era with its own permutation.

    Era ``e`` covers inner examples ``[e * era_length, (e + 1) * era_length)``; example ``i`` of this
    dataset is an example of the same era, chosen by a `FeistelPermutation` keyed by ``(seed, e)``.
    Because an era only needs its own examples, a dataset over a cache that is still building can be
    shuffled as soon as each era has committed: while the inner dataset grows, only full eras are
    visible; once it is finished, the last (partial) era is shuffled too.

    Args:
        dataset: the dataset to shuffle.
        era_length: examples per era, at least 1. Larger eras mix more; the first era is readable once
            ``era_length`` examples exist.
        seed: the seed of the era permutations.

    Raises:
        ValueError: if ``era_length < 1``.

    Example:
        ```python
        from ponente.datacache import EraShuffleDataset, InMemoryTokenStore

        store = InMemoryTokenStore.from_documents([[i] for i in range(10)])
        ds = EraShuffleDataset(store, era_length=4, seed=1)
        [int(ex["input_ids"][0]) for ex in ds.get_batch(range(4))]  # a permutation of [0, 1, 2, 3]
        ```
    """

    def __init__(self, dataset: Dataset[T], era_length: int, seed: int) -> None:
        """Wrap ``dataset``."""
        if era_length < 1:
            raise ValueError(f"EraShuffleDataset: era_length must be at least 1, got {era_length}")
        self.dataset = dataset
        self.era_length = int(era_length)
        self.seed = int(seed)

    @property
    def is_finished(self) -> bool:
        """Whether the inner dataset is finished."""
        return self.dataset.is_finished

    def _lengths(self) -> tuple[int, int]:
        """(visible length, inner length): the inner length rounded down to full eras unless finished."""
        finished = self.dataset.is_finished  # before len(): a finished dataset's length is final
        n = len(self.dataset)
        return (n if finished else n - n % self.era_length), n

    def __len__(self) -> int:
        """Examples in the full eras so far, or all examples once the inner dataset is finished."""
        return self._lengths()[0]

    def _map(self, idx: npt.NDArray[np.int64], visible: int) -> npt.NDArray[np.int64]:
        eras = idx // self.era_length
        out = np.empty_like(idx)
        for era in np.unique(eras):
            sel = eras == era
            base = int(era) * self.era_length
            size = min(self.era_length, visible - base)
            perm = FeistelPermutation(size, _derive_seed(self.seed, int(era)))
            out[sel] = base + perm(idx[sel] - base)
        return out

    def __getitem__(self, index: int) -> T:
        """Return the inner example that position ``index`` maps to."""
        visible, _ = self._lengths()
        i = _as_index(index, visible, name="EraShuffleDataset")
        return self.dataset[int(self._map(np.array([i], dtype=np.int64), visible)[0])]

    def get_batch(self, indices: Indices) -> list[T]:
        """Return the inner examples that ``indices`` map to (one inner `get_batch` call)."""
        visible, _ = self._lengths()
        idx = _as_index_array(indices, visible, name="EraShuffleDataset")
        return _gather(self.dataset, self._map(idx, visible))

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Wait until the eras covering ``length`` examples are complete, or the inner dataset finishes."""
        if length is None:
            return self.dataset.wait_for_length(None, timeout=timeout)
        needed = -(-length // self.era_length) * self.era_length
        return self.dataset.wait_for_length(needed, timeout=timeout)


class EpochDataset(Dataset[T]):
    """``num_epochs`` passes over a dataset, each in a different order (or in order if ``seed`` is None).

    Example ``i`` is example ``π_e(i mod n)`` of the inner dataset, where ``n`` is its length,
    ``e = i // n`` the epoch and ``π_e`` a `FeistelPermutation` keyed by ``(seed, e)``. The epoch length
    must be final, so over a dataset that is still growing this dataset has length 0 until the inner
    one is finished (`wait_for_length` and `get_batch_async` wait for that).

    Args:
        dataset: the dataset to repeat.
        num_epochs: number of passes, at least 1.
        seed: seed of the per-epoch shuffles; ``None`` repeats the dataset in its own order.

    Raises:
        ValueError: if ``num_epochs < 1``.

    Example:
        ```python
        from ponente.datacache import EpochDataset, InMemoryTokenStore

        store = InMemoryTokenStore.from_documents([[i] for i in range(3)])
        ds = EpochDataset(store, num_epochs=2)
        [int(ex["input_ids"][0]) for ex in ds.get_batch(range(len(ds)))]  # [0, 1, 2, 0, 1, 2]
        ```
    """

    def __init__(self, dataset: Dataset[T], num_epochs: int, *, seed: int | None = None) -> None:
        """Wrap ``dataset``."""
        if num_epochs < 1:
            raise ValueError(f"EpochDataset: num_epochs must be at least 1, got {num_epochs}")
        self.dataset = dataset
        self.num_epochs = int(num_epochs)
        self.seed = seed

    @property
    def is_finished(self) -> bool:
        """Whether the inner dataset is finished."""
        return self.dataset.is_finished

    def _epoch_length(self) -> int:
        return len(self.dataset) if self.dataset.is_finished else 0

    def __len__(self) -> int:
        """``num_epochs`` times the inner length once it is final; 0 before."""
        return self.num_epochs * self._epoch_length()

    def _map(self, idx: npt.NDArray[np.int64], n: int) -> npt.NDArray[np.int64]:
        epochs, within = np.divmod(idx, n)
        if self.seed is None:
            return within
        out = np.empty_like(idx)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = FeistelPermutation(n, _derive_seed(self.seed, int(epoch)))(within[sel])
        return out

    def __getitem__(self, index: int) -> T:
        """Return the inner example that position ``index`` maps to."""
        n = self._epoch_length()
        i = _as_index(index, self.num_epochs * n, name="EpochDataset")
        return self.dataset[int(self._map(np.array([i], dtype=np.int64), n)[0])]

    def get_batch(self, indices: Indices) -> list[T]:
        """Return the inner examples that ``indices`` map to (one inner `get_batch` call)."""
        n = self._epoch_length()
        idx = _as_index_array(indices, self.num_epochs * n, name="EpochDataset")
        return _gather(self.dataset, self._map(idx, n)) if idx.size else []

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Wait until the inner dataset is finished (an epoch needs its final length)."""
        return self.dataset.wait_for_length(None, timeout=timeout)
