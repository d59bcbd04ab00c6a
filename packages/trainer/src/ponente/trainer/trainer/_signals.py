"""Stopping on signals, in one place: the first SIGINT (Ctrl-C) or SIGTERM (preemption) stops training at the next
step boundary; a second SIGINT raises ``KeyboardInterrupt`` at once, a second SIGTERM ends the process at once."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["stop_on_signals"]

logger = logging.getLogger("ponente.trainer.trainer")


@contextlib.contextmanager
def stop_on_signals(
    request_stop: Callable[[str], None], stop_requested: Callable[[], str | None] | None = None
) -> Iterator[None]:
    """While inside, the first ``SIGINT`` or ``SIGTERM`` calls ``request_stop`` with ``"SIGINT"`` or ``"SIGTERM"``.

    A ``SIGINT`` once a stop is requested raises ``KeyboardInterrupt`` (abort now); after the first ``SIGTERM`` its
    default action comes back, so a second one kills the process at once (for a run that does not reach a step
    boundary in time). On exit the previous handlers are restored. Off the main thread (where Python cannot install
    signal handlers) this does nothing.

    Args:
        request_stop: asks the loop to stop after the current step, e.g. :meth:`Trainer.request_stop`.
        stop_requested: whether a stop is already requested, by a signal or otherwise (None: by a signal here).

    Example:
        >>> stops = []
        >>> with stop_on_signals(stops.append):
        ...     signal.raise_signal(signal.SIGTERM)
        >>> stops
        ['SIGTERM']
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    requested: list[str] = []

    def stop(reason: str) -> None:
        requested.append(reason)
        request_stop(reason)

    def on_sigint(signum: int, frame: Any) -> None:
        if requested or (stop_requested is not None and stop_requested() is not None):
            raise KeyboardInterrupt
        logger.warning("Ctrl-C: stopping after the current step (press Ctrl-C again to abort immediately)")
        stop("SIGINT")

    def on_sigterm(signum: int, frame: Any) -> None:
        logger.warning("SIGTERM: checkpointing at the next step boundary, then exiting (again: exit at once)")
        stop("SIGTERM")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    previous_int = signal.signal(signal.SIGINT, on_sigint)
    previous_term = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_int)
        if previous_term is not None:  # None: a handler installed outside Python, which cannot be put back
            signal.signal(signal.SIGTERM, previous_term)
