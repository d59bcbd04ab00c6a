"""``trainer.profiler``: a JAX trace of the chosen steps under the run directory, and a summary of it.

The summary is checked against the Perfetto trace read independently here (the events of the steps' operations,
summed by name), and the kinds against hand-written names.
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from ponente.trainer.main import train_lm
from ponente.trainer.profiler import ProfileSummary, kind_of


def test_kinds_of_operation_names() -> None:
    assert kind_of("cutlass_80_tensorop_gemm") == "matmul"
    assert kind_of("dot.12") == "matmul"
    assert kind_of("cudnn_flash_attention_fwd") == "attention"
    assert kind_of("all-reduce.3") == "collective"
    assert kind_of("copy.7") == "copy/transpose"
    assert kind_of("loop_add_fusion") == "fusion"
    assert kind_of("wrapped_sine") == "other"
    summary = ProfileSummary({"dot.1": 3000.0, "copy.2": 1000.0, "sine": 2000.0}, steps=2)
    assert summary.by_kind == {"matmul": 1.5, "other": 1.0, "copy/transpose": 0.5}
    assert summary.top[0] == ("dot.1", "matmul", 1.5)
    assert summary.metrics()["profile/copy_transpose_ms_per_step"] == 0.5


def test_profiler_traces_the_chosen_steps_and_logs_a_summary(
    tmp_path: Path, tiny_lm_overrides, caplog: pytest.LogCaptureFixture
) -> None:
    argv = [f"--{o}" for o in tiny_lm_overrides(4)]
    argv += ["--trainer.profiler=true", "--trainer.profiler_start_step=1", "--trainer.profiler_num_steps=2"]
    with caplog.at_level(logging.INFO, logger="ponente.trainer.profiler"):
        assert train_lm.main(argv) == 0
    traces = list((tmp_path / "runs" / "tiny" / "profile").rglob("perfetto_trace.json.gz"))
    assert len(traces) == 1
    with gzip.open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    # independently: every operation XLA's CPU threads ran (not the ends of ops, not the runtime's bookkeeping)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    durations = [
        e["dur"] for e in events
        if e.get("ph") == "X" and str(threads.get((e["pid"], e["tid"]), "")).startswith("tf_XLA")
        and not str(e["name"]).startswith("end: ") and "::" not in str(e["name"])
    ]  # fmt: skip
    assert durations, "no operation of the step in the trace"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "trace of steps 2..3" in text
    assert "ms of operations per step" in text
    summary = json.loads((tmp_path / "metrics.summary.json").read_text())
    # the time per step over every kind: all those operations, summed here, over the 2 traced steps
    total = sum(v for k, v in summary.items() if k.startswith("profile/"))
    assert total == pytest.approx(sum(durations) / 1000 / 2, rel=1e-6)
    assert summary["profile/fusion_ms_per_step"] > 0


def test_profiler_keys_are_checked() -> None:
    from ponente.trainer.trainer import TrainerConfig

    with pytest.raises(ValueError, match=r"trainer\.profiler_num_steps"):
        TrainerConfig(profiler_num_steps=0)
    with pytest.raises(ValueError, match=r"trainer\.profiler_start_step"):
        TrainerConfig(profiler_start_step=-1)
