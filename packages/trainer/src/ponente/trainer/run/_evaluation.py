"""Evaluation during training: the loss on each validation set, every process loading only its own rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ponente.trainer.state import TrainerState
    from ponente.trainer.trainer import Trainer

__all__ = ["Evaluator", "eval_batches"]


def eval_batches(
    dataset: Any,
    batch_size: int,
    limit: int | None,
    rows: slice | None = None,
    *,
    make_batch: Callable[[Mapping[str, Any]], Any],
) -> Iterator[dict[str, Any]]:
    """The evaluation batches of ``dataset``: only the positions ``rows`` of each global batch of ``batch_size``.

    Every example counts once: the last, partial batch is filled up with wrapped-around rows whose loss mask
    is zero. The number of batches depends only on the dataset's length, so every process of a multi-process
    run evaluates the same number of batches (each with its own rows), as their collectives require.

    Args:
        dataset: a finished dataset of packed rows (``input_ids``, ``segment_ids``).
        batch_size: the global evaluation batch size.
        limit: evaluate at most this many batches (None: all).
        rows: the positions of each global batch this process loads (None: all).
        make_batch: ``make_batch(rows) -> batch`` with a NamedArray ``loss_mask`` whose first axis is the batch
            (e.g. :meth:`Task.make_batch`).

    Yields:
        Batches (LM batches by default) of ``rows.stop - rows.start`` (or ``batch_size``) rows.
    """
    import numpy as np

    import ponente.namedtensor as hax
    from ponente.trainer.data import batch_for_step
    from ponente.trainer.data.loader import step_indices

    dataset.wait_for_length(None)  # evaluation uses the whole (finished) validation cache
    length = len(dataset)
    num = -(-length // batch_size)
    if limit is not None:
        num = min(num, limit)
    for step in range(num):
        batch = make_batch(batch_for_step(dataset, step, batch_size, rows=rows))
        padding = step_indices(step, batch_size, rows) >= length
        if padding.any():
            mask = batch["loss_mask"]
            keep = ~padding.reshape(padding.shape + (1,) * (mask.array.ndim - 1))
            batch["loss_mask"] = hax.named(np.asarray(mask.array) * keep, mask.axes)
        yield batch


class Evaluator:
    """The ``eval_fn`` of :meth:`Trainer.train`: the mean loss on each validation set, ``{"<name>/loss": loss}``
    (with ``metrics``, also the loss function's own metrics, ``{"<name>/<metric>": value}``).

    The batch size and this process's rows come from the trainer (``per_device_eval_parallelism``); the most
    recent results stay in :attr:`last` for the run's summary.

    Args:
        trainer: the trainer that evaluates.
        datasets: the validation sets by name.
        max_batches: evaluate at most this many batches of each set (None: all).
        make_batch: ``make_batch(rows) -> batch`` (e.g. :meth:`Task.make_batch`).
        metrics: also report the metrics the loss function returns (weighted as the loss is).
    """

    def __init__(
        self,
        trainer: Trainer,
        datasets: Mapping[str, Any],
        max_batches: int | None,
        *,
        make_batch: Callable[[Mapping[str, Any]], Any],
        metrics: bool = False,
    ) -> None:
        self.trainer = trainer
        self.datasets = dict(datasets)
        self.max_batches = max_batches
        self.batch_size: int = trainer.eval_batch_size
        self.rows: slice = trainer.process_batch_rows(self.batch_size)  # like training, each process its own rows
        self.make_batch = make_batch
        self.metrics = metrics
        self.last: dict[str, float] = {}

    def __call__(self, state: TrainerState) -> dict[str, float]:
        results: dict[str, float] = {}
        for name, ds in self.datasets.items():
            batches = eval_batches(ds, self.batch_size, self.max_batches, self.rows, make_batch=self.make_batch)
            if self.metrics:
                values = self.trainer.eval_metrics(state, batches, batch_size=self.batch_size)
                results.update({f"{name}/{metric}": value for metric, value in values.items()})
            else:
                results[f"{name}/loss"] = self.trainer.eval_loss(state, batches, batch_size=self.batch_size)
        self.last = results
        return results
