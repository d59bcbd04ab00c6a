"""Tests for ponente.trainer.tracker.json_tracker: JSON lines with exact floats, sibling files."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.trainer.tracker as trk


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=5))
def test_float64_values_round_trip_bit_exactly(tmp_path_factory: pytest.TempPathFactory, values: list[float]) -> None:
    path = tmp_path_factory.mktemp("json") / "m.jsonl"
    tracker = trk.JsonTracker(path)
    tracker.log({f"m{i}": v for i, v in enumerate(values)}, step=1)
    tracker.finish()
    (record,) = _read_lines(path)
    for i, v in enumerate(values):
        got = record[f"m{i}"]
        assert type(got) is float
        if math.isnan(v):
            assert math.isnan(got)
        else:
            assert _bits(got) == _bits(v)


@settings(max_examples=50, deadline=None)
@given(value=st.floats(width=32, allow_nan=False))
def test_float32_numpy_and_jax_scalars_widen_exactly(tmp_path_factory: pytest.TempPathFactory, value: float) -> None:
    path = tmp_path_factory.mktemp("json") / "m.jsonl"
    tracker = trk.JsonTracker(path)
    tracker.log(
        {"np": np.float32(value), "jax": jnp.float32(value), "np0d": np.array(value, dtype=np.float32)}, step=0
    )
    tracker.finish()
    (record,) = _read_lines(path)
    expected = np.float64(np.float32(value))
    for key in ("np", "jax", "np0d"):
        assert type(record[key]) is float
        assert _bits(record[key]) == _bits(float(expected))


def test_one_line_per_log_call_with_step_ints_bools_strings_arrays_and_nesting(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"
    tracker = trk.JsonTracker(path)
    tracker.log({"loss": 0.1 + 0.2, "n": np.int64(7), "ok": np.bool_(True), "note": "hi"}, step=0)
    tracker.log({"train": {"loss": jnp.float32(0.5), "hist": np.array([[1, 2], [3, 4]], dtype=np.int32)}}, step=1)
    tracker.log({"x": None, "big": 2**70}, step=None)
    tracker.finish()
    assert (
        path.read_text().splitlines()[0]
        == '{"step": 0, "loss": 0.30000000000000004, "n": 7, "ok": true, "note": "hi"}'
    )
    assert _read_lines(path) == [
        {"step": 0, "loss": 0.30000000000000004, "n": 7, "ok": True, "note": "hi"},
        {"step": 1, "train/loss": 0.5, "train/hist": [[1, 2], [3, 4]]},
        {"step": None, "x": None, "big": 2**70},
    ]


def test_non_finite_values_use_python_json_tokens(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tracker = trk.JsonTracker(path)
    tracker.log({"a": float("nan"), "b": float("inf"), "c": -np.float32("inf")}, step=2)
    tracker.finish()
    assert path.read_text() == '{"step": 2, "a": NaN, "b": Infinity, "c": -Infinity}\n'


def test_appends_to_an_existing_file_and_merges_hparams_and_summary(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first = trk.JsonTracker(path)
    first.log({"loss": 1.0}, step=0)
    first.log_hyperparameters({"lr": 0.1, "model": {"layers": 2}})
    first.log_summary({"best": 1.0})
    first.finish()
    second = trk.JsonTracker(path)  # a resumed run
    second.log({"loss": 0.5}, step=1)
    second.log_hyperparameters({"seed": 3})
    second.log_summary({"best": 0.5, "final": {"loss": np.float32(0.25)}})
    second.log_artifact(tmp_path / "config.yaml", type="config")
    second.finish()
    assert _read_lines(path) == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}]
    assert json.loads((tmp_path / "metrics.hparams.json").read_text()) == {
        "lr": 0.1,
        "model": {"layers": 2},
        "seed": 3,
    }
    assert json.loads((tmp_path / "metrics.summary.json").read_text()) == {"best": 0.5, "final/loss": 0.25}
    assert _read_lines(tmp_path / "metrics.artifacts.jsonl") == [
        {"path": str(tmp_path / "config.yaml"), "name": "config.yaml", "type": "config"}
    ]


def test_errors_name_the_metric(tmp_path: Path) -> None:
    tracker = trk.JsonTracker(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="may not be named 'step'"):
        tracker.log({"step": 1}, step=1)
    with pytest.raises(TypeError, match=r"metric 'bad' at step 3: .*type object"):
        tracker.log({"good": 1.0, "bad": object()}, step=3)
    tracker.finish()
    assert (tmp_path / "m.jsonl").read_text() == ""


def test_corrupt_hparams_file_is_reported_with_its_path(tmp_path: Path) -> None:
    (tmp_path / "m.hparams.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"m\.hparams\.json is not valid JSON"):
        trk.JsonTracker(tmp_path / "m.jsonl")


def test_config_default_path_uses_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    tracker = trk.JsonTrackerConfig().init("run42")
    tracker.log({"a": 1}, step=0)
    tracker.finish()
    assert _read_lines(tmp_path / "logs" / "run42" / "metrics.jsonl") == [{"step": 0, "a": 1}]
