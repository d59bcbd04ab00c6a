"""Damaged checkpoints and a full disk: reported by name, a resume falls back (or refuses), nothing partial loads."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from ponente.trainer.checkpoint import (
    CheckpointCorruptError,
    CheckpointDiskFullError,
    CheckpointerConfig,
    discover_checkpoints,
    latest_checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)
from ponente.trainer.checkpoint import _location as location
from ponente.trainer.run import _restore
from ponente.trainer.trainer import TrainerConfig

_N = 4096  # elements per array: the value pattern below is easy to find in the data files


def _state(value: float, step: int) -> dict[str, Any]:
    return {"w": jnp.full(_N, value, jnp.float32), "b": jnp.full(7, -value, jnp.float32), "step": jnp.asarray(step)}


def _template() -> dict[str, Any]:
    return _state(0.0, 0)


def _assert_state(loaded: dict[str, Any], value: float, step: int) -> None:
    np.testing.assert_array_equal(np.asarray(loaded["w"]), np.full(_N, value, np.float32))
    np.testing.assert_array_equal(np.asarray(loaded["b"]), np.full(7, -value, np.float32))
    assert int(loaded["step"]) == step


def _run_with_two_checkpoints(tmp_path: Path) -> Path:
    """``ckpt/run/step-1`` (w = 1.5) and ``ckpt/run/step-2`` (w = 2.5), both committed."""
    run_dir = tmp_path / "ckpt" / "run"
    for step in (1, 2):
        save_checkpoint(_state(step + 0.5, step), run_dir / f"step-{step}", step=step)
    return run_dir


def _data_files(checkpoint: Path) -> list[Path]:
    files = sorted((checkpoint / "process-0" / "d").iterdir())
    assert files
    return files


def _flip_a_value_byte(checkpoint: Path) -> None:
    """Flip one byte inside the stored values of ``w`` (2.5 as float32, repeated), not in a header or index."""
    pattern = np.full(64, 2.5, np.float32).tobytes()
    for path in _data_files(checkpoint):
        data = bytearray(path.read_bytes())
        at = data.find(pattern)
        if at >= 0:
            data[at + 129] ^= 0x04
            path.write_bytes(bytes(data))
            return
    raise AssertionError("the values of w were not found in the data files (compressed?)")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE: dict[str, Callable[[Path], None]] = {
    "metadata garbage": lambda c: (c / "metadata.json").write_bytes(b"\x00{not json"),
    "metadata truncated": lambda c: _truncate(c / "metadata.json"),
    "piece list deleted": lambda c: (c / "process-0.json").unlink(),
    "data file truncated": lambda c: [_truncate(p) for p in _data_files(c)],
    "data file deleted": lambda c: [p.unlink() for p in _data_files(c)],
    "value byte flipped": _flip_a_value_byte,
}


def _checkpointer_and_config(tmp_path: Path, on_corrupt: str) -> tuple[Any, TrainerConfig]:
    ckpt = CheckpointerConfig(base_path=str(tmp_path / "ckpt"), on_corrupt=on_corrupt)  # type: ignore[arg-type]
    return ckpt.create("run"), TrainerConfig(checkpointer=ckpt)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_reported_by_name(tmp_path: Path, damage: str) -> None:
    run_dir = _run_with_two_checkpoints(tmp_path)
    _assert_state(load_checkpoint(_template(), run_dir / "step-2"), 2.5, 2)
    DAMAGE[damage](run_dir / "step-2")
    with pytest.raises(CheckpointCorruptError, match=rf"checkpoint {run_dir / 'step-2'} is damaged") as info:
        load_checkpoint(_template(), run_dir / "step-2")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_falls_back_to_the_last_readable_checkpoint(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = _run_with_two_checkpoints(tmp_path)
    DAMAGE[damage](run_dir / "step-2")
    checkpointer, tcfg = _checkpointer_and_config(tmp_path, "fallback")
    with caplog.at_level(logging.INFO, logger="ponente.trainer.run"):
        state, source = _restore.restore(_template(), tcfg, checkpointer, {})
    assert source == str(run_dir / "step-1")
    _assert_state(state, 1.5, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"skipping damaged checkpoint {run_dir / 'step-2'}" in w for w in warnings), warnings
    # training on from step 1 saves step 2 again: the damaged one is replaced, not kept
    assert checkpointer.on_step(_state(9.0, 2), 2, force=True)
    checkpointer.close()
    _assert_state(load_checkpoint(_template(), run_dir), 9.0, 2)


@pytest.mark.parametrize("damage", ["metadata garbage", "data file truncated", "value byte flipped"])
def test_resume_refuses_a_damaged_checkpoint_with_on_corrupt_error(tmp_path: Path, damage: str) -> None:
    run_dir = _run_with_two_checkpoints(tmp_path)
    DAMAGE[damage](run_dir / "step-2")
    checkpointer, tcfg = _checkpointer_and_config(tmp_path, "error")
    with pytest.raises(CheckpointCorruptError, match=rf"{run_dir / 'step-2'} is damaged.*on_corrupt is error"):
        _restore.restore(_template(), tcfg, checkpointer, {})


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    run_dir = _run_with_two_checkpoints(tmp_path)
    for step in (1, 2):
        DAMAGE["metadata garbage"](run_dir / f"step-{step}")
    checkpointer, tcfg = _checkpointer_and_config(tmp_path, "fallback")
    with pytest.raises(CheckpointCorruptError, match="every committed checkpoint is damaged"):
        _restore.restore(_template(), tcfg, checkpointer, {})


# --- a full disk ------------------------------------------------------------------------------------------


def _fill_disk_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """The filesystem says ENOSPC when the save of ``step`` writes its piece list, after its arrays."""
    real = location.write_bytes

    def write_bytes(path: str, key: str, value: bytes) -> None:
        if path.endswith(f"step-{step}") and key.startswith("process-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{path}/{key}")
        real(path, key, value)

    monkeypatch.setattr(location, "write_bytes", write_bytes)


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpointer, tcfg = _checkpointer_and_config(tmp_path, "fallback")
    run_dir = Path(checkpointer.run_path)
    assert checkpointer.on_step(_state(1.5, 1), 1, force=True)
    checkpointer.wait_until_finished()
    _fill_disk_at(monkeypatch, 2)
    assert checkpointer.on_step(_state(2.5, 2), 2, force=True)  # the save runs in the background...
    with pytest.raises(CheckpointDiskFullError, match=rf"^disk full while writing checkpoint {run_dir / 'step-2'}"):
        checkpointer.close()  # ...and its failure surfaces at the next step, or here, at the latest
    monkeypatch.undo()
    assert latest_checkpoint_path(run_dir) == str(run_dir / "step-1")
    assert not any(c.step == 2 and c.committed for c in discover_checkpoints(run_dir))
    state, source = _restore.restore(_template(), tcfg, tcfg.checkpointer.create("run"), {})
    assert source == str(run_dir / "step-1")
    _assert_state(state, 1.5, 1)


_REAL_DISK_FULL = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp
    from ponente.trainer.checkpoint import CheckpointDiskFullError, save_checkpoint
    root = sys.argv[1]
    save_checkpoint({"w": jnp.arange(1000.0)}, root + "/run/step-1", step=1)
    try:
        save_checkpoint({"w": jnp.arange(3_000_000.0)}, root + "/run/step-2", step=2)  # 12 MB on a 4 MB disk
    except CheckpointDiskFullError as e:
        print("RAISED", e)
    """
)


def test_disk_full_on_a_real_small_filesystem(tmp_path: Path) -> None:
    """A 4 MB tmpfs (mounted in a private user and mount namespace) fills up inside TensorStore's own writes."""
    if shutil.which("unshare") is None or sys.platform != "linux":
        pytest.skip("needs unshare (Linux) to mount a small tmpfs")
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(_REAL_DISK_FULL)
    command = f"mount -t tmpfs -o size=4m tmpfs {mount} && {sys.executable} {script} {mount} && ls -R {mount}"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mount}"], check=False)
    if probe.returncode != 0:
        pytest.skip("unprivileged user namespaces (unshare -rm) are not available here")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"RAISED disk full while writing checkpoint {mount}/run/step-2" in result.stdout, result.stdout
    listing = result.stdout.split("RAISED", 1)[1]
    assert "step-1:" in listing
    assert "metadata.json" in listing
    assert "step-2:" not in listing  # the partial directory was deleted, giving the space back
