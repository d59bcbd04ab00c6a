"""A non-finite loss skips its update or stops the run with a checkpoint of the last good state (by config); a full
disk during a checkpoint stops the run with one line; SIGTERM checkpoints and exits with its configured status."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import write_config

from ponente.trainer.checkpoint import _location as location
from ponente.trainer.checkpoint import discover_checkpoints, latest_checkpoint_path, load_checkpoint
from ponente.trainer.config import load_config
from ponente.trainer.data import data_vocab_size
from ponente.trainer.main import train_lm
from ponente.trainer.main.train_lm import TrainLmConfig
from ponente.trainer.run._result import NONFINITE_STOP, print_result
from ponente.trainer.tasks.lm import LmTask
from ponente.trainer.trainer import NonFiniteLossError, Trainer, TrainerConfig

# --- the loop, on a model small enough to follow by hand ---------------------------------------------------

_BATCHES = [np.full(4, v, np.float32) for v in (1.0, 2.0, np.nan, 3.0, 4.0)]  # batch 2 carries a NaN row


def _loss(model: jax.Array, batch: jax.Array, *, key: Any) -> jax.Array:
    return jnp.mean((batch - model) ** 2)


def _trainer(on_nonfinite_loss: str, log: list[tuple[dict[str, float], int]] | None = None) -> Trainer:
    cfg = TrainerConfig(
        train_batch_size=4,
        num_train_steps=len(_BATCHES),
        compilation_cache_dir=None,
        progress_bar=False,
        on_nonfinite_loss=on_nonfinite_loss,  # type: ignore[arg-type]
    )
    log_fn = None if log is None else (lambda metrics, step: log.append((metrics, step)))
    return Trainer(cfg, optax.adam(0.1), _loss, log_fn=log_fn)


def _feed(batches: list[np.ndarray]) -> Iterator[tuple[int, jax.Array]]:
    return ((i, jnp.asarray(b)) for i, b in enumerate(batches))


def _reference(batches: list[np.ndarray]) -> Any:
    """The state after training on ``batches`` (no bad one among them) with a separate trainer."""
    trainer = _trainer("stop")
    state = trainer.initial_state(lambda key: jnp.zeros(()))
    for batch in batches:
        state, _ = trainer.train_step(state, jnp.asarray(batch))
    return state


def test_skip_drops_the_update_of_a_nan_step_and_counts_it(caplog: pytest.LogCaptureFixture) -> None:
    log: list[tuple[dict[str, float], int]] = []
    trainer = _trainer("skip", log)
    with caplog.at_level(logging.ERROR, logger="ponente.trainer.trainer"):
        state = trainer.train(trainer.initial_state(lambda key: jnp.zeros(())), _feed(_BATCHES))
    assert int(state.step) == len(_BATCHES)  # the bad batch is consumed, not retried
    # parameters and optimizer state equal those of a run that never saw the bad batch (Adam's count included)
    expected = _reference([b for b in _BATCHES if np.isfinite(b).all()])
    assert np.isfinite(float(state.model))
    np.testing.assert_array_equal(np.asarray(state.model), np.asarray(expected.model))
    for got, want in zip(jax.tree_util.tree_leaves(state.opt_state), jax.tree_util.tree_leaves(expected.opt_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert [m["train/skipped_steps"] for m, _ in log] == [0, 0, 1, 1, 1]
    assert trainer.skipped_steps == 1
    assert "step 3: non-finite loss=nan" in caplog.text
    assert "skipped" in caplog.text


def test_stop_raises_naming_the_step_with_the_last_good_state() -> None:
    trainer = _trainer("stop")
    with pytest.raises(NonFiniteLossError, match=r"^step 3: non-finite loss=nan.*state is that of step 2") as info:
        trainer.train(trainer.initial_state(lambda key: jnp.zeros(())), _feed(_BATCHES))
    assert info.value.step == 3
    good = info.value.state
    assert int(good.step) == 2
    expected = _reference(_BATCHES[:2])
    np.testing.assert_array_equal(np.asarray(good.model), np.asarray(expected.model))
    for got, want in zip(jax.tree_util.tree_leaves(good.opt_state), jax.tree_util.tree_leaves(expected.opt_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_config_spellings() -> None:
    assert TrainerConfig().on_nonfinite_loss == "skip"
    assert TrainerConfig(crash_on_nan=True).on_nonfinite_loss == "stop"  # Levanter's key still works
    assert TrainerConfig(crash_on_nan=False).on_nonfinite_loss == "skip"
    assert TrainerConfig().preemption_exit_code == 0
    with pytest.raises(ValueError, match=r"trainer\.on_nonfinite_loss must be 'skip' or 'stop'"):
        TrainerConfig(on_nonfinite_loss="ignore")  # type: ignore[arg-type]


# --- whole runs (train_lm on a tiny GPT-2) -----------------------------------------------------------------

STEPS = 6


def _poisoned_loss(at_calls: set[int]) -> Any:
    """Wrap the LM task's loss: the n-th executed training step (1-based, counted on the host) has a NaN loss."""
    real = LmTask.loss
    calls = {"n": 0}

    def scale() -> np.ndarray:
        calls["n"] += 1
        return np.float32(np.nan if calls["n"] in at_calls else 1.0)

    def poisoned(self: LmTask, model: Any, batch: Any, *, key: Any) -> Any:
        factor = jax.experimental.io_callback(scale, jax.ShapeDtypeStruct((), jnp.float32))
        out = real(self, model, batch, key=key)
        if isinstance(out, tuple):
            return out[0] * jax.lax.stop_gradient(factor), out[1]
        return out * jax.lax.stop_gradient(factor)

    return poisoned


def _overrides(tiny_lm_run_overrides: Any, name: str, steps: int, *extra: str) -> list[str]:
    return [
        *tiny_lm_run_overrides(name, steps),
        "trainer.checkpointer.save_interval=1h",
        "trainer.checkpointer.keep=[{every: 3}]",
        "trainer.progress_bar=false",
        *extra,
    ]


def _steps_logged(overrides: list[str]) -> list[dict[str, Any]]:
    path = next(o.split("path: ", 1)[1].rstrip("}") for o in overrides if o.startswith("trainer.tracker="))
    return [r for r in map(json.loads, Path(path).read_text().splitlines()) if "train/loss" in r]


def _run_dir(overrides: list[str]) -> Path:
    base = next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.checkpointer.base_path="))
    return Path(base) / "tiny"


@pytest.mark.integration
def test_nonfinite_loss_stop_saves_the_last_good_state_and_exits_1(
    tiny_lm_run_overrides: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # an uninterrupted run with the same schedule, keeping a checkpoint at step 4
    reference = _overrides(tiny_lm_run_overrides, "reference", STEPS, "trainer.checkpointer.keep=[{every: 2}]")
    assert train_lm.train(load_config(TrainLmConfig, overrides=reference)).steps == STEPS

    stopped = _overrides(tiny_lm_run_overrides, "stopped", STEPS, "trainer.on_nonfinite_loss=stop")
    monkeypatch.setattr(LmTask, "loss", _poisoned_loss({5}))
    result = train_lm.train(load_config(TrainLmConfig, overrides=stopped))
    assert result.stopped is not None
    assert result.stopped.startswith(f"{NONFINITE_STOP}: step 5: non-finite loss")
    assert result.exit_code == 1
    assert result.steps == 4
    assert result.checkpoint == str(_run_dir(stopped) / "step-4")
    saved = load_checkpoint(load_checkpoint_template(reference), result.checkpoint)
    expected = load_checkpoint(load_checkpoint_template(reference), _run_dir(reference) / "step-4")
    for got, want in zip(jax.tree_util.tree_leaves(saved), jax.tree_util.tree_leaves(expected)):
        if jax.dtypes.issubdtype(getattr(got, "dtype", None), jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert print_result(result) == 1
    assert f"error: stopped: {NONFINITE_STOP}: step 5" in capsys.readouterr().err


def load_checkpoint_template(overrides: list[str]) -> Any:
    """A freshly initialized state of the configured run: the structure to load its checkpoints into."""
    import ponente.namedtensor as hax
    from ponente.trainer.tasks.lm import lm_loss_fn

    cfg = load_config(TrainLmConfig, overrides=overrides)
    tcfg = cfg.trainer
    trainer = Trainer(tcfg, cfg.optimizer.build(tcfg.num_train_steps), lm_loss_fn(0.0, None))
    Vocab = hax.Axis("vocab", data_vocab_size(cfg.data))
    return trainer.initial_state(lambda key: cfg.model.build(Vocab, key=key))


@pytest.mark.integration
def test_nonfinite_loss_skip_runs_every_step_and_logs_the_count(
    tiny_lm_run_overrides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = _overrides(tiny_lm_run_overrides, "skipped", STEPS)
    monkeypatch.setattr(LmTask, "loss", _poisoned_loss({2}))
    result = train_lm.train(load_config(TrainLmConfig, overrides=overrides))
    assert result.stopped is None
    assert result.exit_code == 0
    assert result.steps == STEPS
    logged = _steps_logged(overrides)
    assert [r["train/skipped_steps"] for r in logged] == [0, 1, 1, 1, 1, 1]
    assert np.isnan(logged[1]["train/loss"])
    assert all(np.isfinite(r["train/loss"]) for r in logged[2:])


@pytest.mark.integration
def test_disk_full_during_a_checkpoint_stops_the_run_with_one_line(
    tiny_lm_run_overrides: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = _overrides(tiny_lm_run_overrides, "full", STEPS)
    real = location.write_bytes

    def write_bytes(path: str, key: str, value: bytes) -> None:  # ENOSPC after step 6's arrays are written
        if path.endswith("step-6") and key.startswith("process-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{path}/{key}")
        real(path, key, value)

    monkeypatch.setattr(location, "write_bytes", write_bytes)
    code = train_lm.main(["--config_path", str(write_config(tmp_path / "full", overrides))])
    monkeypatch.undo()
    err = capsys.readouterr().err
    run_dir = _run_dir(overrides)
    assert code == 1
    assert f"error: disk full while writing checkpoint {run_dir / 'step-6'}" in err
    assert "Traceback" not in err
    assert latest_checkpoint_path(run_dir) == str(run_dir / "step-3")
    assert [c.step for c in discover_checkpoints(run_dir)] == [3]  # the partial step-6 is gone


@pytest.mark.integration
@pytest.mark.parametrize("exit_code", [0, 75])
def test_sigterm_checkpoints_and_exits_with_the_configured_status(
    tiny_lm_run_overrides: Any, tmp_path: Path, exit_code: int
) -> None:
    overrides = _overrides(tiny_lm_run_overrides, "sigterm", 200, "trainer.checkpointer.keep=[{every: 1000}]") + (
        [f"trainer.preemption_exit_code={exit_code}"] if exit_code else []
    )
    directory = tmp_path / "sigterm"
    write_config(directory, overrides)
    metrics = directory / "metrics.jsonl"
    with (directory / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ponente.trainer.main.train_lm", "--config_path", "config.yaml"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=directory,
        )
        deadline = time.monotonic() + 240
        while not (metrics.exists() and '"train/loss"' in metrics.read_text()):
            assert proc.poll() is None, (directory / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step was logged"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=240) == exit_code, (directory / "stderr.txt").read_text()[-3000:]
    last = max(r["step"] for r in _steps_logged(overrides))
    assert last < 200
    assert latest_checkpoint_path(_run_dir(overrides)) == str(_run_dir(overrides) / f"step-{last}")
    assert "stopped early: SIGTERM" in (directory / "stderr.txt").read_text()
