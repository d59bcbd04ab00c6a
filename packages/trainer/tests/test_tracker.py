"""Tests for ponente.trainer.tracker.tracker: the Tracker ABC, composition, config family, global tracker, jit_log."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.trainer.tracker as trk
from ponente.trainer.config import load_config
from ponente.trainer.tracker import tracker as tracker_module


class RecordingTracker(trk.Tracker):
    """Keeps every call, in order, as plain tuples."""

    def __init__(self, fail_on_finish: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_on_finish = fail_on_finish

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        self.calls.append(("hparams", dict(params)))

    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        self.calls.append(("log", dict(metrics), step, commit))

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        self.calls.append(("summary", dict(metrics)))

    def log_artifact(self, path: str | os.PathLike[str], *, name: str | None = None, type: str | None = None) -> None:
        self.calls.append(("artifact", os.fspath(path), name, type))

    def finish(self) -> None:
        self.calls.append(("finish",))
        if self.fail_on_finish:
            raise OSError("disk full")


@pytest.fixture(autouse=True)
def _no_global_tracker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracker_module, "_global_tracker", None)


_metric_values = st.one_of(st.integers(-(10**6), 10**6), st.floats(allow_nan=False), st.text(max_size=5))
_metrics = st.dictionaries(st.text(min_size=1, max_size=6), _metric_values, max_size=4)
_call = st.one_of(
    st.tuples(
        st.just("log"), _metrics, st.one_of(st.none(), st.integers(0, 100)), st.sampled_from([None, True, False])
    ),
    st.tuples(st.just("hparams"), _metrics),
    st.tuples(st.just("summary"), _metrics),
    st.tuples(st.just("artifact"), st.text(min_size=1, max_size=8), st.none(), st.sampled_from([None, "config"])),
)


def _replay(tracker: trk.Tracker, calls: list[tuple[Any, ...]]) -> None:
    for call in calls:
        if call[0] == "log":
            tracker.log(call[1], step=call[2], commit=call[3])
        elif call[0] == "hparams":
            tracker.log_hyperparameters(call[1])
        elif call[0] == "summary":
            tracker.log_summary(call[1])
        else:
            tracker.log_artifact(call[1], name=call[2], type=call[3])


@settings(max_examples=30, deadline=None)
@given(calls=st.lists(_call, max_size=8), n=st.integers(1, 3))
def test_composite_forwards_every_call_in_order_to_each_tracker(calls: list[tuple[Any, ...]], n: int) -> None:
    inner = [RecordingTracker() for _ in range(n)]
    composite = trk.CompositeTracker(inner)
    _replay(composite, calls)
    composite.finish()
    expected = [tuple(dict(c) if isinstance(c, dict) else c for c in call) for call in calls] + [("finish",)]
    for t in inner:
        assert t.calls == expected


def test_composite_finishes_all_trackers_then_raises_the_first_error() -> None:
    inner = [RecordingTracker(fail_on_finish=True), RecordingTracker()]
    with pytest.raises(OSError, match="disk full"):
        trk.CompositeTracker(inner).finish()
    assert inner[1].calls == [("finish",)]


def test_noop_tracker_accepts_everything_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    t = trk.NoopConfig().init("run")
    assert isinstance(t, trk.NoopTracker)
    _replay(
        t, [("log", {"a": 1.0}, 0, None), ("hparams", {"b": 2}), ("summary", {"c": 3}), ("artifact", "x", None, None)]
    )
    t.finish()
    assert list(tmp_path.iterdir()) == []


def test_tracker_config_family_registers_all_types_with_json_default() -> None:
    assert trk.TrackerConfig.choice_names() == ["json", "noop", "tensorboard", "wandb"]
    assert trk.TrackerConfig.default_choice == "json"
    assert trk.TrackerConfig.get_choice_class("tensorboard") is trk.TensorboardConfig
    assert trk.TrackerConfig.get_choice_class("wandb") is trk.WandbConfig
    assert trk.TrackerConfig.get_choice_class("json") is trk.JsonTrackerConfig
    assert trk.TrackerConfig.get_choice_class("noop") is trk.NoopConfig


def test_init_trackers_composes_a_tuple_and_substitutes_run_id(tmp_path: Path) -> None:
    configs = (
        trk.JsonTrackerConfig(path=str(tmp_path / "a" / "{run_id}.jsonl")),
        trk.JsonTrackerConfig(path=str(tmp_path / "b" / "{run_id}.jsonl")),
    )
    tracker = trk.init_trackers(configs, run_id="r7")
    assert isinstance(tracker, trk.CompositeTracker)
    tracker.log({"loss": 0.25}, step=3)
    tracker.finish()
    for folder in ("a", "b"):
        lines = (tmp_path / folder / "r7.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == [{"step": 3, "loss": 0.25}]


def test_init_trackers_single_empty_and_bad_elements(tmp_path: Path) -> None:
    assert isinstance(trk.init_trackers(trk.NoopConfig(), run_id=None), trk.NoopTracker)
    assert isinstance(trk.init_trackers((), run_id=None), trk.NoopTracker)
    single = trk.init_trackers([trk.JsonTrackerConfig(path=str(tmp_path / "m.jsonl"))], run_id=None)
    assert isinstance(single, trk.JsonTracker)
    single.finish()
    with pytest.raises(TypeError, match=r"tracker config \[1\] must be a TrackerConfig, got dict"):
        trk.init_trackers([trk.NoopConfig(), {"type": "json"}], run_id=None)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="got str"):
        trk.init_trackers("json", run_id=None)  # type: ignore[arg-type]


def test_path_template_rejects_unknown_placeholders() -> None:
    with pytest.raises(ValueError, match=r"only the placeholder \{run_id\}"):
        trk.JsonTrackerConfig(path="logs/{user}/m.jsonl").init("r")


def test_log_without_global_tracker_raises_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no global tracker is set"):
        trk.log({"loss": 1.0}, step=0)
    with pytest.raises(RuntimeError, match="no global tracker is set"):
        trk.current_tracker()


def test_set_global_tracker_is_immediate_and_restores_previous_as_context_manager() -> None:
    outer, inner = RecordingTracker(), RecordingTracker()
    trk.set_global_tracker(outer)
    assert trk.current_tracker() is outer
    with trk.set_global_tracker(inner) as entered:
        assert entered is inner
        trk.log({"a": 1}, step=5, commit=False)
    trk.log({"b": 2}, step=6)
    assert inner.calls == [("log", {"a": 1}, 5, False)]
    assert outer.calls == [("log", {"b": 2}, 6, None)]
    with pytest.raises(TypeError, match="expects a Tracker"):
        trk.set_global_tracker("json")  # type: ignore[arg-type]


def test_jit_log_inside_jit_and_scan_forwards_values_in_order() -> None:
    recorder = RecordingTracker()
    xs = np.arange(12, dtype=np.float32).reshape(4, 3) / 7

    @jax.jit
    def run(x: jax.Array) -> jax.Array:
        def body(carry: jax.Array, row: jax.Array) -> tuple[jax.Array, None]:
            trk.jit_log({"row_max": jnp.max(row), "nested": {"carry": carry}}, step=carry)
            return carry + 1, None

        final, _ = jax.lax.scan(body, jnp.int32(0), x)
        trk.jit_log({"done": final}, step=10)
        return final

    with trk.set_global_tracker(recorder):
        run(jnp.asarray(xs)).block_until_ready()
        jax.effects_barrier()
    logs = [c for c in recorder.calls if c[0] == "log"]
    assert [c[2] for c in logs] == [0, 1, 2, 3, 10]
    for i in range(4):
        metrics = logs[i][1]
        assert np.asarray(metrics["row_max"]).item() == float(xs[i].max())
        assert np.asarray(metrics["nested"]["carry"]).item() == i
    assert np.asarray(logs[4][1]["done"]).item() == 4


def test_jit_log_to_json_tracker_writes_exact_float32_values(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tracker = trk.JsonTracker(path)
    x = np.array([0.1, 1 / 3, 1e-8], dtype=np.float32)

    @jax.jit
    def f(v: jax.Array, step: jax.Array) -> jax.Array:
        trk.jit_log({"v0": v[0], "v1": v[1], "v2": v[2], "flag": v[0] > 0}, step=step)
        return v

    with trk.set_global_tracker(tracker):
        f(jnp.asarray(x), jnp.int32(4)).block_until_ready()
        jax.effects_barrier()
    tracker.finish()
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert record == {"step": 4, "v0": float(x[0]), "v1": float(x[1]), "v2": float(x[2]), "flag": True}
    assert type(record["step"]) is int


@dataclasses.dataclass(frozen=True)
class _RunConfig:
    tracker: trk.TrackerConfig | tuple[trk.TrackerConfig, ...] = dataclasses.field(
        default_factory=trk.JsonTrackerConfig
    )


def test_levanter_style_yaml_selects_tracker_types_and_a_list_composes(tmp_path: Path) -> None:
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(
        "tracker:\n"
        "  - type: wandb\n    project: levanter\n    tags: [gpt2, nano]\n"
        f"  - type: json\n    path: {tmp_path}/{{run_id}}.jsonl\n"
    )
    cfg = load_config(_RunConfig, [str(yaml_path)])
    assert cfg.tracker == (
        trk.WandbConfig(project="levanter", tags=("gpt2", "nano")),
        trk.JsonTrackerConfig(path=f"{tmp_path}/{{run_id}}.jsonl"),
    )
    yaml_path.write_text("tracker:\n  path: metrics.jsonl\n")  # no type: the default, json
    assert load_config(_RunConfig, [str(yaml_path)]).tracker == trk.JsonTrackerConfig(path="metrics.jsonl")
    yaml_path.write_text("tracker:\n  type: json\n")
    assert load_config(_RunConfig, [str(yaml_path)], ["tracker.type=noop"]).tracker == trk.NoopConfig()
