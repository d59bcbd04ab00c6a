"""``build_cache(should_stop=...)``: a build asked to stop commits what it wrote, and a later build resumes it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ponente.datacache import PassthroughProcessor, build_cache, open_cache
from ponente.datacache.builder import BuildStopped


def test_stopped_build_commits_and_resumes_to_the_same_rows(tmp_path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [i, i + 1, i + 2]}) + "\n" for i in range(200)))
    processor = PassthroughProcessor()
    calls = {"n": 0}

    def stop_after_three_batches() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    kwargs = {"processor": processor, "workers": 0, "progress": False, "batch_rows": 10, "commit_interval": 0}
    with pytest.raises(BuildStopped, match="stopped at row 30"):
        build_cache(str(data), tmp_path / "c", should_stop=stop_after_three_batches, **kwargs)
    partial = open_cache(tmp_path / "c")
    assert not partial.is_finished
    assert len(partial) == 30
    resumed = build_cache(str(data), tmp_path / "c", **kwargs)
    reference = build_cache(str(data), tmp_path / "ref", **kwargs)
    assert resumed.is_finished
    assert len(resumed) == len(reference) == 200
    for i in range(200):
        np.testing.assert_array_equal(resumed[i]["input_ids"], reference[i]["input_ids"])
