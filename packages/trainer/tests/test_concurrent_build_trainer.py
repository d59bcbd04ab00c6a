"""Training from a cache that another process is building: the trainer's background build of a cache whose
builder lease another process holds returns the growing cache at once, and it grows to the full cache.

The other process is a subprocess (``sys.executable``) running ``build_cache`` slowly on a pre-tokenized corpus
whose row ``n`` starts with the token ``n``; its processor logs which rows it processed, so the test can check
that this process only read (it never built). The reference is a single-process build of the same corpus.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ponente.datacache import PassthroughProcessor, build_cache, open_cache
from ponente.datacache.lease import read_lease
from ponente.trainer.data.cache_build import build_in_background

SCRIPT = textwrap.dedent(
    """
    import json, sys, time

    from ponente.datacache import PassthroughProcessor, build_cache

    inputs, output, log = json.loads(sys.argv[1])


    class Slow(PassthroughProcessor):  # the same fingerprint as PassthroughProcessor
        def __call__(self, records):
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps([int(r["input_ids"][0]) for r in records]) + "\\n")
            time.sleep(0.1)
            return super().__call__(records)


    build_cache(inputs, output, processor=Slow(), workers=0, progress=False, batch_rows=4, commit_interval=0.0,
                lease_seconds=2.0)
    """
)

ROWS = 64


class _Counting(PassthroughProcessor):
    """PassthroughProcessor (the same fingerprint) that counts the rows it processes in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.processed = 0

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, list[np.ndarray]]:
        self.processed += len(records)
        return super().__call__(records)


def _rows(location: str) -> list[list[int]]:
    cache = open_cache(location)
    return [row["input_ids"].tolist() for row in cache.get_batch(range(len(cache)))]


def test_training_reads_a_cache_another_process_builds(tmp_path: Path) -> None:
    inputs = []
    for shard in range(2):
        path = tmp_path / f"part{shard}.jsonl"
        rows = range(shard * ROWS // 2, (shard + 1) * ROWS // 2)
        path.write_text("".join(json.dumps({"input_ids": list(range(n, n + 2 + n % 5))}) + "\n" for n in rows))
        inputs.append(str(path))
    build_cache(inputs, tmp_path / "reference", processor=PassthroughProcessor(), workers=0, progress=False)
    expected = _rows(str(tmp_path / "reference"))

    output = str(tmp_path / "shared")
    log = tmp_path / "processed.jsonl"
    script = tmp_path / "builder.py"
    script.write_text(SCRIPT)
    other = subprocess.Popen(
        [sys.executable, str(script), json.dumps([inputs, output, str(log)])], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while read_lease(output) is None:
            assert other.poll() is None, "the other builder exited early"
            assert time.monotonic() < deadline, "the other builder did not start"
            time.sleep(0.02)
        here = _Counting()
        cache = build_in_background(
            output, inputs=inputs, processor=here, workers=0, progress=False, lease_seconds=2.0
        )
        assert 0 < len(cache) < ROWS
        assert not cache.is_finished
        first = len(cache)
        assert [cache[i]["input_ids"].tolist() for i in range(first)] == expected[:first]
        assert cache.wait_until(timeout=120)
        _, err = other.communicate(timeout=60)
        assert other.returncode == 0, err
    finally:
        other.kill()
    assert cache.is_finished
    assert len(cache) == ROWS
    assert [cache[i]["input_ids"].tolist() for i in range(ROWS)] == expected
    processed = [row for line in log.read_text().splitlines() for row in json.loads(line)]
    assert processed == list(range(ROWS))  # the other process processed every row once
    assert here.processed == 0  # this one only read
