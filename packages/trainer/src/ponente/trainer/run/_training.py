"""The training phase of a run: feed a dataset's batches to the trainer until done, preempted or stopped."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._data import rows_recorder
from ._signals import NONFINITE_STOP, stop_on_sigterm

if TYPE_CHECKING:
    from ponente.trainer.state import TrainerState
    from ponente.trainer.trainer import Trainer

__all__ = ["EXAMPLE_FIELDS", "TEXT_FIELDS", "batch_fields", "placeholder_batch", "placeholder_rows", "train_on"]


def train_on(
    trainer: Trainer,
    state: TrainerState,
    dataset: Any,
    *,
    rows: slice,
    eval_fn: Callable[[TrainerState], Mapping[str, float]] | None = None,
    make_batch: Callable[[Mapping[str, Any]], Any] | None = None,
) -> TrainerState:
    """Train ``state`` on the batches of ``dataset`` from its step to ``trainer.num_train_steps``.

    The data position is a function of the step alone, so a resumed state continues with the very batches an
    uninterrupted run would have seen. A first ``SIGTERM`` stops the loop at the next step boundary
    (:func:`stop_on_sigterm`; ``trainer.last_stop_reason`` then says why); Ctrl-C likewise (the trainer's own).
    With ``trainer.on_nonfinite_loss: stop`` a NaN/Inf loss ends the loop too: the last good state is returned
    and ``trainer.last_stop_reason`` starts with :data:`NONFINITE_STOP` (the run saves it, then exits 1).

    Args:
        trainer: the :class:`~ponente.trainer.trainer.Trainer`.
        state: the state to train from.
        dataset: the training set of packed rows (random access by index).
        rows: the positions of each global batch this process loads (``trainer.process_batch_rows()``).
        eval_fn: evaluation every ``trainer.steps_per_eval`` steps (e.g. an :class:`Evaluator`; None: none).
        make_batch: ``make_batch(rows) -> batch``: the loader's NumPy rows to the loss's batch (None: the LM
            batch, :func:`ponente.trainer.lm.lm_batch`).

    Returns:
        The final state.
    """
    from ponente.trainer.data import DataLoader
    from ponente.trainer.lm import lm_batch
    from ponente.trainer.trainer import NonFiniteLossError

    tcfg = trainer.config
    with stop_on_sigterm(trainer.request_stop):
        loader = DataLoader(
            dataset, tcfg.train_batch_size, start_step=int(state.step), stop_step=tcfg.num_train_steps, rows=rows
        )
        record = rows_recorder(rows, tcfg.train_batch_size)
        try:
            to_batch = lm_batch if make_batch is None else make_batch
            named = ((step, to_batch(record(step, batch))) for step, batch in loader)
            return trainer.train(state, named, eval_fn=eval_fn)
        except NonFiniteLossError as exc:  # on_nonfinite_loss: stop; the run checkpoints the last good state
            if exc.state is None:
                raise
            trainer.last_stop_reason = f"{NONFINITE_STOP}: {exc}"
            state = exc.state
            return state
        finally:
            loader.close()


TEXT_FIELDS = ("input_ids", "segment_ids")
"""The fields of a packed text row (``TokenSeqDataset``)."""

EXAMPLE_FIELDS = ("input_ids", "segment_ids", "loss_mask", "position_ids")
"""The fields of a packed supervised or chat row (``PackedExampleDataset``)."""


def batch_fields(data: Any) -> tuple[str, ...]:
    """The fields of the training rows of a data config: :data:`EXAMPLE_FIELDS` when any source (or mixture
    component) has a ``format`` other than ``text``, else :data:`TEXT_FIELDS`."""
    sources = list(getattr(data, "configs", {}).values()) or [data]
    if any(getattr(getattr(source, "format", None), "has_loss_mask", False) for source in sources):
        return EXAMPLE_FIELDS
    return TEXT_FIELDS


def placeholder_batch(rows: slice, seq_len: int, *, fields: tuple[str, ...] = TEXT_FIELDS) -> dict[str, Any]:
    """Zeros in the layout of this process's LM training batches, to compile the step before data arrives.

    Args:
        rows: the positions of each global batch this process loads.
        seq_len: the length of a row.
        fields: the fields of the dataset's rows (see :func:`batch_fields`).
    """
    from ponente.trainer.lm import lm_batch

    return lm_batch(placeholder_rows(rows.stop - rows.start, seq_len, fields=fields))


def placeholder_rows(count: int, seq_len: int, *, fields: tuple[str, ...] = TEXT_FIELDS) -> dict[str, Any]:
    """Zeros in the layout of ``count`` packed rows of ``seq_len`` tokens (``{field: int32 [count, seq_len]}``).

    Args:
        count: the number of rows.
        seq_len: the length of a row.
        fields: the fields of the dataset's rows (see :func:`batch_fields`).
    """
    import numpy as np

    zeros = np.zeros((count, seq_len), dtype=np.int32)
    return dict.fromkeys(fields, zeros)
