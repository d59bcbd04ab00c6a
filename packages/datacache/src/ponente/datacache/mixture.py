"""Weighted mixtures of datasets, deterministic by block, with weight schedules.

The mixture is cut into blocks of ``block_size`` consecutive indices. A block drawn under weights
``w`` holds exactly ``counts[j]`` examples of component ``j``, where ``counts`` is ``w * block_size``
rounded by the largest-remainder method (so the counts sum to ``block_size`` and each is within 1 of
``w[j] * block_size``). Inside a block, which position gets which component is shuffled by a
`FeistelPermutation` keyed by ``(seed, block)``; each component's examples are read in order (the
``k``-th example of a component in the mixture is its example ``k``, or ``k mod n`` after a restart).
Everything is a pure function of the index, so the mixture is resumable from an index alone.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt

from ponente.datacache.dataset import Dataset, Indices, _as_index, _as_index_array
from ponente.datacache.permutation import FeistelPermutation, _derive_seed

__all__ = ["MixtureDataset", "StopStrategy", "block_counts"]

T = TypeVar("T")

#: What a mixture does when a finished component runs out of examples.
StopStrategy = Literal["restart", "error"]

#: The length of a mixture that never runs out (``stop_strategy="restart"`` over finished components).
UNBOUNDED = sys.maxsize


def block_counts(weights: Sequence[float], block_size: int) -> npt.NDArray[np.int64]:
    """Examples per component in a block of ``block_size``: ``weights * block_size`` rounded to sum exactly.

    Uses the largest-remainder method: each component first gets ``floor(w * block_size)`` (weights
    normalised to sum to 1), then the leftover slots go to the largest fractional parts, ties to the
    earlier component. Every count is within 1 of ``w * block_size``.

    Args:
        weights: non-negative weights, not all zero (normalised here).
        block_size: the block size, at least 1.

    Returns:
        int64 counts summing to ``block_size``.

    Raises:
        ValueError: if a weight is negative or not finite, or all are zero.

    Example:
        ```python
        from ponente.datacache import block_counts

        block_counts([0.5, 0.3, 0.2], 10).tolist()  # [5, 3, 2]
        block_counts([1, 1, 1], 10).tolist()  # [4, 3, 3]
        ```
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"block_counts: expected a non-empty list of weights, got {weights!r}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"block_counts: weights must be finite and non-negative, got {w.tolist()}")
    if w.sum() <= 0:
        raise ValueError(f"block_counts: at least one weight must be positive, got {w.tolist()}")
    # Exact rational arithmetic, so ties and roundings never depend on floating-point details.
    fractions = [Fraction(float(x)) for x in w]
    exact = [f * block_size / sum(fractions) for f in fractions]
    counts = np.array([math.floor(e) for e in exact], dtype=np.int64)
    leftover = block_size - int(counts.sum())
    # Largest remainder first, ties to the earlier component.
    order = sorted(range(len(exact)), key=lambda j: (-(exact[j] - int(counts[j])), j))
    counts[order[:leftover]] += 1
    return counts


class MixtureDataset(Dataset[T]):
    """A weighted mixture of datasets, deterministic by block, with optional weight schedules.

    Args:
        datasets: the components, by name.
        weights: either one mapping ``{name: weight}`` for the whole mixture, or a schedule: a list of
            ``(start_index, {name: weight})`` whose first start is 0, with strictly increasing starts
            that are multiples of ``block_size``; the weights of a stage apply from its start index on.
            Weights need not sum to 1; a component missing from a stage has weight 0 there.
            (To change weights at training step ``s`` with batch size ``B``, start the stage at ``s * B``.)
        block_size: examples per block; the weights are hit exactly in every block.
        seed: seed of the within-block shuffles.
        stop_strategy: what happens when a *finished* component has given all its examples:
            ``"restart"`` (default) cycles through it again from its first example, so a mixture of
            finished, non-empty components is unbounded (its ``len()`` is ``sys.maxsize``);
            ``"error"`` ends the mixture: ``len()`` stops before the first index that would need a
            missing example, and reading such an index raises `IndexError` naming the component.
            Either way, a component that is still building limits the mixture to the examples it has
            committed; `wait_for_length` and `get_batch_async` wait for more.

    Raises:
        ValueError: for an empty ``datasets``, a weight naming an unknown component, a negative weight,
            a stage whose weights are all zero, or a malformed schedule (the message says which stage).

    Example:
        ```python
        from ponente.datacache import InMemoryTokenStore, MixtureDataset

        a = InMemoryTokenStore.from_documents([[1]] * 100)
        b = InMemoryTokenStore.from_documents([[2]] * 100)
        mix = MixtureDataset({"a": a, "b": b}, {"a": 0.75, "b": 0.25}, block_size=8, seed=0)
        block = [int(ex["input_ids"][0]) for ex in mix.get_batch(range(8))]
        assert block.count(1) == 6 and block.count(2) == 2
        ```
    """

    def __init__(
        self,
        datasets: Mapping[str, Dataset[T]],
        weights: Mapping[str, float] | Sequence[tuple[int, Mapping[str, float]]],
        *,
        block_size: int = 2048,
        seed: int = 0,
        stop_strategy: StopStrategy = "restart",
    ) -> None:
        """Validate the components and the schedule and precompute the per-stage block counts."""
        if not datasets:
            raise ValueError("MixtureDataset: expected at least one component dataset, got none")
        if block_size < 1:
            raise ValueError(f"MixtureDataset: block_size must be at least 1, got {block_size}")
        if stop_strategy not in ("restart", "error"):
            raise ValueError(f"MixtureDataset: stop_strategy must be 'restart' or 'error', got {stop_strategy!r}")
        self.names = list(datasets)
        self.datasets = [datasets[name] for name in self.names]
        self.block_size = int(block_size)
        self.seed = int(seed)
        self.stop_strategy = stop_strategy
        stages = [(0, weights)] if isinstance(weights, Mapping) else list(weights)
        if not stages:
            raise ValueError("MixtureDataset: the weight schedule is empty; expected at least one (0, weights) stage")
        starts: list[int] = []
        counts: list[npt.NDArray[np.int64]] = []
        for k, (start, stage_weights) in enumerate(stages):
            where = f"MixtureDataset: weight schedule stage {k} (start index {start})"
            if k == 0 and start != 0:
                raise ValueError(f"{where}: the first stage must start at index 0")
            if start % self.block_size:
                raise ValueError(f"{where}: start must be a multiple of block_size={self.block_size}")
            if k and start <= starts[-1] * self.block_size:
                raise ValueError(f"{where}: starts must increase strictly")
            unknown = sorted(set(stage_weights) - set(self.names))
            if unknown:
                raise ValueError(f"{where}: unknown component(s) {unknown}; the components are {self.names}")
            try:
                counts.append(block_counts([float(stage_weights.get(n, 0.0)) for n in self.names], self.block_size))
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            starts.append(start // self.block_size)
        self._stage_blocks = np.array(starts, dtype=np.int64)  # first block of each stage
        self._counts = np.stack(counts)  # (stages, components)
        self._cum = np.concatenate([np.zeros((len(counts), 1), np.int64), np.cumsum(self._counts, axis=1)], axis=1)
        # Examples of each component consumed before each stage starts.
        spans = np.diff(self._stage_blocks)[:, None] * self._counts[:-1]
        self._base = np.concatenate([np.zeros((1, len(self.names)), np.int64), np.cumsum(spans, axis=0)])
        self._lock = threading.Lock()
        self._layouts: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = {}

    # -- the index map -------------------------------------------------------------------------------

    def _layout(self, block: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(component, rank of the example among that component's in this block) of each position of a block.

        Position ``p`` gets slot ``π(p)`` of the block's slot list ``[0] * counts[0] + [1] * counts[1] + ...``;
        ranks count in position order, so each component's examples are read in order.
        """
        with self._lock:
            cached = self._layouts.get(block)
        if cached is not None:
            return cached
        stage = int(np.searchsorted(self._stage_blocks, block, side="right")) - 1
        slots = FeistelPermutation(self.block_size, _derive_seed(self.seed, block))(np.arange(self.block_size))
        comp = np.searchsorted(self._cum[stage], slots, side="right") - 1
        order = np.argsort(comp, kind="stable")  # positions grouped by component, in position order
        rank = np.empty_like(comp)
        rank[order] = np.arange(self.block_size) - np.repeat(self._cum[stage][:-1], self._counts[stage])
        with self._lock:  # a small FIFO cache: batches usually touch one or two blocks
            if len(self._layouts) >= 64:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[block] = (comp, rank)
        return comp, rank

    def _consumed_before(self, block: int) -> npt.NDArray[np.int64]:
        """Examples of each component used by the blocks before ``block``."""
        stage = int(np.searchsorted(self._stage_blocks, block, side="right")) - 1
        return self._base[stage] + (block - self._stage_blocks[stage]) * self._counts[stage]

    def _locate(self, idx: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(component, index within the component before any restart) of each mixture index."""
        comp = np.empty_like(idx)
        local = np.empty_like(idx)
        blocks, pos = np.divmod(idx, self.block_size)
        for block in np.unique(blocks):
            sel = blocks == block
            block_comp, block_rank = self._layout(int(block))
            j = block_comp[pos[sel]]
            comp[sel] = j
            local[sel] = self._consumed_before(int(block))[j] + block_rank[pos[sel]]
        return comp, local

    def _first_index_needing(self, j: int, k: int) -> int:
        """The smallest mixture index whose example of component ``j`` has local index ``>= k``."""
        for stage in range(len(self._stage_blocks)):
            count = int(self._counts[stage, j])
            last = stage == len(self._stage_blocks) - 1
            span = None if last else int(self._stage_blocks[stage + 1] - self._stage_blocks[stage]) * count
            offset = k - int(self._base[stage, j])
            if count == 0 or offset < 0 or (span is not None and offset >= span):
                continue
            block = int(self._stage_blocks[stage]) + offset // count
            block_comp, _ = self._layout(block)
            return block * self.block_size + int(np.flatnonzero(block_comp == j)[offset % count])
        return UNBOUNDED

    def _state(self) -> tuple[list[bool], list[int]]:
        finished = [d.is_finished for d in self.datasets]  # before len(): a finished length is final
        return finished, [len(d) for d in self.datasets]

    def _length_and_final(self) -> tuple[int, bool]:
        finished, lengths = self._state()
        limits = []
        for j, (done, n) in enumerate(zip(finished, lengths)):
            if done and n > 0 and self.stop_strategy == "restart":
                continue
            first = self._first_index_needing(j, n)
            if first < UNBOUNDED:
                limits.append((first, done))
        if not limits:
            return UNBOUNDED, True
        length = min(first for first, _ in limits)
        return length, any(done and first == length for first, done in limits)

    # -- the dataset interface -----------------------------------------------------------------------

    def __len__(self) -> int:
        """Examples available before the first one that is missing (``sys.maxsize`` if none ever is)."""
        return self._length_and_final()[0]

    @property
    def is_finished(self) -> bool:
        """Whether `len` is final."""
        return self._length_and_final()[1]

    def component_of(self, indices: Indices) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Where mixture indices come from: (component number, index within that component).

        The component number indexes ``self.names``. The index within the component is before any
        restart (``stop_strategy="restart"`` reads it modulo the component's final length).

        Example:
            ```python
            from ponente.datacache import InMemoryTokenStore, MixtureDataset

            a = InMemoryTokenStore.from_documents([[1]] * 10)
            b = InMemoryTokenStore.from_documents([[2]] * 10)
            mix = MixtureDataset({"a": a, "b": b}, {"a": 1, "b": 1}, block_size=4)
            comp, local = mix.component_of(range(4))
            sorted(comp.tolist())  # [0, 0, 1, 1]
            ```
        """
        return self._locate(_as_index_array(indices, UNBOUNDED, name="MixtureDataset"))

    def get_batch(self, indices: Indices) -> list[T]:
        """Return the examples at ``indices`` (one `get_batch` call per component involved).

        Raises:
            IndexError: for a negative index, or one whose example is missing: the message names the
                component, the example it needed and how many it has.
        """
        idx = _as_index_array(indices, UNBOUNDED, name="MixtureDataset")
        comp, local = self._locate(idx)
        out: list[T | None] = [None] * idx.size
        finished, lengths = self._state()
        for j in np.unique(comp):
            sel = np.flatnonzero(comp == j)
            want = local[sel]
            n, done, name = lengths[j], finished[j], self.names[j]
            if done and n > 0 and self.stop_strategy == "restart":
                want = want % n
            missing = want >= n
            if missing.any():
                k = int(np.argmax(missing))
                state = "finished" if done else "still building"
                raise IndexError(
                    f"MixtureDataset: index {int(idx[sel[k]])} needs example {int(want[k])} of component "
                    f"{name!r}, which has {n} examples ({state}; stop_strategy={self.stop_strategy!r})"
                )
            for position, example in zip(sel, self.datasets[j].get_batch(want)):
                out[position] = example
        return out  # type: ignore[return-value]  # every slot was filled above

    def __getitem__(self, index: int) -> T:
        """Return the example at ``index`` (see `get_batch`)."""
        (example,) = self.get_batch([_as_index(index, UNBOUNDED, name="MixtureDataset")])
        return example

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Wait until each component has the examples that mixture indices ``[0, length)`` need.

        ``length=None`` waits until every component is finished. Returns ``True`` if the mixture then has
        ``length`` examples or its length is final, ``False`` on timeout.
        """
        if length is None:
            return all(d.wait_for_length(None, timeout=timeout) for d in self.datasets)
        deadline = None if timeout is None else time.monotonic() + timeout
        needed = self._needed(length)
        for j, dataset in enumerate(self.datasets):
            if needed[j] == 0:
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not dataset.wait_for_length(int(needed[j]), timeout=remaining):
                return False
        got, final = self._length_and_final()
        return got >= length or final

    def _needed(self, length: int) -> npt.NDArray[np.int64]:
        """Examples of each component that mixture indices ``[0, length)`` use (before any restart)."""
        if length <= 0:
            return np.zeros(len(self.names), dtype=np.int64)
        block = (length - 1) // self.block_size
        needed = self._consumed_before(block)
        comp, local = self._locate(np.arange(block * self.block_size, length, dtype=np.int64))
        needed = needed.copy()
        np.maximum.at(needed, comp, local + 1)
        return needed
