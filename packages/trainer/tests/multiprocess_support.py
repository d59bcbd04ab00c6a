"""Helpers of the tests that run `train_lm` in subprocesses (two `jax.distributed` processes on 127.0.0.1).

Each run is a subprocess executing a worker script with a JSON list of config overrides; its output goes to
``tmp_path/log-<name>.txt`` so that a failing run shows every process's log.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

WAIT_SECONDS = 600
"""How long a test waits for a run: generous, the machine may be loaded; only a failing run waits this long."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    tmp_path: Path,
    script: str,
    overrides: list[str],
    *,
    devices: int,
    env: Mapping[str, str] | None = None,
    log_name: str | None = None,
) -> subprocess.Popen:
    """Run ``script`` (Python source) with ``overrides`` as its argument on ``devices`` simulated CPU devices."""
    path = tmp_path / "worker.py"
    path.write_text(script)
    environment = os.environ | {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        **(env or {}),
    }
    name = log_name if log_name is not None else str(len(list(tmp_path.glob("log-*"))))
    log = open(tmp_path / f"log-{name}.txt", "w")  # noqa: SIM115 (closed by the OS)
    return subprocess.Popen(
        [sys.executable, str(path), json.dumps(overrides)],
        env=environment,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(procs: list[subprocess.Popen], tmp_path: Path, timeout: float = WAIT_SECONDS) -> None:
    """Wait for every process; kill all on a timeout; fail with every log if one exited non-zero."""
    for p in procs:
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if rc != 0:
            logs = "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp_path.glob("log-*")))
            pytest.fail(f"a training process exited with {rc}:\n{logs}")


def losses(metrics: Path) -> dict[int, float]:
    """``{step: train/loss}`` from a JSON tracker's ``metrics.jsonl``."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def quiet(overrides: list[str]) -> list[str]:
    """``overrides`` plus what every subprocess run uses: no progress bar, in-process tokenizing, no temp saves."""
    return [*overrides, "trainer.progress_bar=false", "data.workers=0", "trainer.checkpointer.save_interval=1000"]
