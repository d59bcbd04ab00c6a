"""The datasets of preference pairs: the training pairs (shuffled), the validation pairs, and extra row fields.

`pair_datasets` is what the preference task (``train_dpo``) reads: the ``preference_chat`` rows of a single corpus,
with ``validation_split_fraction`` of its pairs held out when it has no validation set; `WithRowFields` adds
per-row values computed once (the precomputed reference log-probs) to the rows of a dataset.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ponente.datacache import Dataset
from ponente.trainer.data.build import _single_cache, data_tokenizer, derive_seed, shuffled
from ponente.trainer.data.lm_dataset import LMDatasetConfig, Row

__all__ = ["RowRange", "WithRowFields", "pair_datasets"]


def pair_datasets(
    data: Any, seq_len: int, *, seed: int, validation_split_fraction: float | None = None
) -> tuple[Dataset[Row], dict[str, Dataset[Row]]]:
    """``(train, {name: validation})``: the pair rows of ``data`` (a single ``preference_chat`` corpus).

    Without a validation split in ``data`` and with ``validation_split_fraction`` (in ``(0, 1)``), the last
    ``ceil(fraction * pairs)`` training pairs (in file order, before the shuffle) are the validation set
    ``"validation"``; the cache is then read whole before training starts.

    Raises:
        ValueError: naming ``data``, for a mixture (preference pairs come from one corpus).
    """
    if not isinstance(data, LMDatasetConfig):
        raise ValueError("data: preference pairs are read from a single corpus, not a mixture (data.configs)")
    tokenizer = data_tokenizer(data)
    rows = data.format.rows(_single_cache(data, "train", background=True), seq_len, tokenizer)
    validation: dict[str, Dataset[Row]] = {}
    if data.has_split("validation"):
        cache = _single_cache(data, "validation", background=True)
        validation[data.cache_name] = data.format.rows(cache, seq_len, tokenizer)
    elif validation_split_fraction:
        rows.wait_for_length(None)
        total = len(rows)
        held = math.ceil(validation_split_fraction * total)
        if total - held < 1:
            raise ValueError(
                f"validation_split_fraction: holding out {held} of {total} pairs leaves none to train on; lower it, "
                "or give data a validation set"
            )
        validation["validation"] = RowRange(rows, total - held, total)
        rows = RowRange(rows, 0, total - held)
    return shuffled(rows, data.shuffle, derive_seed(seed, "train")), validation


class WithRowFields(Dataset[Row]):
    """The rows of ``inner`` with more fields: ``fields(index)`` gives ``{name: value}`` for row ``index``.

    Args:
        inner: the dataset (its ``get_batch`` indices are the row indices ``fields`` receives).
        name: what the rows are, for messages.
        fields: ``fields(indices) -> {name: array [len(indices), ...]}`` (e.g. a lookup in precomputed arrays).
    """

    def __init__(self, inner: Dataset[Row], name: str, fields: Callable[[np.ndarray], dict[str, np.ndarray]]) -> None:
        self.inner = inner
        self.name = name
        self.fields = fields

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def is_finished(self) -> bool:
        return self.inner.is_finished

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        return self.inner.wait_for_length(length, timeout=timeout)

    def __getitem__(self, index: int) -> Row:
        return self.get_batch([index])[0]

    def get_batch(self, indices: Any) -> list[Row]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        extra = self.fields(indices)
        return [
            {**row, **{key: value[i] for key, value in extra.items()}}
            for i, row in enumerate(self.inner.get_batch(indices))
        ]


class RowRange(Dataset[Row]):
    """Rows ``start..stop`` of a finished dataset, renumbered from 0 (a held-out split).

    Raises:
        ValueError: if the range is not within ``inner``.
    """

    def __init__(self, inner: Dataset[Row], start: int, stop: int) -> None:
        if not 0 <= start <= stop <= len(inner):
            raise ValueError(f"RowRange: rows {start}..{stop} are not within the {len(inner)} rows of the dataset")
        self.inner, self.start, self.stop = inner, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def is_finished(self) -> bool:
        return True

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        return True

    def __getitem__(self, index: int) -> Row:
        return self.get_batch([index])[0]

    def get_batch(self, indices: Any) -> list[Row]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"RowRange: index out of range 0..{len(self) - 1}: {indices.tolist()}")
        return list(self.inner.get_batch(indices + self.start))
