"""The trackers' resume hook: ``Tracker.resume_from(step)`` drops what a killed run logged after its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.trainer.tracker as trk


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.one_of(st.none(), st.integers(0, 20)), max_size=12),
    resume=st.integers(0, 20),
)
def test_json_resume_from_keeps_exactly_the_records_up_to_the_step(
    tmp_path_factory: pytest.TempPathFactory, steps: list[int | None], resume: int
) -> None:
    path = tmp_path_factory.mktemp("json") / "metrics.jsonl"
    tracker = trk.JsonTracker(path)
    for i, step in enumerate(steps):
        tracker.log({"i": i}, step=step)
    tracker.resume_from(resume)
    tracker.log({"i": -1}, step=resume + 1)
    tracker.finish()
    got = [json.loads(line) for line in path.read_text().splitlines()]
    expected = [{"step": s, "i": i} for i, s in enumerate(steps) if s is None or s <= resume]
    assert got == [*expected, {"step": resume + 1, "i": -1}]


def test_json_resume_from_drops_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n{"step": 3, "lo')
    tracker = trk.JsonTracker(path)
    tracker.resume_from(2)
    tracker.finish()
    assert path.read_text() == '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n'


def test_composite_forwards_resume_from_and_other_trackers_ignore_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    tracker = trk.CompositeTracker([trk.JsonTracker(a), trk.NoopTracker(), trk.JsonTracker(b)])
    for step in (1, 2, 3):
        tracker.log({"x": step}, step=step)
    tracker.resume_from(1)
    tracker.finish()
    for path in (a, b):
        assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
