"""Recording, timing and comparing benchmark measurements.

A suite is a module ``benchmarks/suites/<name>.py`` with a function ``run(rec)``; it measures things
and calls ``rec.record(...)`` once per measurement. Speed is reported as a ratio against a reference
run in the same process wherever one exists, so results are comparable across machines.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import json
import os
import pkgutil
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

import benchmarks.suites

_SOFTWARE = (
    "ponente-namedtensor",
    "ponente-datacache",
    "ponente-models",
    "ponente-trainer",
    "jax",
    "jaxlib",
    "numpy",
    "tensorstore",
    "tokenizers",
)


def machine_info() -> dict[str, Any]:
    """Describe the machine: platform, CPU count, and accelerators if JAX is already imported."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    # Only describe accelerators if a suite already imported JAX: the harness itself must not need it.
    jax = sys.modules.get("jax")
    if jax is not None:
        devices = jax.devices()
        info["jax_backend"] = jax.default_backend()
        info["devices"] = [d.device_kind for d in devices]
    return info


def software_info() -> dict[str, str]:
    """Versions of Ponente's packages and the libraries benchmarks exercise (absent ones omitted)."""
    found = {}
    for dist in _SOFTWARE:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def time_fn(fn: Callable[[], object], *, warmup: int = 2, repeat: int = 10) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeat`` calls, after ``warmup`` untimed calls.

    ``fn`` must block until its work is done (for JAX, call ``.block_until_ready()`` on the result).
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class Recorder:
    """Collects measurements of one suite and writes them as JSON lines.

    Args:
        suite: name of the suite being run.
        stream: where each record is written as it is made (one JSON object per line), or None.
    """

    suite: str
    stream: TextIO | None = None
    records: list[dict[str, Any]] = field(default_factory=list)

    def record(self, name: str, metric: str, value: float, unit: str, **extra: Any) -> dict[str, Any]:
        """Record one measurement: ``value`` ``unit`` of ``metric`` for the benchmark ``name``.

        Extra keyword arguments (shapes, sizes, notes) are stored with the record.
        """
        row: dict[str, Any] = {
            "suite": self.suite,
            "name": name,
            "metric": metric,
            "value": float(value),
            "unit": unit,
            **extra,
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        self.records.append(row)
        if self.stream is not None:
            self.stream.write(json.dumps({**row, "machine": machine_info(), "software": software_info()}) + "\n")
            self.stream.flush()
        print(f"{self.suite}/{name}: {metric} = {value:.6g} {unit}", flush=True)
        return row


def available_suites() -> list[str]:
    """Names of the modules in ``benchmarks/suites``, dashes for underscores (``trainer_mfu``: ``trainer-mfu``)."""
    modules = pkgutil.iter_modules(benchmarks.suites.__path__)
    return sorted(m.name.replace("_", "-") for m in modules if not m.name.startswith("_"))


def run_suite(suite: str, stream: TextIO | None = None) -> Recorder:
    """Import ``benchmarks.suites.<suite>`` and run it, writing its records to ``stream``.

    Raises:
        ValueError: if no suite of that name exists; the message lists the available ones.
    """
    if suite not in available_suites():
        raise ValueError(f"unknown benchmark suite {suite!r}; available: {', '.join(available_suites())}")
    module = importlib.import_module(f"benchmarks.suites.{suite.replace('-', '_')}")
    rec = Recorder(suite, stream)
    module.run(rec)
    return rec


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON-lines results file.

    Raises:
        ValueError: naming the file and line of a line that is not a JSON object with the required keys.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            missing = {"suite", "name", "metric", "value", "unit"} - set(row)
            if missing:
                raise ValueError(f"{path}:{lineno}: record lacks {sorted(missing)}")
            records.append(row)
    return records


def compare(
    baseline: Iterable[dict[str, Any]], candidate: Iterable[dict[str, Any]]
) -> list[tuple[str, float, float, float]]:
    """Pair records by (suite, name, metric) and return ``(key, baseline, candidate, candidate/baseline)``.

    When a key occurs several times in a file, its last value counts. Keys present in only one file are left out.
    """

    def index(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {f"{r['suite']}/{r['name']}/{r['metric']} [{r['unit']}]": r for r in rows}

    a, b = index(baseline), index(candidate)
    out = []
    for key in sorted(a.keys() & b.keys()):
        va, vb = float(a[key]["value"]), float(b[key]["value"])
        out.append((key, va, vb, vb / va if va else float("nan")))
    return out


def packed_segment_ids(batch: int, seq_len: int, seed: int = 0) -> Any:
    """Segment ids ``[batch, seq_len]`` int32 of documents of random lengths (mean a quarter of the row) packed
    into each row, the last one cut at the row's end (as a packing data loader gives)."""
    rng = np.random.default_rng(seed)
    ends = rng.integers(1, max(2, seq_len // 2), (batch, seq_len)).cumsum(axis=1)
    return np.stack([np.searchsorted(row, np.arange(seq_len), side="right") for row in ends]).astype(np.int32)


def interleaved_times(steps: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Seconds of each step over ``PONENTE_BENCH_STEPS`` rounds in which every step runs once, in rotating order.

    Timing single steps back to back (rather than a batch of one, then of the other) makes load on a shared
    machine hit the steps alike; the ratio of round ``i`` compares steps run within the same second.
    """
    rounds = int(os.environ.get("PONENTE_BENCH_STEPS", "30"))
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for fn in steps.values():
        for _ in range(2):  # warm up every step before the first timed round
            fn()
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            times[n].append(time_fn(steps[n], warmup=0, repeat=1))
    return times


def round_ratio(a: list[float], b: list[float]) -> tuple[float, dict[str, Any]]:
    """The median of the per-round ratios ``a / b``, and their spread and the ratio of the fastest rounds."""
    per_round = [x / y for x, y in zip(a, b, strict=True)]
    spread = {
        "rounds": len(per_round),
        "ratio_min": round(min(per_round), 4),
        "ratio_max": round(max(per_round), 4),
        "ratio_of_min": round(min(a) / min(b), 4),
    }
    return statistics.median(per_round), spread
