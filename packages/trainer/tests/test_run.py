"""The run layer's steps on their own: config differences, provenance records, signals, restore, outputs, results.

Each test compares with expectations written out by hand (or with a naive reference), never with the code's own
output fed back to it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ponente.trainer import run
from ponente.trainer.checkpoint import save_checkpoint
from ponente.trainer.run import _provenance, _restore, _result, _startup
from ponente.trainer.tracker import JsonTrackerConfig, NoopTracker, TensorboardConfig
from ponente.trainer.trainer import TrainerConfig


@dataclasses.dataclass(frozen=True)
class _Config:
    """A root config in the shape the run layer expects: a ``trainer`` section plus the entry point's own keys."""

    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    tokenizer: str = "gpt2"
    data_seed: int | None = None


# --- config differences ---------------------------------------------------------------------------


def test_config_differences_reports_flattened_keys_split_by_what_must_stay_fixed():
    saved = {
        "config": {
            "data": {"tokenizer": "a", "cache_dir": "/x"},
            "data_seed": 1,
            "model": {"hidden_dim": 32},
            "trainer": {"seed": 0, "seed_offset": 1, "num_train_steps": 10, "id": "x", "mp": "p=f32"},
            "dataset_name": "old",
        },
        "num_devices": 8,
    }
    current = {
        "config": {
            "data": {"tokenizer": "a", "cache_dir": "/y"},
            "data_seed": 1,
            "model": {"hidden_dim": 32, "num_layers": 2},
            "trainer": {"seed": 0, "seed_offset": 2, "num_train_steps": 20, "id": "y", "mp": "p=f32"},
            "dataset_name": "new",
        },
        "num_devices": 8,
    }
    fixed, other = run.config_differences(saved, current)
    # `data` and `model` are fixed with everything under them (a key only one side has differs too); `trainer.id`
    # is never reported; `dataset_name` and `trainer.seed_offset` merely share a prefix with fixed keys
    assert fixed == ["data.cache_dir", "model.num_layers"]
    assert other == ["dataset_name", "trainer.num_train_steps", "trainer.seed_offset"]


def test_config_differences_of_identical_records_is_empty_and_num_devices_is_fixed():
    record = {"config": {"trainer": {"seed": 3}}, "num_devices": 4}
    assert run.config_differences(record, dict(record)) == ([], [])
    assert run.config_differences(record, {**record, "num_devices": 2}) == (["num_devices"], [])
    assert run.config_differences({"config": None}, {"config": {"trainer": {"seed": 1}}}) == (["trainer.seed"], [])


def _naive_flat(tree: dict[str, Any]) -> dict[str, Any]:
    out, stack = {}, [("", tree)]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append((prefix + key + ".", value))
            else:
                out[prefix + key] = value
    return out


_NAMES = st.sampled_from(["data", "model", "trainer", "seed", "mp", "id", "tokenizer", "data_seed", "x"])
_TREES = st.dictionaries(
    _NAMES,
    st.recursive(st.integers(0, 2), lambda children: st.dictionaries(_NAMES, children, max_size=3), max_leaves=8),
    max_size=4,
)


@settings(max_examples=100, deadline=None)
@given(_TREES, _TREES, st.integers(1, 2), st.integers(1, 2))
def test_config_differences_matches_a_naive_comparison(a, b, devices_a, devices_b):
    saved, current = {"config": a, "num_devices": devices_a}, {"config": b, "num_devices": devices_b}
    flat_a = _naive_flat(a) | {"num_devices": devices_a}
    flat_b = _naive_flat(b) | {"num_devices": devices_b}
    missing = object()
    differing = {
        k
        for k in set(flat_a) | set(flat_b)
        if flat_a.get(k, missing) != flat_b.get(k, missing) and k.split(".")[:2] != ["trainer", "id"]
    }
    # the leaf's path starts with a fixed key's path, component by component
    fixed = {
        k
        for k in differing
        if any(k.split(".")[: len(f.split("."))] == f.split(".") for f in _provenance.FIXED_ON_RESUME)
    }
    got_fixed, got_other = run.config_differences(saved, current)
    assert got_fixed == sorted(fixed)
    assert got_other == sorted(differing - fixed)


# --- provenance -----------------------------------------------------------------------------------


def test_with_run_id_keeps_a_given_id_and_otherwise_makes_a_timestamped_one():
    given_id = _provenance.with_run_id(_Config(trainer=TrainerConfig(id="mine")))
    assert given_id.trainer.id == "mine"
    fresh = _provenance.with_run_id(_Config())
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", fresh.trainer.id or "")
    assert dataclasses.replace(fresh, trainer=TrainerConfig()) == _Config()  # nothing else changed


def test_run_record_holds_the_resolved_config_and_device_count(tmp_path):
    config = _Config(trainer=TrainerConfig(id="r1", run_dir=str(tmp_path / "runs" / "{run_id}")), tokenizer="t")
    record = _provenance.RunRecord.of(config)
    assert record.run_id == "r1"
    assert record.run_dir == str(tmp_path / "runs" / "r1")
    assert record.num_devices == len(jax.devices())
    assert record.config["tokenizer"] == "t"
    assert record.config["data_seed"] is None
    assert record.config["trainer"]["id"] == "r1"
    assert record.config["trainer"]["train_batch_size"] == TrainerConfig().train_batch_size
    assert record.provenance == {"config": record.config, "num_devices": len(jax.devices())}
    json.dumps(record.provenance)  # saved in every checkpoint's metadata.json


def test_run_record_needs_a_run_id():
    with pytest.raises(ValueError, match=r"trainer\.id.*with_run_id"):
        _provenance.RunRecord.of(_Config())


def test_run_record_write_leaves_the_config_git_and_pip_freeze_in_the_run_folder(tmp_path):
    config = _Config(trainer=TrainerConfig(id="r2", run_dir=str(tmp_path / "{run_id}")), tokenizer="t")
    record = _provenance.RunRecord.of(config)
    record.write(NoopTracker())
    folder = tmp_path / "r2"
    assert {"config.yaml", "pip_freeze.txt", "git.txt", "versions.json"} <= {p.name for p in folder.iterdir()}
    written = yaml.safe_load((folder / "config.yaml").read_text())
    assert written["tokenizer"] == "t"
    assert written["trainer"]["id"] == "r2"
    assert "jax==" in (folder / "pip_freeze.txt").read_text()


def test_provenance_of_two_runs_differs_exactly_in_the_changed_keys():
    a = _provenance.RunRecord.of(_Config(trainer=TrainerConfig(id="a", train_batch_size=8, num_train_steps=10)))
    b = _provenance.RunRecord.of(_Config(trainer=TrainerConfig(id="b", train_batch_size=4, num_train_steps=20)))
    assert run.config_differences(a.provenance, b.provenance) == (
        ["trainer.train_batch_size"],
        ["trainer.num_train_steps"],
    )


# --- restore --------------------------------------------------------------------------------------


class _NoCheckpoints:
    run_path = "/nowhere/run"

    def latest_checkpoint_path(self) -> None:
        return None


def _saved(tmp_path: Path, provenance: dict[str, Any]) -> str:
    """A run folder with one committed checkpoint, ``step-3``, recording ``provenance``."""
    state = {"w": jnp.arange(3.0), "step": jnp.asarray(3)}
    save_checkpoint(state, tmp_path / "run" / "step-3", step=3, metadata=provenance)
    return str(tmp_path / "run")


def test_restore_without_a_checkpoint_keeps_the_state_unless_one_is_required():
    state = {"w": jnp.zeros(3)}
    assert _restore.restore(state, TrainerConfig(), _NoCheckpoints(), {}) == (state, None)
    with pytest.raises(FileNotFoundError, match="load_checkpoint is true but /nowhere/run has no committed"):
        _restore.restore(state, TrainerConfig(load_checkpoint=True), _NoCheckpoints(), {})


def test_restore_refuses_a_change_of_a_fixed_key_unless_allowed(tmp_path, caplog):
    where = _saved(tmp_path, {"config": {"trainer": {"seed": 0, "num_train_steps": 5}}, "num_devices": 1})
    current = {"config": {"trainer": {"seed": 1, "num_train_steps": 9}}, "num_devices": 1}
    template = {"w": jnp.zeros(3), "step": jnp.asarray(0)}
    with pytest.raises(ValueError, match=r"changes trainer\.seed: .*set trainer\.allow_config_change=true"):
        _restore.restore(template, TrainerConfig(load_checkpoint_path=where), _NoCheckpoints(), current)

    tcfg = TrainerConfig(load_checkpoint_path=where, allow_config_change=True)
    with caplog.at_level(logging.INFO, logger="ponente.trainer.run"):
        state, source = _restore.restore(template, tcfg, _NoCheckpoints(), current)
    assert source is not None
    assert source.endswith("step-3")
    np.testing.assert_array_equal(np.asarray(state["w"]), [0.0, 1.0, 2.0])
    assert int(state["step"]) == 3
    messages = {r.levelno: r.getMessage() for r in caplog.records}
    assert "trainer.seed" in messages[logging.WARNING]
    assert "not be bitwise identical" in messages[logging.WARNING]
    assert any("changed config keys: trainer.num_train_steps" in r.getMessage() for r in caplog.records)


def test_restore_of_a_folder_that_is_not_a_checkpoint_names_it(tmp_path):
    (tmp_path / "empty").mkdir()
    tcfg = TrainerConfig(load_checkpoint_path=str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"load_checkpoint_path: .*empty is not a committed checkpoint"):
        _restore.restore({"w": jnp.zeros(3)}, tcfg, _NoCheckpoints(), {})


# --- start-up timing, outputs, the end of a run ---------------------------------------------------


def test_startup_logs_every_phase_once_at_the_first_step(caplog):
    from concurrent.futures import ThreadPoolExecutor

    startup = _startup.Startup(0.0)
    startup.mark("config")
    with ThreadPoolExecutor(1) as pool:
        assert startup.background(pool, "compile", lambda x: x + 1, 41).result() == 42
    assert list(startup.phases) == ["config", "[bg] compile"]
    with caplog.at_level(logging.INFO, logger="ponente.trainer.run"):
        startup.first_step()
        startup.first_step()
    (line,) = [r.getMessage() for r in caplog.records if "first step done" in r.getMessage()]
    assert re.search(r"\(config \d+\.\d\d s, \[bg\] compile \d+\.\d\d s\)$", line)


def test_output_locations_name_each_place_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tmp_path = Path(os.path.realpath(tmp_path))  # what the working directory resolves to
    record = _provenance.RunRecord(run_id="r", config={}, num_devices=1, run_dir="logs/r")
    trackers = (JsonTrackerConfig(path="j/{run_id}/m.jsonl"), TensorboardConfig(logdir="memory://tb/{run_id}"))
    assert _result.output_locations(record, checkpoints="ckpt/r", trackers=trackers) == {
        "checkpoints": os.path.join(tmp_path, "ckpt", "r"),
        "run record": os.path.join(tmp_path, "logs", "r"),
        "json logs": os.path.join(tmp_path, "j", "r", "m.jsonl"),
        "tensorboard logs": "memory://tb/r",
    }
    no_dir = dataclasses.replace(record, run_dir=None)
    assert _result.output_locations(no_dir, checkpoints="gs://b/r", trackers=JsonTrackerConfig(path="m.jsonl")) == {
        "checkpoints": "gs://b/r",
        "json logs": os.path.join(tmp_path, "m.jsonl"),
    }


class _Recorder:
    """Records the calls made to it, in order."""

    def __init__(self, latest: str | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.latest = latest

    def on_step(self, state: Any, step: int, *, force: bool = False) -> None:
        self.calls.append(("on_step", step, force))

    def close(self) -> None:
        self.calls.append(("close",))

    def latest_checkpoint_path(self) -> str | None:
        self.calls.append(("latest",))
        return self.latest

    def log_summary(self, metrics: dict[str, Any]) -> None:
        self.calls.append(("log_summary", metrics))

    def finish(self) -> None:
        self.calls.append(("finish",))


@dataclasses.dataclass
class _State:
    step: int


def test_final_checkpoint_saves_unless_no_step_ran_then_closes():
    checkpointer = _Recorder(latest="ckpt/step-7")
    assert _result.final_checkpoint(checkpointer, _State(7)) == "ckpt/step-7"
    assert checkpointer.calls == [("on_step", 7, True), ("close",), ("latest",)]
    untouched = _Recorder()
    assert _result.final_checkpoint(untouched, _State(0)) is None
    assert untouched.calls == [("close",), ("latest",)]


def test_finish_trackers_logs_the_summary_then_finishes():
    tracker = _Recorder()
    _result.finish_trackers(tracker, steps=3, final_loss=1.5, eval_loss={"valid/loss": 2.0})
    assert tracker.calls == [
        ("log_summary", {"steps": 3, "final/train_loss": 1.5, "final/eval/valid/loss": 2.0}),
        ("finish",),
    ]
    tracker = _Recorder()
    _result.finish_trackers(tracker, steps=0, final_loss=None, eval_loss={})
    assert tracker.calls == [("log_summary", {"steps": 0}), ("finish",)]


def _a_result(**changes: Any) -> run.TrainResult:
    fields: dict[str, Any] = {
        "run_id": "r",
        "steps": 3,
        "final_loss": 1.25,
        "eval_loss": {"valid/loss": 2.5},
        "checkpoint": "/c/r/step-3",
        "resumed_from": None,
        "hf_path": None,
        "sample": "To be\nor not",
        "stopped": None,
        "outputs": {"checkpoints": "/c/r"},
    }
    return run.TrainResult(**(fields | changes))


def test_print_result_prints_what_the_run_wrote_and_returns_the_exit_code(capsys):
    assert _result.print_result(_a_result()) == 0
    out, err = capsys.readouterr()
    assert out == (
        "run r: 3 steps, final train loss 1.25\n"
        "  eval valid/loss: 2.5000\n"
        "  checkpoint: /c/r/step-3\n"
        "  checkpoints: /c/r\n"
        "  sample:\n"
        "    To be\n"
        "    or not\n"
    )
    assert err == ""
    assert _result.print_result(_a_result(stopped="SIGTERM", sample=None)) == 0 == run.PREEMPTED_EXIT_CODE
    out, err = capsys.readouterr()
    assert "sample" not in out
    assert err == "stopped early: SIGTERM\n"
    assert _result.print_result(_a_result(stopped="SIGTERM", exit_code=75)) == 75  # trainer.preemption_exit_code: 75
    assert _result.print_result(_a_result(stopped=f"{_result.NONFINITE_STOP}: step 4: non-finite loss=nan")) == 1
    assert "error: stopped: non-finite loss: step 4" in capsys.readouterr().err
