"""The profiler of a training run (``trainer.profiler``): a JAX trace of chosen steps and a one-page summary.

With ``trainer.profiler: true`` the run traces steps ``profiler_start_step + 1 .. profiler_start_step +
profiler_num_steps`` with the JAX profiler (on CPU too) into ``<run_dir>/profile`` (``logs/<run_id>/profile``
without a run directory): a TensorBoard/XProf trace and a Perfetto trace (``perfetto_trace.json.gz``; open it at
ui.perfetto.dev; with ``profiler_perfetto_link: true`` the profiler serves it and logs a link, and the run waits
until the link is opened). When the traced
steps are over, the run reads the Perfetto trace back and logs where the time went: the time per step of each
kind of operation (matrix products, attention, fusions, copies and transposes, collectives, other) and the
costliest operations, on the devices' threads (host threads on a CPU). The kinds also go to the tracker's summary
as ``profile/<kind>_ms_per_step``.
"""

from __future__ import annotations

import collections
import gzip
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "ProfileSummary", "Profiler", "kind_of", "op_times", "summarize"]

logger = logging.getLogger(__name__)

KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("collective", re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective|nccl|psum", re.I)),
    ("attention", re.compile(r"cudnn|fmha|flash|sdpa|attention|mha|splash", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|wgmma|dot|convolution", re.I)),
    ("copy/transpose", re.compile(r"copy|transpose|memcpy|memset|dynamic[-_]update", re.I)),
    ("fusion", re.compile(r"fusion|loop_|input_|reduce|convert|select|broadcast|triton", re.I)),
)
"""The kinds of operations, each the first pattern its name matches (else ``other``)."""


def kind_of(name: str) -> str:
    """The kind of an operation named ``name`` (see :data:`KINDS`)."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def _device_thread(process: str, thread: str) -> bool:
    """Whether a trace thread runs device work: a device's streams, or (CPU) XLA's host threads running ops."""
    if "/device:" in process:
        return True
    return "/host:CPU" in process and re.search(r"xla|tf_|thunk|ops", thread, re.I) is not None


def op_times(trace_dir: str | Path) -> dict[str, float]:
    """Microseconds per operation name over the device threads of the Perfetto trace under ``trace_dir``.

    Raises:
        FileNotFoundError: if ``trace_dir`` holds no ``perfetto_trace.json.gz``.
    """
    found = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"{trace_dir}: no perfetto_trace.json.gz (was the trace written?)")
    with gzip.open(found[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    meta = [e for e in events if e.get("ph") == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if (
            e.get("ph") != "X"
            or "dur" not in e
            or str(e.get("name", "")).startswith("end: ")
            or "::" in str(e["name"])
        ):
            continue  # the ends of ops and the runtime's own bookkeeping are not operations
        if _device_thread(procs.get(e.get("pid"), ""), str(threads.get((e.get("pid"), e.get("tid")), ""))):
            totals[str(e["name"])] += float(e["dur"])
    return dict(totals)


class ProfileSummary:
    """Where the traced steps' time went: milliseconds per step by kind, and the costliest operations.

    Attributes:
        steps: how many steps were traced.
        by_kind: milliseconds per step of each kind, largest first.
        top: the costliest operations as ``(name, kind, milliseconds per step)``, largest first.
    """

    def __init__(self, times: Mapping[str, float], steps: int, top: int = 10) -> None:
        self.steps = max(1, steps)
        by_kind: dict[str, float] = collections.defaultdict(float)
        for name, micros in times.items():
            by_kind[kind_of(name)] += micros / 1000 / self.steps
        self.by_kind = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
        ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
        self.top = [(name, kind_of(name), micros / 1000 / self.steps) for name, micros in ranked]

    @property
    def total_ms(self) -> float:
        """Milliseconds per step over every kind."""
        return sum(self.by_kind.values())

    def text(self) -> str:
        """The summary as a few lines of text."""
        total = self.total_ms or 1.0
        lines = [f"profile of {self.steps} step(s): {self.total_ms:.2f} ms of operations per step"]
        lines += [f"  {kind:<15} {ms:9.2f} ms  {100 * ms / total:5.1f} %" for kind, ms in self.by_kind.items()]
        lines.append("  costliest operations:")
        lines += [f"    {ms:9.3f} ms  {kind:<15} {name[:80]}" for name, kind, ms in self.top]
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        """``profile/<kind>_ms_per_step`` for the tracker (``/`` in a kind becomes ``_``)."""
        return {f"profile/{kind.replace('/', '_')}_ms_per_step": ms for kind, ms in self.by_kind.items()}


def summarize(trace_dir: str | Path, steps: int) -> ProfileSummary:
    """The :class:`ProfileSummary` of the trace under ``trace_dir``, which holds ``steps`` steps."""
    return ProfileSummary(op_times(trace_dir), steps)


class Profiler:
    """The hook that traces steps ``start_step + 1 .. start_step + num_steps`` and summarizes them.

    Call it after every completed step (a :class:`~ponente.trainer.callbacks.Hook`); it starts the trace after step
    ``start_step`` (at once if ``start_step`` is 0) and stops it after step ``start_step + num_steps`` or when
    training ends.

    Args:
        trace_dir: where the trace goes.
        start_step: the number of steps to run before tracing (warm-up, compilation).
        num_steps: how many steps to trace.
        perfetto_link: let the profiler serve the Perfetto trace and log a link to it.
        tracker: where the summary's metrics go (``log_summary``), or None.

    Raises:
        ValueError: if ``start_step`` < 0 or ``num_steps`` < 1.
    """

    def __init__(
        self,
        trace_dir: str | Path,
        start_step: int,
        num_steps: int,
        *,
        perfetto_link: bool = False,
        tracker: Any = None,
    ) -> None:
        if start_step < 0:
            raise ValueError(f"trainer.profiler_start_step: expected >= 0, got {start_step}")
        if num_steps < 1:
            raise ValueError(f"trainer.profiler_num_steps: expected >= 1, got {num_steps}")
        self.trace_dir = Path(trace_dir)
        self.start_step, self.num_steps = start_step, num_steps
        self.perfetto_link = perfetto_link
        self.tracker = tracker
        self.summary: ProfileSummary | None = None
        self._first: int | None = None
        if start_step == 0:
            self._start(0)

    def _start(self, step: int) -> None:
        import jax

        self.trace_dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(
            str(self.trace_dir), create_perfetto_link=self.perfetto_link, create_perfetto_trace=True
        )
        self._first = step
        logger.info("profiler: tracing steps %d..%d into %s", step + 1, step + self.num_steps, self.trace_dir)

    def _stop(self, step: int) -> None:
        import jax

        first, self._first = self._first, None
        jax.profiler.stop_trace()
        traced = step - (first or 0)
        try:
            self.summary = summarize(self.trace_dir, traced)
        except (FileNotFoundError, ValueError, KeyError) as exc:
            logger.warning("profiler: the trace in %s could not be summarized: %s", self.trace_dir, exc)
            return
        first_traced = (first or 0) + 1
        logger.info(
            "profiler: trace of steps %d..%d in %s\n%s", first_traced, step, self.trace_dir, self.summary.text()
        )
        if self.tracker is not None:
            self.tracker.log_summary(self.summary.metrics())

    def __call__(self, info: Any) -> None:
        """After a step: start or stop the trace as configured (and stop it when training ends)."""
        step = int(info.step)
        if self._first is not None and (step >= self._first + self.num_steps or info.final):
            self._stop(step)
        elif self._first is None and self.summary is None and step >= self.start_step and not info.final:
            self._start(step)  # (a resumed run past start_step traces its next steps)

    def close(self, step: int) -> None:
        """Stop a trace still running when training ended after ``step`` steps (and summarize it)."""
        if self._first is not None:
            self._stop(step)
