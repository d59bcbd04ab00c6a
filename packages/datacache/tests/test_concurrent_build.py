"""Several processes asked to build one cache: one builds, the others wait and read; a killed builder's work is
taken over and resumed.

Each builder is a subprocess (``sys.executable``) running :data:`SCRIPT`: ``build_cache`` with a pre-tokenized
corpus and a processor that sleeps a little per batch (so the builds overlap) and logs which rows it processed.
Row ``n`` of the corpus starts with the token ``n``, so the logs say which process processed which row. The
reference is a single-process build of the same corpus: every row, and (locally) every byte, must match it.

To see what the lease protects against, run this file with ``PONENTE_TEST_NO_LEASE=1``: the builders then run
without it (every process builds) and the tests fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from s3_support import S3Bucket, s3_bucket_fixture  # noqa: F401  (the s3_bucket fixture)

from ponente.datacache import PassthroughProcessor, build_cache, open_cache
from ponente.datacache.lease import LEASE_KEY, read_lease

SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys, time

    import numpy as np

    from ponente.datacache import PassthroughProcessor, build_cache

    args = json.loads(sys.argv[1])


    class SlowLoggingProcessor(PassthroughProcessor):
        # Same config (so the same fingerprint) as PassthroughProcessor: only slower, and it logs its rows.
        def __call__(self, records):
            with open(args["log"], "a", encoding="utf-8") as log:
                log.write(json.dumps([os.getpid(), [int(r["input_ids"][0]) for r in records]]) + "\\n")
            time.sleep(args["delay"])
            return super().__call__(records)


    if os.environ.get("PONENTE_TEST_NO_LEASE") == "1":  # demonstration: builders without the lease
        import ponente.datacache.builder as builder

        class NoLease:
            def __init__(self, location, seconds, heartbeat):
                self.heartbeat = 0.1
                self.other = None

            def try_acquire(self):
                return True

            def check(self):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

        builder.BuilderLease = NoLease

    logging.basicConfig(level=logging.INFO, format="%(process)d %(message)s")
    print("started", flush=True)
    build_cache(
        args["inputs"],
        args["output"],
        processor=SlowLoggingProcessor(),
        workers=0,
        progress=False,
        batch_rows=args["batch_rows"],
        commit_interval=0.0,
        lease_seconds=args["lease_seconds"],
        lease_heartbeat=args["lease_seconds"] / 4,
    )
    """
)

ROWS = 96
BATCH_ROWS = 4
LEASE_SECONDS = 2.0


@pytest.fixture
def corpus(tmp_path: Path) -> list[str]:
    """Three jsonl shards of pre-tokenized rows; row ``n`` is ``[n, n + 1, ...]`` of 1 to 9 tokens."""
    paths = []
    for shard in range(3):
        path = tmp_path / "in" / f"part{shard}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = range(shard * ROWS // 3, (shard + 1) * ROWS // 3)
        path.write_text("".join(json.dumps({"input_ids": list(range(n, n + 1 + n % 9))}) + "\n" for n in rows))
        paths.append(str(path))
    return paths


def _reference(corpus: list[str], location: Path) -> list[list[int]]:
    build_cache(corpus, location, processor=PassthroughProcessor(), workers=0, progress=False)
    return _rows(str(location))


def _rows(location: str) -> list[list[int]]:
    cache = open_cache(location)
    assert cache.is_finished
    return [row["input_ids"].tolist() for row in cache.get_batch(range(len(cache)))]


def _start(tmp_path: Path, corpus: list[str], output: str, log: Path, *, delay: float = 0.1) -> subprocess.Popen[str]:
    script = tmp_path / "builder.py"
    script.write_text(SCRIPT)
    args = {
        "inputs": corpus,
        "output": output,
        "log": str(log),
        "delay": delay,
        "batch_rows": BATCH_ROWS,
        "lease_seconds": LEASE_SECONDS,
    }
    return subprocess.Popen(
        [sys.executable, str(script), json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def _processed(log: Path) -> dict[int, list[int]]:
    """``{pid: rows it processed, in order}`` from a builder log."""
    out: dict[int, list[int]] = {}
    for line in log.read_text().splitlines():
        pid, rows = json.loads(line)
        out.setdefault(pid, []).extend(rows)
    return out


def _finish(process: subprocess.Popen[str], timeout: float = 120) -> str:
    try:
        _, err = process.communicate(timeout=timeout)
    finally:
        process.kill()
    assert process.returncode == 0, err
    return err


def _two_builders(tmp_path: Path, corpus: list[str], output: str) -> tuple[dict[int, list[int]], list[str]]:
    """Start two builders of ``output`` together; return who processed which rows, and their stderr."""
    log = tmp_path / "processed.jsonl"
    processes = [_start(tmp_path, corpus, output, log) for _ in range(2)]
    for process in processes:  # both are running before either can have got far
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "started"
    errors = [_finish(process) for process in processes]
    return _processed(log), errors


def test_two_builders_started_together_agree_on_one(tmp_path: Path, corpus: list[str], helpers: type) -> None:
    expected = _reference(corpus, tmp_path / "reference")
    output = tmp_path / "shared"
    processed, errors = _two_builders(tmp_path, corpus, str(output))

    assert len(processed) == 1, f"more than one process built the cache: {sorted(processed)}"
    (rows,) = processed.values()
    assert rows == list(range(ROWS))  # each row processed once, in order: none duplicated, none lost
    assert sum("is being built by" in err for err in errors) == 1  # the other one waited
    assert _rows(str(output)) == expected
    assert helpers.tree_digest(output) == helpers.tree_digest(tmp_path / "reference")  # ledger included, no lease
    assert read_lease(str(output)) is None


def test_kill_9_of_the_builder_the_waiter_takes_over_and_resumes(
    tmp_path: Path, corpus: list[str], helpers: type
) -> None:
    expected = _reference(corpus, tmp_path / "reference")
    output = tmp_path / "shared"
    log = tmp_path / "processed.jsonl"
    first = _start(tmp_path, corpus, str(output), log)
    try:
        deadline = time.monotonic() + 60
        while read_lease(str(output)) is None or not (output / "ledger.json").exists():
            assert first.poll() is None, "the first builder exited early"
            assert time.monotonic() < deadline, "the first builder did not start"
            time.sleep(0.02)
        holder = read_lease(str(output))
        assert holder is not None
        assert f"/{first.pid}/" in holder.holder
        second = _start(tmp_path, corpus, str(output), log, delay=0.01)
        cache = open_cache(str(output))
        assert cache.wait_until(rows=ROWS // 3, timeout=60)
        first.send_signal(signal.SIGKILL)
        first.wait()
        committed = len(cache)
        assert ROWS // 3 <= committed < ROWS, "the first builder finished before it could be killed"
        err = _finish(second)
    finally:
        first.kill()
    assert "expired without renewal: taking over" in err

    processed = _processed(log)
    assert set(processed) == {first.pid, second.pid}
    # The second resumed from the first's last commit: it redid nothing committed and left nothing out.
    assert processed[second.pid] == list(range(committed, ROWS))
    assert processed[first.pid][:committed] == list(range(committed))
    assert _rows(str(output)) == expected
    assert helpers.tree_digest(output) == helpers.tree_digest(tmp_path / "reference")


def test_a_waiting_process_reads_the_growing_cache_and_returns_it_finished(tmp_path: Path, corpus: list[str]) -> None:
    expected = _reference(corpus, tmp_path / "reference")
    output = str(tmp_path / "shared")
    log = tmp_path / "processed.jsonl"
    builder = _start(tmp_path, corpus, output, log)
    try:
        while read_lease(output) is None or not os.path.exists(os.path.join(output, "ledger.json")):
            assert builder.poll() is None, "the builder exited early"
            time.sleep(0.02)
        returned: list[object] = []
        waiter = threading.Thread(
            target=lambda: returned.append(
                build_cache(
                    corpus, output, processor=PassthroughProcessor(), workers=0, progress=False, lease_seconds=2
                )
            )
        )
        waiter.start()
        cache = open_cache(output)
        assert cache.wait_until(rows=8, timeout=60)
        growing = len(cache)
        assert not cache.is_finished
        assert waiter.is_alive()
        assert [cache[i]["input_ids"].tolist() for i in range(growing)] == expected[:growing]
        waiter.join(timeout=120)
        assert not waiter.is_alive()
        _finish(builder)
    finally:
        builder.kill()
    assert len(_processed(log)) == 1  # only the subprocess processed rows: this process only waited
    (cache_returned,) = returned
    assert isinstance(cache_returned, type(cache))
    assert cache_returned.is_finished
    assert _rows(output) == expected


@pytest.mark.integration
def test_two_builders_started_together_on_s3(
    tmp_path: Path,
    corpus: list[str],
    s3_bucket: S3Bucket,
) -> None:
    expected = _reference(corpus, tmp_path / "reference")
    output = s3_bucket.url("caches/shared")
    processed, errors = _two_builders(tmp_path, corpus, output)

    assert len(processed) == 1, f"more than one process built the cache: {sorted(processed)}"
    (rows,) = processed.values()
    assert rows == list(range(ROWS))
    assert sum("is being built by" in err for err in errors) == 1
    assert _rows(output) == expected
    assert f"caches/shared/{LEASE_KEY}" not in s3_bucket.keys("caches/shared/")
