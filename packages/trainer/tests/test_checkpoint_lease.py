"""One writer per run: the writer lease on a run's checkpoint folder, and the per-save nonce.

A second process on a run id whose checkpoints a live process writes waits, then stops with one line naming the
holder; a holder killed on this host is taken over at once; a save whose files another writer replaced is not
committed, and a checkpoint whose piece lists come from another save than its ``metadata.json`` does not load.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from ponente.trainer.checkpoint import (
    CheckpointCorruptError,
    CheckpointLeaseError,
    CheckpointWriteError,
    acquire_writer_lease,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
from ponente.trainer.checkpoint._io import snapshot, write_snapshot
from ponente.trainer.main import train_lm


def test_a_live_holder_keeps_the_run_and_the_next_one_gets_it_after_release(tmp_path: Path) -> None:
    first = acquire_writer_lease(tmp_path, seconds=2.0)
    assert first is not None
    try:
        start = time.monotonic()
        with pytest.raises(CheckpointLeaseError, match=r"being written by another process .*trainer\.id") as err:
            acquire_writer_lease(tmp_path, seconds=2.0, wait=1.0)
        assert first.holder in str(err.value)
        assert time.monotonic() - start >= 1.0  # it waited before giving up
        first.check()  # the holder still holds it
    finally:
        first.release()
    second = acquire_writer_lease(tmp_path, seconds=2.0, wait=1.0)
    assert second is not None
    second.release()
    assert acquire_writer_lease(tmp_path, seconds=0) is None  # lease_seconds: 0 turns it off


def test_a_holder_killed_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from ponente.trainer.checkpoint import acquire_writer_lease
        lease = acquire_writer_lease({str(tmp_path)!r}, seconds=600.0)
        print(lease.holder, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    start = time.monotonic()
    lease = acquire_writer_lease(tmp_path, seconds=600.0, wait=5.0)  # a 600 s lease: only a takeover is this fast
    assert lease is not None
    assert time.monotonic() - start < 5.0
    lease.release()


def test_a_run_on_a_busy_run_id_stops_with_one_line(
    tmp_path: Path, tiny_lm_overrides, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [f"--{o}" for o in tiny_lm_overrides(2)] + ["--trainer.checkpointer.lease_seconds=1"]
    other = acquire_writer_lease(tmp_path / "ckpt" / "tiny", seconds=1.0)
    assert other is not None
    try:
        assert train_lm.main(overrides) == 1
    finally:
        other.release()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: trainer.checkpointer:"), last
    assert other.holder in last
    assert not (tmp_path / "ckpt" / "tiny" / "step-2").exists()


def _tree() -> dict[str, object]:
    return {"w": jnp.arange(6.0).reshape(2, 3), "b": np.ones(3, np.float32)}


def test_a_save_whose_files_another_writer_replaced_is_not_committed(tmp_path: Path) -> None:
    target = tmp_path / "step-1"

    def other_writer() -> None:  # runs just before the commit: another save rewrote process 0's piece list
        listing = json.loads((target / "process-0.json").read_text())
        (target / "process-0.json").write_text(json.dumps({**listing, "nonce": "someone-else"}))

    with pytest.raises(CheckpointWriteError, match=r"another writer replaced the files of process\(es\) \[0\]"):
        write_snapshot(snapshot(_tree(), 1), target, guard=other_writer)
    assert read_metadata(str(target)) is None  # not committed


def test_a_checkpoint_mixing_two_saves_does_not_load(tmp_path: Path) -> None:
    path = save_checkpoint(_tree(), tmp_path / "step-1", step=1)
    meta = read_metadata(path)
    assert meta is not None
    assert isinstance(meta["nonce"], str)
    assert meta["format_version"] == 3
    loaded = load_checkpoint(_tree(), path)
    np.testing.assert_array_equal(np.asarray(loaded["w"]), np.arange(6.0).reshape(2, 3))
    pieces = Path(path) / "process-0.json"
    pieces.write_text(json.dumps({**json.loads(pieces.read_text()), "nonce": "another-save"}))
    with pytest.raises(CheckpointCorruptError, match=r"process-0\.json was written by another save"):
        load_checkpoint(_tree(), path)


@pytest.mark.integration
def test_two_processes_on_one_run_id_one_trains_the_other_stops(tmp_path: Path, tiny_lm_overrides) -> None:
    """A slowed writer holds the run; a second process on the same run id exits 1 with one line naming the holder,
    and every committed checkpoint loads (one writer's data)."""
    from conftest import TrainLmProcess, write_config

    from ponente.trainer.checkpoint import discover_checkpoints
    from ponente.trainer.checkpoint._io import SLOW_CHECKPOINT_ENV

    write_config(
        tmp_path,
        [*tiny_lm_overrides(6), "trainer.checkpointer.lease_seconds=3", "trainer.checkpointer.keep=[{every: 2}]"],
    )
    first = TrainLmProcess(tmp_path, 1, env={SLOW_CHECKPOINT_ENV: "8"})
    first.wait_until(lambda: "waiting before the commit" in first.stderr(), "a slowed save")
    second = TrainLmProcess(tmp_path, 2)
    assert second.finish() == 1
    last = second.stderr().strip().splitlines()[-1]
    assert last.startswith("error: trainer.checkpointer:"), last
    assert "another process" in last
    assert first.finish() == 0, first.stderr()[-3000:]
    committed = [c for c in discover_checkpoints(tmp_path / "ckpt" / "tiny") if c.committed]
    assert [c.step for c in committed][-1] == 6
    for checkpoint in committed:
        meta = read_metadata(str(checkpoint.path))
        assert meta is not None
        nonces = {json.loads((Path(checkpoint.path) / "process-0.json").read_text())["nonce"]}
        assert nonces == {meta["nonce"]}
