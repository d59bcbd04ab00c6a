"""How an early stop maps to an exit status (:func:`stop_exit_code`): after a SIGTERM or Ctrl-C (handled by
:func:`ponente.trainer.trainer.stop_on_signals`) the run checkpoints and exits with ``trainer.preemption_exit_code``
(0 by default), after a non-finite loss with 1."""

from __future__ import annotations

__all__ = ["NONFINITE_STOP", "PREEMPTED_EXIT_CODE", "stop_exit_code"]

PREEMPTED_EXIT_CODE = 0
"""The default exit code of a run stopped by SIGTERM or Ctrl-C after saving its checkpoint
(``trainer.preemption_exit_code``)."""

NONFINITE_STOP = "non-finite loss"
"""How the stop reason of a run ended by a NaN/Inf loss (``trainer.on_nonfinite_loss: stop``) begins."""


def stop_exit_code(stopped: str | None, preemption_exit_code: int = PREEMPTED_EXIT_CODE) -> int:
    """The exit status of a run that ended for ``stopped`` (None: every step ran).

    Args:
        stopped: the run's stop reason (``TrainResult.stopped``): ``"SIGTERM"``, ``"SIGINT"``, or one starting
            with :data:`NONFINITE_STOP`.
        preemption_exit_code: ``trainer.preemption_exit_code``.

    Returns:
        0 when every step ran, ``preemption_exit_code`` after a SIGTERM or Ctrl-C (the checkpoint is saved:
        running again resumes), 1 after a non-finite loss (an error: the checkpoint holds the last good state).

    Example:
        >>> stop_exit_code(None), stop_exit_code("SIGTERM"), stop_exit_code("SIGTERM", 75)
        (0, 0, 75)
        >>> stop_exit_code("non-finite loss: step 7: non-finite loss=nan")
        1
    """
    if stopped is None:
        return 0
    if stopped.startswith(NONFINITE_STOP):
        return 1
    return preemption_exit_code
