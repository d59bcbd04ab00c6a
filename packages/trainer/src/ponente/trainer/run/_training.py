"""The training phase of a run: feed a dataset's batches to the trainer until done, preempted or stopped."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._data import rows_recorder
from ._result import NONFINITE_STOP

if TYPE_CHECKING:
    from ponente.trainer.state import TrainerState
    from ponente.trainer.trainer import Trainer

__all__ = ["train_on"]


def train_on(
    trainer: Trainer,
    state: TrainerState,
    dataset: Any,
    *,
    rows: slice,
    eval_fn: Callable[[TrainerState], Mapping[str, float]] | None = None,
    make_batch: Callable[[Mapping[str, Any]], Any],
) -> TrainerState:
    """Train ``state`` on the batches of ``dataset`` from its step to ``trainer.num_train_steps``.

    The data position is a function of the step alone, so a resumed state continues with the very batches an
    uninterrupted run would have seen. A first ``SIGTERM`` or Ctrl-C stops the loop at the next step boundary
    (:meth:`Trainer.train`; ``trainer.last_stop_reason`` then says why).
    With ``trainer.on_nonfinite_loss: stop`` a NaN/Inf loss ends the loop too: the last good state is returned
    and ``trainer.last_stop_reason`` starts with :data:`NONFINITE_STOP` (the run saves it, then exits 1).

    Args:
        trainer: the :class:`~ponente.trainer.trainer.Trainer`.
        state: the state to train from.
        dataset: the training set of packed rows (random access by index).
        rows: the positions of each global batch this process loads (``trainer.process_batch_rows()``).
        eval_fn: evaluation every ``trainer.steps_per_eval`` steps (e.g. an :class:`Evaluator`; None: none).
        make_batch: ``make_batch(rows) -> batch``: the loader's NumPy rows to the loss's batch (e.g.
            :meth:`Task.make_batch`).

    Returns:
        The final state.
    """
    from ponente.trainer.data import DataLoader
    from ponente.trainer.trainer import NonFiniteLossError

    tcfg = trainer.config
    loader = DataLoader(
        dataset, tcfg.train_batch_size, start_step=int(state.step), stop_step=tcfg.num_train_steps, rows=rows
    )
    record = rows_recorder(rows, tcfg.train_batch_size)
    try:
        named = ((step, make_batch(record(step, batch))) for step, batch in loader)
        return trainer.train(state, named, eval_fn=eval_fn)
    except NonFiniteLossError as exc:  # on_nonfinite_loss: stop; the run checkpoints the last good state
        if exc.state is None:
            raise
        trainer.last_stop_reason = f"{NONFINITE_STOP}: {exc}"
        return exc.state
    finally:
        loader.close()
