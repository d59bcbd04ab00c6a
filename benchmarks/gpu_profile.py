"""Where a training step's device time goes: kernel times from a JAX profiler trace, grouped by kind.

Traces three steps (after warm-up) of either the ``trainer-mfu`` suite's Trainer step (``ponente``; that
suite's ``PONENTE_BENCH_MFU_*`` knobs apply) or the hand-written positional step of
``shared/bench/gpu_llama1b.py`` (``positional``; path in ``$GPU_BASELINE``, default ``.gpu/gpu_llama1b.py``,
variant in ``$GPU_BASELINE_VARIANT``, default ``pos-cudnn``), reads the Perfetto trace JAX writes, and prints the
device time per step by kind (matrix products, attention, fusions, copies, other) and the costliest kernels.
The same is written as JSON to ``$OUT/profile-<label>.json`` when ``$OUT`` is set. Then the run goes on and times
the step as usual. Meant for a lent GPU (``benchmarks/gpu_checks.sh profile``); on a CPU there are no device
kernels to list.

Usage: ``python -m benchmarks.gpu_profile ponente|positional``
"""

from __future__ import annotations

import collections
import gzip
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

TRACED_STEPS = 3


def _kind(name: str) -> str:
    """The kind of a kernel: the trainer profiler's classification (one list of patterns for both)."""
    from ponente.trainer.profiler import kind_of

    return kind_of(name)


def kernel_times(trace_dir: str) -> dict[str, dict[str, float]]:
    """Microseconds per event name on each device thread of the Perfetto trace under ``trace_dir``."""
    path = next(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    meta = [e for e in events if e.get("ph") == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    totals: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for e in events:
        proc = procs.get(e.get("pid"), "")
        if e.get("ph") == "X" and "dur" in e and "/device:" in proc:
            totals[f"{proc} | {threads.get((e['pid'], e['tid']), e['tid'])}"][e["name"]] += float(e["dur"])
    return totals


def report(label: str, totals: dict[str, dict[str, float]], steps: int = TRACED_STEPS) -> None:
    """Print (and write under ``$OUT``) the per-step device time by kind and the top kernels of each thread."""
    summary: dict[str, Any] = {}
    if not totals:
        print(f"--- {label}: no device kernels in the trace (JAX runs on {jax.default_backend()})")
    for thread, names in sorted(totals.items(), key=lambda kv: -sum(kv[1].values())):
        per_step = {name: us / steps / 1e3 for name, us in names.items()}  # ms per step
        kinds: dict[str, float] = collections.defaultdict(float)
        for name, ms in per_step.items():
            kinds[_kind(name)] += ms
        top = sorted(per_step.items(), key=lambda kv: -kv[1])[:25]
        summary[thread] = {"total_ms": sum(per_step.values()), "kinds_ms": dict(kinds), "top_ms": top}
        print(f"--- {label}: {thread}: {sum(per_step.values()):.1f} ms/step in {len(per_step)} kernels")
        print("    " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
        for name, ms in top[:12]:
            print(f"    {ms:7.2f} ms  {name[:110]}")
    out = os.environ.get("OUT")
    if out:
        Path(out, f"profile-{label}.json").write_text(json.dumps(summary, indent=1))


def trace(label: str, step: Callable[[], object]) -> None:
    """Warm ``step`` up, trace :data:`TRACED_STEPS` calls and report where the device time went."""
    step()
    step()
    directory = tempfile.mkdtemp(prefix=f"profile-{label}-")
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(TRACED_STEPS):
            step()
    report(label, kernel_times(directory))


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "ponente"
    if which == "ponente":
        from benchmarks import harness
        from benchmarks.suites import trainer_mfu

        def traced_time_fn(fn: Callable[[], object], *, warmup: int = 2, repeat: int = 10) -> float:
            trace("ponente", fn)
            return harness.time_fn(fn, warmup=0, repeat=repeat)

        trainer_mfu.time_fn = traced_time_fn
        recorder = harness.Recorder("trainer-mfu")
        trainer_mfu.run(recorder)
        for row in recorder.records:
            print(f"{row['name']}: {row['metric']} = {row['value']:.6g} {row['unit']}")
    elif which == "positional":
        path = os.environ.get("GPU_BASELINE", ".gpu/gpu_llama1b.py")
        spec = importlib.util.spec_from_file_location("gpu_llama1b", path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"gpu_profile: cannot load the baseline script {path!r} (set GPU_BASELINE)")
        module: Any = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        original = module._time_steps

        def traced_steps(step: Callable[[], float], n: int) -> Any:
            trace("positional", step)
            return original(step, n)

        module._time_steps = traced_steps
        result = module.one(
            os.environ.get("GPU_BASELINE_VARIANT", "pos-cudnn"), os.environ.get("GPU_BASELINE_SIZE", "1b")
        )
        print(json.dumps(result))
    else:
        raise SystemExit(f"gpu_profile: expected 'ponente' or 'positional', got {which!r}")


if __name__ == "__main__":
    main()
