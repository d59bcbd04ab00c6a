"""Two processes on 127.0.0.1 train while process 0 is still building the token cache that process 1 reads.

Each run is a subprocess executing ``train_lm.train`` with the tiny configuration of ``conftest.py``. The
worker script patches the datacache store in two ways that make the test independent of timing:

- process 0 (the builder) may commit the first rows of the training cache, but any later commit of it waits
  until process 1 has read training data: the build cannot finish before process 1 reads;
- process 1 (the follower) records the state of the cache at its first read of training data (which must be
  unfinished), and fails if it ever opens a cache for writing.

The cache is built in batches of two documents committed at once, so it grows in many steps (the bytes of
a cache do not depend on how it is batched). The losses must equal those of one 8-device process.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration

WAIT = 600  # seconds: generous, the machine may be loaded; only a failing run waits this long

WORKER = """
import functools, json, logging, os, sys, time
from pathlib import Path

if __name__ == "__main__":
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    from ponente.datacache import store
    from ponente.trainer.config import load_config
    from ponente.trainer.data import cache_build
    from ponente.trainer.main import train_lm
    from ponente.trainer.main.train_lm import TrainLmConfig

    role, flag = os.environ["PONENTE_TEST_ROLE"], Path(os.environ["PONENTE_TEST_FLAG"])
    cache_build.build_cache = functools.partial(cache_build.build_cache, batch_rows=2, commit_interval=0)
    if role == "builder":
        commit = store.StoreWriter.commit

        def gated_commit(self, ledger):
            if self.location.endswith("/train") and ledger.rows > 2:
                deadline = time.monotonic() + 500
                while not flag.exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError("process 1 never read the training cache")
                    time.sleep(0.05)
            commit(self, ledger)

        store.StoreWriter.commit = gated_commit
    elif role == "follower":
        def no_writer(self, location, *args, **kwargs):
            raise RuntimeError(f"process 1 opened the cache at {location} for writing")

        store.StoreWriter.__init__ = no_writer
        read_flat = store.CacheDataset.read_flat

        def recording_read_flat(self, *args, **kwargs):
            if self.location.endswith("/train") and not flag.exists():
                ledger = self.ledger
                record = {"finished": ledger.finished, "rows": ledger.rows}
                flag.with_suffix(".json").write_text(json.dumps(record))
                flag.touch()
            return read_flat(self, *args, **kwargs)

        store.CacheDataset.read_flat = recording_read_flat

    result = train_lm.train(load_config(TrainLmConfig, overrides=json.loads(sys.argv[1])))
    print("RESULT", json.dumps({"steps": result.steps}), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, name: str, overrides: list[str], devices: int, role: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = os.environ | {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "PONENTE_TEST_ROLE": role,
        "PONENTE_TEST_FLAG": str(tmp_path / "process-1-read"),
    }
    log = open(tmp_path / f"log-{name}.txt", "w")  # noqa: SIM115 (closed by the OS)
    return subprocess.Popen(
        [sys.executable, str(script), json.dumps(overrides)], env=env, stdout=log, stderr=subprocess.STDOUT, text=True
    )


def _finish(procs: list[subprocess.Popen], tmp_path: Path) -> None:
    for p in procs:
        try:
            rc = p.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if rc != 0:
            logs = "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp_path.glob("log-*")))
            pytest.fail(f"a training process exited with {rc}:\n{logs}")


def _losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _overrides(make, name: str, steps: int) -> list[str]:
    return [
        *make(name, steps),
        "trainer.progress_bar=false",
        "data.workers=0",
        "trainer.checkpointer.save_interval=1000",
    ]


def test_process_one_reads_the_cache_while_process_zero_builds_it(tmp_path, tiny_lm_run_overrides):
    _finish([_launch(tmp_path, "single", _overrides(tiny_lm_run_overrides, "single", 4), 8, "single")], tmp_path)
    reference = _losses(tmp_path / "single" / "metrics.jsonl")
    assert sorted(reference) == [1, 2, 3, 4]

    port = _free_port()
    multi = _overrides(tiny_lm_run_overrides, "multi", 4)
    procs = [
        _launch(
            tmp_path,
            f"multi-{i}",
            [
                *multi,
                f"trainer.distributed.coordinator_address=127.0.0.1:{port}",
                "trainer.distributed.num_processes=2",
                f"trainer.distributed.process_id={i}",
            ],
            4,
            "builder" if i == 0 else "follower",
        )
        for i in range(2)
    ]
    _finish(procs, tmp_path)

    # process 1's first read of training data found an unfinished cache with only the first batch committed
    first_read = json.loads((tmp_path / "process-1-read.json").read_text())
    assert first_read == {"finished": False, "rows": 2}
    # the cache process 0 finished holds every document (27 training documents of the tiny corpus)
    train_cache = tmp_path / "multi" / "cache" / "default" / "train"
    ledger = json.loads((train_cache / "ledger.json").read_text())
    assert ledger["finished"]
    assert ledger["rows"] == 27
    # process 1 followed both caches (and, by the worker's patch, never opened one for writing); 0 followed none
    follower_log = (tmp_path / "log-multi-1.txt").read_text()
    assert f"following the cache at {train_cache} that another process builds" in follower_log
    assert f"following the cache at {train_cache.parent / 'validation'} that" in follower_log
    assert "following the cache at" not in (tmp_path / "log-multi-0.txt").read_text()

    losses = _losses(tmp_path / "multi" / "metrics.jsonl")
    assert sorted(losses) == [1, 2, 3, 4]
    np.testing.assert_allclose([losses[s] for s in range(1, 5)], [reference[s] for s in range(1, 5)], atol=1e-5)
