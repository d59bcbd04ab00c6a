"""Preemption: the first ``SIGTERM`` stops training at the next step boundary (the run then checkpoints and exits
with ``trainer.preemption_exit_code``, 0 by default); a second one ends the process at once. Also how an early
stop maps to an exit status (:func:`stop_exit_code`)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["NONFINITE_STOP", "PREEMPTED_EXIT_CODE", "stop_exit_code", "stop_on_sigterm"]

logger = logging.getLogger("ponente.trainer.run")

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


@contextlib.contextmanager
def stop_on_sigterm(request_stop: Callable[[str], None]) -> Iterator[None]:
    """While inside, the first ``SIGTERM`` calls ``request_stop("SIGTERM")`` and nothing else.

    The handler then restores the default action, so a second ``SIGTERM`` kills the process at once (for a
    run that does not reach a step boundary in time). On exit the previous handler is restored. Off the main
    thread (where Python cannot install signal handlers) this does nothing.

    Args:
        request_stop: asks the loop to stop after the current step, e.g. :meth:`Trainer.request_stop`.

    Example:
        >>> stops = []
        >>> with stop_on_sigterm(stops.append):
        ...     signal.raise_signal(signal.SIGTERM)
        >>> stops
        ['SIGTERM']
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        logger.warning("SIGTERM: checkpointing at the next step boundary, then exiting (again: exit at once)")
        request_stop("SIGTERM")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler installed outside Python, which cannot be put back
            signal.signal(signal.SIGTERM, previous)
