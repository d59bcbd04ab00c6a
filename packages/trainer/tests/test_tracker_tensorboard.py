"""Tests for ponente.trainer.tracker.tensorboard: event files read back with a hand-written TFRecord reader
and tensorboardX's bundled ``Event`` protobuf (no ``tensorboard`` package needed)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboardX.proto.event_pb2 import Event

import ponente.trainer.tracker as trk


def _read_events(logdir: Path) -> list[Event]:
    """Parse every TFRecord (u64 length, u32 crc, data, u32 crc) of the event files in ``logdir``."""
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}: {list(logdir.iterdir())}"
    events = []
    for file in files:
        data = file.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            payload = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = Event()
            event.ParseFromString(payload)
            events.append(event)
    return events


def _values(logdir: Path) -> list[tuple[str, int, Any]]:
    """(tag, step, value) for every summary value: float for scalars, str for text, the histo proto otherwise."""
    out: list[tuple[str, int, Any]] = []
    for event in _read_events(logdir):
        if not event.HasField("summary"):
            continue
        for value in event.summary.value:
            kind = value.WhichOneof("value")
            if kind == "simple_value":
                out.append((value.tag, event.step, value.simple_value))
            elif kind == "histo":
                out.append((value.tag, event.step, value.histo))
            else:
                assert value.metadata.plugin_data.plugin_name == "text"
                out.append((value.tag, event.step, value.tensor.string_val[0].decode()))
    return out


def _strip_text_suffix(tag: str) -> str:
    # tensorboardX stores text summaries under "<tag>/text_summary"
    return tag.removesuffix("/text_summary")


@settings(max_examples=20, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=6))
def test_scalars_read_back_as_float32_at_their_steps(
    tmp_path_factory: pytest.TempPathFactory, values: list[float]
) -> None:
    logdir = tmp_path_factory.mktemp("tb")
    tracker = trk.TensorboardConfig(logdir=str(logdir)).init("r")
    for step, v in enumerate(values):
        tracker.log({"train": {"loss": v}, "lr": np.float32(v / 2)}, step=step * 10)
    tracker.finish()
    got = _values(logdir)
    expected = []
    for step, v in enumerate(values):
        expected += [("train/loss", step * 10, float(np.float32(v))), ("lr", step * 10, float(np.float32(v / 2)))]
    assert got == expected


def test_text_histograms_hparams_summary_and_artifacts(tmp_path: Path) -> None:
    logdir = tmp_path / "tb" / "run9"
    tracker = trk.TensorboardConfig(logdir=str(tmp_path / "tb" / "{run_id}")).init("run9")
    assert isinstance(tracker, trk.TensorboardTracker)
    tracker.log_hyperparameters({"optimizer": {"learning_rate": 0.001}, "name": "a|b"})
    weights = np.array([1.0, 2.0, 2.0, 5.0])
    tracker.log({"note": "hello", "weights": jnp.asarray(weights), "flag": True, "count": 3}, step=4)
    tracker.log({"loss": 1.5}, step=None)
    tracker.log_summary({"final_loss": 1.25})
    tracker.log_artifact(tmp_path / "config.yaml", type="config")
    tracker.finish()
    values = {(_strip_text_suffix(tag), step): v for tag, step, v in _values(logdir)}
    assert (
        values[("hparams", 0)] == "| name | value |\n|---|---|\n| optimizer/learning_rate | 0.001 |\n| name | a\\|b |"
    )
    assert values[("note", 4)] == "hello"
    histo = values[("weights", 4)]
    assert (histo.min, histo.max, histo.num, histo.sum, histo.sum_squares) == (1.0, 5.0, 4, 10.0, 34.0)
    assert values[("flag", 4)] == 1.0
    assert values[("count", 4)] == 3.0
    assert values[("loss", 4)] == 1.5  # step None: the last logged step
    assert values[("summary/final_loss", 4)] == 1.25
    assert values[("artifacts/config.yaml", 0)] == f"{tmp_path / 'config.yaml'} (config)"


def test_non_numeric_metric_raises_naming_the_metric(tmp_path: Path) -> None:
    tracker = trk.TensorboardConfig(logdir=str(tmp_path)).init(None)
    with pytest.raises(TypeError, match="cannot write metric 'obj' of type object"):
        tracker.log({"obj": object()}, step=0)
    with pytest.raises(TypeError, match="cannot write metric 'strings'"):
        tracker.log({"strings": np.array(["a", "b"])}, step=0)
    tracker.finish()


def test_creating_the_tracker_does_not_import_torch(tmp_path):
    # a fresh interpreter: here tensorboardX is already imported. torch stays importable afterwards (the
    # hiding entry is gone), and the writer still writes events.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import sys
        import ponente.trainer.tracker as trk
        tracker = trk.TensorboardConfig(logdir={str(tmp_path / "tb")!r}).init("r")
        tracker.log({{"train/loss": 1.5}}, step=1)
        tracker.finish()
        print("torch" in sys.modules, sys.modules.get("torch", "absent"))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split() == ["False", "absent"]
    events = _read_events(tmp_path / "tb")
    assert [v.simple_value for e in events for v in e.summary.value if v.tag == "train/loss"] == [1.5]
