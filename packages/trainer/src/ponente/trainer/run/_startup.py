"""Start-up timing: how long each phase between the process start and the first training step took."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Startup", "process_age"]

logger = logging.getLogger("ponente.trainer.run")


def process_age() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


class Startup:
    """Wall-clock times of the phases between the process start and the first step, for the logs.

    Phases on the main thread end with :meth:`mark` (each lasts since the previous mark); work started in a
    background thread with :meth:`background` reports its own duration. Each phase is logged at DEBUG as it
    ends; :meth:`first_step` logs them all at INFO once.

    Example:
        >>> startup = Startup.since_process_start()
        >>> startup.mark("config")
        >>> list(startup.phases)[-1]
        'config'
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.last = start
        self.phases: dict[str, float] = {}
        self._lock = threading.Lock()
        self._reported = False

    @classmethod
    def since_process_start(cls) -> Startup:
        """Timing that starts when the process started; the first phase is ``interpreter start and imports``.

        Where the process's age is unknown (not Linux), timing starts now and there is no such phase.
        """
        age = process_age()
        startup = cls(time.perf_counter() - (age or 0.0))
        if age is not None:
            startup.mark("interpreter start and imports")
        return startup

    def _record(self, name: str, seconds: float) -> None:
        with self._lock:
            self.phases[name] = seconds
        logger.debug("startup: %s took %.2f s (%.2f s after start)", name, seconds, time.perf_counter() - self.start)

    def mark(self, name: str) -> None:
        """End the phase ``name`` on the calling thread: it lasted since the previous mark."""
        now = time.perf_counter()
        self._record(name, now - self.last)
        self.last = now

    def background(self, pool: ThreadPoolExecutor, name: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` in ``pool``; its duration is recorded as the phase ``name`` (``[bg]`` in the log)."""
        begun = time.perf_counter()

        def task() -> Any:
            try:
                return fn(*args)
            finally:
                self._record(f"[bg] {name}", time.perf_counter() - begun)

        return pool.submit(task)

    def first_step(self) -> None:
        """Log every phase at INFO, the first time it is called (call it after each step)."""
        if self._reported:
            return
        self._reported = True
        with self._lock:
            detail = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())
        logger.info("first step done %.1f s after start (%s)", time.perf_counter() - self.start, detail)
