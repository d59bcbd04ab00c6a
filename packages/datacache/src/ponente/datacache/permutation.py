"""A stateless, keyed permutation of ``[0, n)`` (a Feistel network) and the shuffle it gives a dataset.

The permutation is a pure function of ``(n, seed, index)``: nothing is materialised, so shuffling a
dataset of billions of examples costs no memory, and example ``i`` of a shuffled dataset can be
recomputed from ``i`` alone. A balanced Feistel network over ``2k``-bit integers is a bijection of
``[0, 4**k)``; *cycle walking* (re-applying it until the value falls below ``n``) restricts it to a
bijection of ``[0, n)`` for any ``n``, not only powers of two.
"""

from __future__ import annotations

import threading
from typing import TypeVar, overload

import numpy as np
import numpy.typing as npt

from ponente.datacache.dataset import Dataset, Indices, _as_index, _as_index_array

__all__ = ["FeistelPermutation", "PermutationDataset"]

T = TypeVar("T")

_MASK64 = (1 << 64) - 1
_MAX_LENGTH = 1 << 62


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 on Python ints: a well-mixed 64-bit value from a 64-bit state."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _derive_seed(seed: int, *tags: int) -> int:
    """A 64-bit seed derived from ``seed`` and integer ``tags`` (e.g. an epoch or block number).

    Different tags give independent-looking seeds, so each epoch/era/block gets its own permutation.
    """
    h = _splitmix64(seed & _MASK64)
    for tag in tags:
        h = _splitmix64(h ^ (tag & _MASK64))
    return h


def _mix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The SplitMix64 finaliser, vectorised on uint64 arrays (wrap-around multiplication is intended)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A keyed bijection of ``[0, length)``, computed index by index (vectorised over NumPy arrays).

    Args:
        length: size of the domain, ``0 <= length < 2**62``.
        seed: any integer; different seeds give unrelated permutations.
        rounds: number of Feistel rounds (at least 3; 6 by default).

    Raises:
        ValueError: if ``length`` or ``rounds`` is out of range.

    Example:
        ```python
        import numpy as np
        from ponente.datacache import FeistelPermutation

        perm = FeistelPermutation(10, seed=42)
        shuffled = perm(np.arange(10))
        assert sorted(shuffled.tolist()) == list(range(10))
        assert perm.inverse(shuffled).tolist() == list(range(10))
        ```
    """

    def __init__(self, length: int, seed: int, *, rounds: int = 6) -> None:
        """Build the permutation (cheap: derives one 64-bit key per round)."""
        if not 0 <= length < _MAX_LENGTH:
            raise ValueError(f"FeistelPermutation: length must be in [0, 2**62), got {length}")
        if rounds < 3:
            raise ValueError(f"FeistelPermutation: rounds must be at least 3, got {rounds}")
        self.length = int(length)
        self.seed = int(seed)
        # Half width in bits: the network permutes [0, 4**half) ⊇ [0, length), with 4**half < 4 * length,
        # so cycle walking needs fewer than 4 passes on average.
        half = 1
        while (1 << (2 * half)) < self.length:
            half += 1
        self._half = np.uint64(half)
        self._mask = np.uint64((1 << half) - 1)
        keys, state = [], self.seed & _MASK64
        for _ in range(rounds):
            state = _splitmix64(state)
            keys.append(np.uint64(state))
        self._keys = keys

    def _encrypt(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._mask)
        return (left << self._half) | right

    def _decrypt(self, y: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        left, right = y >> self._half, y & self._mask
        for key in reversed(self._keys):
            left, right = right ^ (_mix64(left ^ key) & self._mask), left
        return (left << self._half) | right

    def _walk(self, indices: npt.ArrayLike, forward: bool) -> npt.NDArray[np.int64]:
        idx = np.asarray(indices)
        if idx.size and not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"FeistelPermutation: indices must be integers, got dtype {idx.dtype}")
        flat = idx.reshape(-1).astype(np.int64)
        bad = (flat < 0) | (flat >= self.length)
        if bad.any():
            raise IndexError(
                f"FeistelPermutation: index {int(flat[np.argmax(bad)])} is out of range [0, {self.length})"
            )
        step = self._encrypt if forward else self._decrypt
        out = step(flat.astype(np.uint64))
        todo = np.flatnonzero(out >= np.uint64(self.length))
        while todo.size:
            out[todo] = step(out[todo])
            todo = todo[out[todo] >= np.uint64(self.length)]
        return out.astype(np.int64).reshape(idx.shape)

    @overload
    def __call__(self, indices: int) -> int: ...
    @overload
    def __call__(self, indices: npt.ArrayLike) -> npt.NDArray[np.int64]: ...

    def __call__(self, indices: int | npt.ArrayLike) -> int | npt.NDArray[np.int64]:
        """Map index (or array of indices) ``i`` to its image ``π(i)``; arrays keep their shape.

        Raises:
            IndexError: if an index is outside ``[0, length)``.
        """
        if isinstance(indices, int | np.integer):
            return int(self._walk(np.array([indices]), True)[0])
        return self._walk(indices, True)

    @overload
    def inverse(self, indices: int) -> int: ...
    @overload
    def inverse(self, indices: npt.ArrayLike) -> npt.NDArray[np.int64]: ...

    def inverse(self, indices: int | npt.ArrayLike) -> int | npt.NDArray[np.int64]:
        """Map ``π(i)`` back to ``i``.

        Raises:
            IndexError: if an index is outside ``[0, length)``.
        """
        if isinstance(indices, int | np.integer):
            return int(self._walk(np.array([indices]), False)[0])
        return self._walk(indices, False)

    def __repr__(self) -> str:
        return f"FeistelPermutation(length={self.length}, seed={self.seed}, rounds={len(self._keys)})"


class PermutationDataset(Dataset[T]):
    """A dataset shuffled by a `FeistelPermutation`: example ``i`` is ``dataset[π(i)]``.

    A full shuffle needs the final length, so over a dataset that is still growing this dataset has
    length 0 until the inner one is finished (`wait_for_length` and `get_batch_async` wait for that).
    To shuffle a growing dataset, use `EraShuffleDataset`.

    Args:
        dataset: the dataset to shuffle.
        seed: the permutation's seed.

    Example:
        ```python
        from ponente.datacache import InMemoryTokenStore, PermutationDataset

        store = InMemoryTokenStore.from_documents([[i] for i in range(5)])
        shuffled = PermutationDataset(store, seed=0)
        sorted(int(ex["input_ids"][0]) for ex in shuffled.get_batch(range(5)))  # [0, 1, 2, 3, 4]
        ```
    """

    def __init__(self, dataset: Dataset[T], seed: int) -> None:
        """Wrap ``dataset``; nothing is read until examples are requested."""
        self.dataset = dataset
        self.seed = int(seed)
        self._perm: FeistelPermutation | None = None
        self._lock = threading.Lock()

    def _permutation(self) -> FeistelPermutation | None:
        if self._perm is None and self.dataset.is_finished:
            with self._lock:
                if self._perm is None:
                    self._perm = FeistelPermutation(len(self.dataset), self.seed)
        return self._perm

    @property
    def is_finished(self) -> bool:
        """Whether the inner dataset is finished."""
        return self.dataset.is_finished

    def __len__(self) -> int:
        """The inner length once it is final; 0 before."""
        perm = self._permutation()
        return 0 if perm is None else perm.length

    def __getitem__(self, index: int) -> T:
        """Return ``dataset[π(index)]``."""
        i = _as_index(index, len(self), name="PermutationDataset")
        perm = self._permutation()
        assert perm is not None  # len(self) > i >= 0 implies a permutation exists
        return self.dataset[perm(i)]

    def get_batch(self, indices: Indices) -> list[T]:
        """Return ``dataset.get_batch(π(indices))``."""
        idx = _as_index_array(indices, len(self), name="PermutationDataset")
        perm = self._permutation()
        if perm is None:  # only an empty batch can reach this point
            return []
        return self.dataset.get_batch(perm(idx))

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Wait until the inner dataset is finished (the shuffle needs its final length)."""
        return self.dataset.wait_for_length(None, timeout=timeout)
