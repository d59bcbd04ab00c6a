"""Preemption: the first ``SIGTERM`` stops training at the next step boundary (the run then checkpoints and exits
with :data:`PREEMPTED_EXIT_CODE`); a second one ends the process at once."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["PREEMPTED_EXIT_CODE", "stop_on_sigterm"]

logger = logging.getLogger("ponente.trainer.run")

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by SIGTERM after saving its checkpoint (EX_TEMPFAIL: try again later)."""


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
