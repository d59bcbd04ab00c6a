"""Bitwise-reproducible resumption of ``train_lm``: ``kill -9``, SIGTERM, a kill during an async save,
provenance checks and ``trainer.initialize_from``.

Every interrupted run is compared with one uninterrupted reference run (a subprocess, like the others):
the per-step losses in the JSON log (which the tracker truncates to the resumed step, so every step
appears once) and every leaf of the final checkpoint must be bitwise identical.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from conftest import TrainLmProcess, write_config

import ponente.namedtensor as hax
from ponente.trainer.checkpoint import (
    discover_checkpoints,
    latest_checkpoint_path,
    load_checkpoint,
    read_metadata,
)
from ponente.trainer.checkpoint._io import SLOW_CHECKPOINT_ENV
from ponente.trainer.config import load_config
from ponente.trainer.data import data_vocab_size
from ponente.trainer.main import train_lm
from ponente.trainer.main.train_lm import PREEMPTED_EXIT_CODE, TrainLmConfig
from ponente.trainer.run._restore import restore
from ponente.trainer.tasks.lm import lm_loss_fn
from ponente.trainer.trainer import Trainer

STEPS = 12
EVERY = 3


def _overrides(make: Any, directory: Path) -> list[str]:
    return [
        *make(directory, STEPS),
        "trainer.checkpointer.save_interval=1h",
        f"trainer.checkpointer.keep=[{{every: {EVERY}}}]",
        "trainer.progress_bar=false",
    ]


def _records(directory: Path) -> list[dict[str, Any]]:
    path = directory / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n"):  # a line being written is not complete yet
            out.append(json.loads(line))
    return out


def _last_step(directory: Path) -> int:
    return max((r["step"] for r in _records(directory) if "train/loss" in r), default=0)


def _losses(directory: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in _records(directory) if "train/loss" in r]


def _state_template(overrides: list[str]) -> Any:
    """A freshly initialized training state of the configured run: the structure to load checkpoints into."""
    cfg = load_config(TrainLmConfig, overrides=overrides)
    tcfg = cfg.trainer
    trainer = Trainer(tcfg, cfg.optimizer.build(tcfg.num_train_steps), lm_loss_fn(0.0, None))
    Vocab = hax.Axis("vocab", data_vocab_size(cfg.data))
    return trainer.initial_state(lambda key: cfg.model.build(Vocab, key=key))


def _leaf_bytes(tree: Any) -> list[tuple[str, bytes]]:
    """Every array leaf's dtype and raw bytes (key arrays as their key data), for a bitwise comparison."""
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            host = np.asarray(leaf)
            out.append((f"{jax.tree_util.keystr(path)}:{host.dtype}{host.shape}", host.tobytes()))
    return out


def _assert_bitwise_equal(got: Any, expected: Any) -> None:
    got_leaves, expected_leaves = _leaf_bytes(got), _leaf_bytes(expected)
    assert [n for n, _ in got_leaves] == [n for n, _ in expected_leaves]
    differing = [n for (n, a), (_, b) in zip(got_leaves, expected_leaves, strict=True) if a != b]
    assert not differing, f"leaves differ: {differing}"


class _Reference:
    def __init__(self, directory: Path, overrides: list[str]) -> None:
        self.directory = directory
        self.overrides = overrides
        self.losses = _losses(directory)
        self.template = _state_template(overrides)
        self.final = load_checkpoint(self.template, directory / "ckpt" / "tiny" / f"step-{STEPS}")


@pytest.fixture(scope="module")
def reference(tiny_lm_shared: Any, tmp_path_factory: pytest.TempPathFactory) -> _Reference:
    """One uninterrupted run of ``STEPS`` steps (also builds the shared token cache)."""
    directory = tmp_path_factory.mktemp("reference")
    overrides = _overrides(tiny_lm_shared, directory)
    write_config(directory, overrides)
    run = TrainLmProcess(directory, 0)
    assert run.finish() == 0, run.stderr()[-3000:]
    ref = _Reference(directory, overrides)
    assert [s for s, _ in ref.losses] == list(range(1, STEPS + 1))
    committed = [c.step for c in discover_checkpoints(directory / "ckpt" / "tiny") if c.committed]
    assert committed == list(range(EVERY, STEPS + 1, EVERY))
    return ref


def _check_matches(reference: _Reference, directory: Path) -> None:
    losses = _losses(directory)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1)), "every step must be logged exactly once"
    assert losses == reference.losses
    final = load_checkpoint(reference.template, directory / "ckpt" / "tiny" / f"step-{STEPS}")
    _assert_bitwise_equal(final, reference.final)
    assert int(final.step) == STEPS


def _committed_steps(directory: Path) -> list[int]:
    return [c.step for c in discover_checkpoints(directory / "ckpt" / "tiny") if c.committed]


@pytest.mark.integration
def test_reference_run_logs_every_step_and_checkpoints_per_policy(reference: _Reference) -> None:
    losses = [loss for _, loss in reference.losses]
    assert np.mean(losses[-3:]) < losses[0], losses
    assert int(reference.final.step) == STEPS


@pytest.mark.integration
def test_kill_9_twice_once_during_an_async_save_resumes_bitwise(
    reference: _Reference, tiny_lm_shared: Any, tmp_path: Path
) -> None:
    overrides = _overrides(tiny_lm_shared, tmp_path)
    write_config(tmp_path, overrides)
    rng = random.Random(9)

    # 1. kill -9 at a random step after the first checkpoint
    kill_at = rng.randint(EVERY + 1, 2 * EVERY - 1)
    first = TrainLmProcess(tmp_path, 1)
    first.wait_until(lambda: _last_step(tmp_path) >= kill_at and _committed_steps(tmp_path), f"step {kill_at}")
    first.proc.send_signal(signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    resumed_step = _committed_steps(tmp_path)[-1]

    # 2. resume; kill -9 while the next checkpoint's arrays are written but not committed
    second = TrainLmProcess(tmp_path, 2, env={SLOW_CHECKPOINT_ENV: "120"})
    second.wait_until(lambda: "waiting before the commit" in second.stderr(), "an in-flight save")
    second.proc.send_signal(signal.SIGKILL)
    assert second.finish() == -signal.SIGKILL
    found = discover_checkpoints(tmp_path / "ckpt" / "tiny")
    in_flight = [c for c in found if not c.committed]
    assert in_flight, found
    assert in_flight[-1].step > resumed_step, found
    # steps after the last commit were logged: the resumed run must replace, not duplicate, them
    assert _last_step(tmp_path) >= in_flight[-1].step
    previous = latest_checkpoint_path(tmp_path / "ckpt" / "tiny")
    assert previous is not None
    assert previous.endswith(f"step-{resumed_step}")
    meta = read_metadata(previous)
    assert meta is not None
    loaded = load_checkpoint(reference.template, previous)
    assert int(loaded.step) == meta["step"] == resumed_step

    # 3. resume to the end
    third = TrainLmProcess(tmp_path, 3)
    assert third.finish() == 0, third.stderr()[-3000:]
    assert f"resuming from {previous}" in third.stderr()
    _check_matches(reference, tmp_path)
    assert all(c.committed for c in discover_checkpoints(tmp_path / "ckpt" / "tiny"))


@pytest.mark.integration
def test_sigterm_checkpoints_exits_0_and_resumes_bitwise(
    reference: _Reference, tiny_lm_shared: Any, tmp_path: Path
) -> None:
    overrides = _overrides(tiny_lm_shared, tmp_path)
    write_config(tmp_path, overrides)
    stop_at = random.Random(15).randint(2, STEPS - 2)
    first = TrainLmProcess(tmp_path, 1)
    first.wait_until(lambda: _last_step(tmp_path) >= stop_at, f"step {stop_at}")
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish() == PREEMPTED_EXIT_CODE, first.stderr()[-3000:]
    stopped = _last_step(tmp_path)
    assert stopped < STEPS
    assert _committed_steps(tmp_path)[-1] == stopped  # the step boundary it stopped at was saved
    assert "stopped early: SIGTERM" in first.stderr()

    second = TrainLmProcess(tmp_path, 2)
    assert second.finish() == 0, second.stderr()[-3000:]
    _check_matches(reference, tmp_path)


@pytest.mark.integration
def test_resuming_with_a_changed_fixed_field_errors_unless_allowed(
    reference: _Reference, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shutil.copytree(reference.directory / "ckpt", tmp_path / "ckpt")
    base = [
        o for o in reference.overrides if not o.startswith(("trainer.checkpointer.base_path=", "trainer.tracker="))
    ]
    base += [
        f"trainer.checkpointer.base_path={tmp_path / 'ckpt'}",
        f"trainer.tracker={{type: json, path: {tmp_path / 'metrics.jsonl'}}}",
        "trainer.train_batch_size=4",
        f"trainer.num_train_steps={STEPS + 1}",
    ]
    with pytest.raises(ValueError, match=r"changes trainer\.train_batch_size.*trainer\.allow_config_change=true"):
        train_lm.train(load_config(TrainLmConfig, overrides=base))

    with caplog.at_level(logging.WARNING, logger="ponente.trainer.train_lm"):
        result = train_lm.train(load_config(TrainLmConfig, overrides=[*base, "trainer.allow_config_change=true"]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("trainer.train_batch_size" in w and "not be bitwise identical" in w for w in warnings), warnings
    assert result.resumed_from is not None
    assert result.resumed_from.endswith(f"step-{STEPS}")
    assert result.steps == STEPS + 1
    assert [s for s, _ in _losses(tmp_path)] == [STEPS + 1]


@pytest.mark.integration
def test_initialize_from_starts_a_new_run_at_step_0_with_the_other_runs_weights(
    reference: _Reference, tmp_path: Path
) -> None:
    source = str(reference.directory / "ckpt" / "tiny")
    overrides = [
        *reference.overrides,
        "trainer.id=fresh",
        f"trainer.checkpointer.base_path={tmp_path / 'ckpt'}",
        f"trainer.initialize_from={source}",
    ]
    cfg = load_config(TrainLmConfig, overrides=overrides)
    checkpointer = cfg.trainer.checkpointer.create("fresh")
    fresh = _state_template(overrides)
    state, resumed_from = restore(fresh, cfg.trainer, checkpointer, {"config": {}, "num_devices": jax.device_count()})
    checkpointer.close()
    assert resumed_from is None
    assert int(state.step) == 0
    _assert_bitwise_equal(state.model, reference.final.model)  # the other run's final weights
    _assert_bitwise_equal(state.opt_state, fresh.opt_state)  # but a fresh optimizer state
    assert _leaf_bytes(state.model) != _leaf_bytes(fresh.model)
