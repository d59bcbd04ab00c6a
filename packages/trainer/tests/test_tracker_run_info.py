"""Tests for ponente.trainer.tracker.run_info: git SHA, pip freeze, flattened config, run files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.trainer.tracker as trk
from ponente.trainer.versions import ponente_versions


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def git_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "T")
    (repo / "a.txt").write_text("one\n")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-q", "-m", "first")
    return repo


def _head_sha_from_files(repo: Path) -> str:
    """Resolve HEAD by reading .git directly (independent of ``git rev-parse``)."""
    head = (repo / ".git" / "HEAD").read_text().strip()
    assert head.startswith("ref: ")
    return (repo / ".git" / head.removeprefix("ref: ")).read_text().strip()


def test_git_info_in_a_repo_clean_then_dirty(git_repo: Path) -> None:
    sha = _head_sha_from_files(git_repo)
    assert len(sha) == 40
    assert trk.git_info(git_repo) == {"sha": sha, "dirty": False}
    (git_repo / "a.txt").write_text("two\n")
    assert trk.git_info(git_repo) == {"sha": sha, "dirty": True}


def test_git_info_outside_a_repo_and_in_a_repo_without_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    plain = tmp_path / "plain"
    plain.mkdir()
    assert trk.git_info(plain) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    _git(empty, "init", "-q")
    assert trk.git_info(empty) is None
    assert trk.git_info(tmp_path / "does-not-exist") is None


def test_pip_freeze_matches_pip() -> None:
    ours = [line for line in trk.pip_freeze().splitlines() if not line.startswith("#")]
    # pip sees this process's sys.path (imported packages may have extended it, e.g. Ray adds its vendored
    # third-party folder), so both list the same distributions.
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--all"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    theirs = [line for line in pip.splitlines() if not line.startswith("#")]
    assert ours == theirs
    assert any(line.startswith(("ponente-trainer", "-e ")) for line in ours)


_keys = st.text(alphabet="abcxyz_", min_size=1, max_size=4)
_leaves = st.one_of(st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2), st.none())
_trees = st.recursive(
    st.dictionaries(_keys, _leaves, max_size=3),
    lambda sub: st.dictionaries(_keys, sub | _leaves, max_size=3),
    max_leaves=8,
)


def _naive_flatten(tree: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict):
                stack.append((name, value))
            else:
                out[name] = value
    return out


@settings(max_examples=50, deadline=None)
@given(tree=_trees)
def test_flatten_config_matches_a_naive_flatten(tree: dict[str, Any]) -> None:
    assert trk.flatten_config(tree) == _naive_flatten(tree)


def test_log_run_info_logs_hparams_and_writes_run_files(git_repo: Path, tmp_path: Path) -> None:
    config = {"trainer": {"seed": 0, "tags": ("x", "y")}, "optimizer": {"learning_rate": 0.003}}
    tracker = trk.JsonTracker(tmp_path / "logs" / "metrics.jsonl")
    record = trk.log_run_info(tracker, config, run_dir=tmp_path / "run", git_dir=git_repo)
    tracker.finish()

    sha = _head_sha_from_files(git_repo)
    hparams = json.loads((tmp_path / "logs" / "metrics.hparams.json").read_text())
    assert hparams["trainer.seed"] == 0
    assert hparams["trainer.tags"] == ["x", "y"]
    assert hparams["optimizer.learning_rate"] == 0.003
    assert hparams["run_info.git_sha"] == sha
    assert hparams["run_info.git_dirty"] is False
    assert hparams["run_info.versions.ponente-trainer"] == ponente_versions()["ponente-trainer"]

    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text()) == {
        "trainer": {"seed": 0, "tags": ["x", "y"]},
        "optimizer": {"learning_rate": 0.003},
    }
    assert (run / "git.txt").read_text() == f"sha: {sha}\ndirty: false\n"
    assert (run / "pip_freeze.txt").read_text() == trk.pip_freeze()
    assert json.loads((run / "versions.json").read_text())["ponente-trainer"] == ponente_versions()["ponente-trainer"]
    artifacts = [json.loads(line) for line in (tmp_path / "logs" / "metrics.artifacts.jsonl").read_text().splitlines()]
    assert [(a["name"], a["type"]) for a in artifacts] == [
        ("config.yaml", "config"),
        ("pip_freeze.txt", "requirements"),
        ("git.txt", "git"),
        ("versions.json", "versions"),
    ]
    assert record["git"] == {"sha": sha, "dirty": False}
    assert record["files"]["git.txt"] == str(run / "git.txt")


def test_log_run_info_outside_git_records_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    tracker = trk.JsonTracker(tmp_path / "m.jsonl")
    record = trk.log_run_info(tracker, {"a": 1}, run_dir=tmp_path / "run", git_dir=tmp_path)
    tracker.finish()
    assert record["git"] is None
    hparams = json.loads((tmp_path / "m.hparams.json").read_text())
    assert hparams["run_info.git_sha"] is None
    assert hparams["run_info.git_dirty"] is None
    assert (tmp_path / "run" / "git.txt").read_text() == "sha: unknown\n"


def test_log_run_info_rejects_a_non_mapping_config(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="expects the config as a mapping"):
        trk.log_run_info(trk.NoopTracker(), [("a", 1)])  # type: ignore[arg-type]


def test_run_record_files_are_written_whole_even_with_two_writers(tmp_path: Path) -> None:
    """``write_text_atomic``: with two writers racing and a reader, the file is always one writer's whole text;
    no temporary file is left behind."""
    import threading

    from ponente.trainer.tracker import write_text_atomic

    path = tmp_path / "config.yaml"
    texts = ["a" * 300_000, "b" * 200_000]
    write_text_atomic(path, texts[0])
    seen: set[str] = set()
    stop = threading.Event()

    def writer(text: str) -> None:
        for _ in range(40):
            write_text_atomic(path, text)

    def reader() -> None:
        while not stop.is_set():
            seen.add(path.read_text())

    threads = [threading.Thread(target=writer, args=(t,)) for t in texts]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert seen <= set(texts), sorted(len(s) for s in seen)
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]
