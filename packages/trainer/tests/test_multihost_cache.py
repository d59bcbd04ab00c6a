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
import subprocess
from pathlib import Path

import numpy as np
import pytest
from multiprocess_support import finish, free_port, launch, quiet
from multiprocess_support import losses as support_losses

pytestmark = pytest.mark.integration


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


def _launch(tmp_path: Path, name: str, overrides: list[str], devices: int, role: str) -> subprocess.Popen:
    env = {"PONENTE_TEST_ROLE": role, "PONENTE_TEST_FLAG": str(tmp_path / "process-1-read")}
    return launch(tmp_path, WORKER, overrides, devices=devices, env=env, log_name=name)


def test_process_one_reads_the_cache_while_process_zero_builds_it(tmp_path, tiny_lm_run_overrides):
    finish([_launch(tmp_path, "single", quiet(tiny_lm_run_overrides("single", 4)), 8, "single")], tmp_path)
    reference = support_losses(tmp_path / "single" / "metrics.jsonl")
    assert sorted(reference) == [1, 2, 3, 4]

    port = free_port()
    multi = quiet(tiny_lm_run_overrides("multi", 4))
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
    finish(procs, tmp_path)

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

    losses = support_losses(tmp_path / "multi" / "metrics.jsonl")
    assert sorted(losses) == [1, 2, 3, 4]
    np.testing.assert_allclose([losses[s] for s in range(1, 5)], [reference[s] for s in range(1, 5)], atol=1e-5)
