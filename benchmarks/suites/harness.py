"""The harness's own suite: proves recording, timing and ratios work, with nothing but NumPy.

It times a vectorised NumPy sum against a Python loop over the same numbers and reports their ratio.
"""

from __future__ import annotations

import numpy as np

from benchmarks.harness import Recorder, time_fn


def run(rec: Recorder) -> None:
    values = np.random.default_rng(0).standard_normal(100_000)
    as_list = values.tolist()
    vectorised = time_fn(lambda: float(values.sum()), repeat=20)
    python_loop = time_fn(lambda: sum(as_list), repeat=5)
    rec.record("sum_100k", "seconds", vectorised, "s", impl="numpy")
    rec.record("sum_100k", "seconds_python_loop", python_loop, "s", impl="python")
    rec.record("sum_100k", "speedup_numpy_vs_python", python_loop / vectorised, "x")
