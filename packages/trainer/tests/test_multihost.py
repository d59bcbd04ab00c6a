"""Two processes on 127.0.0.1 (4 simulated CPU devices each, gloo collectives) train like one 8-device process.

Each run is a subprocess executing ``train_lm.train`` with the tiny configuration of ``conftest.py``; process
0's JSON tracker holds the losses, and ``$PONENTE_RECORD_ROWS`` makes every process record the rows it loaded.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import multiprocess_support as support
import numpy as np
import pytest
from multiprocess_support import finish, free_port, losses, quiet

pytestmark = pytest.mark.integration

WORKER = """
import json, logging, sys

if __name__ == "__main__":
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    from ponente.trainer.config import load_config
    from ponente.trainer.main import train_lm
    from ponente.trainer.main.train_lm import TrainLmConfig

    result = train_lm.train(load_config(TrainLmConfig, overrides=json.loads(sys.argv[1])))
    print("RESULT", json.dumps({"steps": result.steps, "checkpoint": result.checkpoint,
                                "resumed_from": result.resumed_from}), flush=True)
"""


def launch(tmp_path: Path, overrides: list[str], devices: int, record: Path | None = None) -> subprocess.Popen:
    env = {"PONENTE_RECORD_ROWS": str(record)} if record is not None else None
    return support.launch(tmp_path, WORKER, overrides, devices=devices, env=env)


def two_processes(tmp_path: Path, overrides: list[str], record: Path | None = None) -> list[subprocess.Popen]:
    port = free_port()
    return [
        launch(
            tmp_path,
            [
                *overrides,
                f"trainer.distributed.coordinator_address=127.0.0.1:{port}",
                "trainer.distributed.num_processes=2",
                f"trainer.distributed.process_id={i}",
            ],
            devices=4,
            record=record,
        )
        for i in range(2)
    ]


@pytest.fixture
def runs(tiny_lm_run_overrides):
    """``runs(name, steps)``: the overrides of a tiny run under ``tmp_path/name`` (one corpus for all runs)."""

    def overrides(name: str, steps: int) -> list[str]:
        return quiet(tiny_lm_run_overrides(name, steps))

    return overrides


def test_two_processes_train_like_one_load_their_rows_and_resume(tmp_path, runs):
    finish([launch(tmp_path, runs("single", 4), devices=8)], tmp_path)
    reference = losses(tmp_path / "single" / "metrics.jsonl")
    assert sorted(reference) == [1, 2, 3, 4]

    record = tmp_path / "rows"
    finish(two_processes(tmp_path, runs("multi", 4), record), tmp_path)
    multi = losses(tmp_path / "multi" / "metrics.jsonl")
    assert sorted(multi) == [1, 2, 3, 4]
    np.testing.assert_allclose([multi[s] for s in range(1, 5)], [reference[s] for s in range(1, 5)], atol=1e-5)

    # each process loaded only its own rows: the two halves of every global batch of 8
    mine = [[json.loads(line) for line in Path(f"{record}.{i}").read_text().splitlines()] for i in range(2)]
    for i, lines in enumerate(mine):
        assert [r["step"] for r in lines] == [0, 1, 2, 3]
        for r in lines:
            assert r["loaded"] == 4
            assert r["indices"] == list(range(8 * r["step"] + 4 * i, 8 * r["step"] + 4 * i + 4))

    # both processes wrote their part of the final checkpoint; two processes resume from it exactly as one
    # 8-device process resuming from the same checkpoint (same schedule: num_train_steps=6 for both)
    checkpoint = tmp_path / "multi" / "ckpt" / "tiny" / "step-4"
    assert checkpoint.is_dir()
    finish(
        [
            launch(
                tmp_path,
                [
                    *runs("single6", 6),
                    f"trainer.load_checkpoint_path={checkpoint}",
                    "trainer.allow_config_change=true",
                ],
                8,
            )
        ],
        tmp_path,
    )
    finish(two_processes(tmp_path, runs("multi", 6)), tmp_path)
    want = losses(tmp_path / "single6" / "metrics.jsonl")
    resumed = losses(tmp_path / "multi" / "metrics.jsonl")
    assert sorted(want) == [5, 6]
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([resumed[s] for s in (5, 6)], [want[s] for s in (5, 6)], atol=1e-5)
    logs = "".join(f.read_text() for f in tmp_path.glob("log-*"))
    assert logs.count(f'"resumed_from": "{checkpoint}"') == 3, "both processes and the single run should resume"


def test_killing_one_process_ends_the_other_with_an_error(tmp_path, runs):
    procs = two_processes(tmp_path, [*runs("kill", 10_000), "trainer.steps_per_eval=100000"])
    metrics = tmp_path / "kill" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(losses(metrics)) >= 2):
        assert time.monotonic() < deadline, "training did not start"
        assert all(p.poll() is None for p in procs), "a process ended before the kill"
        time.sleep(0.5)
    os.kill(procs[1].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        rc = procs[0].wait(timeout=90)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("the surviving process did not exit within 90 s of its peer's death")
    elapsed = time.monotonic() - killed_at
    assert rc != 0
    assert elapsed < 60, f"the surviving process took {elapsed:.0f} s to exit"
    log = (tmp_path / "log-0.txt").read_text()
    assert "process 0 of 2 failed" in log or "heartbeat" in log, log[-3000:]


def eval_losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r[k] for r in records for k in r if k.startswith("eval/") and k.endswith("/loss")}


def test_two_processes_evaluate_their_rows_and_train_on_a_hybrid_mesh(tmp_path, runs):
    # evaluation batches of 24 (3 per device) differ from the training batches of 8, and the validation set
    # does not fill its last batch: every process must still evaluate the same batches, each its own rows
    evaluate = ["trainer.steps_per_eval=2", "trainer.max_eval_batches=null", "trainer.per_device_eval_parallelism=3"]
    finish([launch(tmp_path, [*runs("single", 4), *evaluate], devices=8)], tmp_path)
    reference, reference_eval = (
        losses(tmp_path / "single" / "metrics.jsonl"),
        eval_losses(tmp_path / "single" / "metrics.jsonl"),
    )
    assert sorted(reference) == [1, 2, 3, 4]
    assert sorted(reference_eval) == [2, 4]

    finish(two_processes(tmp_path, [*runs("multi", 4), *evaluate]), tmp_path)
    multi_eval = eval_losses(tmp_path / "multi" / "metrics.jsonl")
    assert sorted(multi_eval) == [2, 4]
    np.testing.assert_allclose([multi_eval[s] for s in (2, 4)], [reference_eval[s] for s in (2, 4)], atol=1e-5)

    # two process groups along the replica axis (replica 2 x data 4): the same losses as the 8-device run
    finish(two_processes(tmp_path, [*runs("hybrid", 4), *evaluate, "trainer.replica_dcn_axis_size=2"]), tmp_path)
    hybrid = losses(tmp_path / "hybrid" / "metrics.jsonl")
    hybrid_eval = eval_losses(tmp_path / "hybrid" / "metrics.jsonl")
    assert sorted(hybrid) == [1, 2, 3, 4]
    np.testing.assert_allclose([hybrid[s] for s in range(1, 5)], [reference[s] for s in range(1, 5)], atol=1e-5)
    np.testing.assert_allclose([hybrid_eval[s] for s in (2, 4)], [reference_eval[s] for s in (2, 4)], atol=1e-5)
    logs = "".join(f.read_text() for f in tmp_path.glob("log-*"))
    assert "hybrid mesh: 2 process groups along the replica axis" in logs
