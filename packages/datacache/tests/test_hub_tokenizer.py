"""``load_tokenizer`` with Hub ids: offline-first from a fake Hugging Face cache under a temporary HF_HOME.

``HF_ENDPOINT`` points at a closed port and every socket connection is recorded, so a lookup that asks the network
before the cache is caught even though huggingface_hub would then fall back to the cache.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ponente.datacache import load_tokenizer

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """An empty Hub cache under ``tmp_path/hf`` (HF_HOME), online mode, an unreachable endpoint, connections logged."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    connects: list[Any] = []
    original = socket.socket.connect

    def logged(self: socket.socket, address: Any) -> Any:
        connects.append(address)
        return original(self, address)

    monkeypatch.setattr(socket.socket, "connect", logged)
    return {"cache": tmp_path / "hf" / "hub", "connects": connects}


def _tokenizer(words: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*words, "[UNK]"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _add_snapshot(cache: Path, repo_id: str, commit: str, tok: Tokenizer, refs: tuple[str, ...]) -> None:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "snapshots" / commit).mkdir(parents=True)
    tok.save(str(repo / "snapshots" / commit / "tokenizer.json"))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)


def test_cached_tokenizer_loads_without_network_and_revision_picks_it(hub: dict[str, Any]) -> None:
    _add_snapshot(hub["cache"], "org/tok", COMMIT_A, _tokenizer(["hello", "world"]), refs=("main",))
    _add_snapshot(hub["cache"], "org/tok", COMMIT_B, _tokenizer(["world", "hello"]), refs=("v1",))
    start = time.perf_counter()
    assert load_tokenizer("org/tok").encode("hello world").ids == [0, 1]
    assert time.perf_counter() - start < 2.0
    assert load_tokenizer("org/tok@v1").encode("hello world").ids == [1, 0]
    assert load_tokenizer(f"org/tok@{COMMIT_A}").encode("hello world").ids == [0, 1]
    assert hub["connects"] == []  # online mode, yet the cache answered first


def test_hf_hub_cache_is_honoured(hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    _add_snapshot(other, "org/tok", COMMIT_A, _tokenizer(["a", "b"]), refs=("main",))
    assert load_tokenizer("org/tok").encode("b a").ids == [1, 0]
    assert hub["connects"] == []


def test_offline_uncached_tokenizer_is_one_quick_line(
    hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: Any
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with caplog.at_level(logging.DEBUG), pytest.raises(FileNotFoundError) as info:
        load_tokenizer("org/missing@v3")
    assert time.perf_counter() - start < 2.0
    message = str(info.value)
    assert "\n" not in message
    assert "'org/missing' (revision v3)" in message
    assert "HF_HUB_OFFLINE" in message
    assert hub["connects"] == []
    assert [r for r in caplog.records if r.name.startswith("huggingface_hub") and r.levelno >= logging.WARNING] == []
    assert capfd.readouterr().err == ""


def test_online_uncached_tokenizer_with_unreachable_hub_is_one_line(hub: dict[str, Any]) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer("org/missing")
    message = str(info.value)
    assert "\n" not in message
    assert "could not be fetched" in message
    assert "'org/missing'" in message
    assert hub["connects"]  # online and not cached: the Hub was asked


def test_missing_path_is_not_taken_for_a_hub_id(hub: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no such file or directory"):
        load_tokenizer(tmp_path / "nope" / "tokenizer.json")
    assert hub["connects"] == []
