"""Tests of follower mode (`follow_cache_builds`): a process reads the cache that another process builds.

The "other process" is a builder thread calling ``ponente.datacache.build_cache`` directly with a processor
that stops after a few batches until the test releases it, so the follower provably sees an unfinished cache.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from ponente.datacache import BatchProcessor, CacheDataset, build_cache
from ponente.trainer.data import (
    DEFAULT_FOLLOW_TIMEOUT,
    FollowMode,
    LMDatasetConfig,
    LMMixtureDatasetConfig,
    build_caches,
    data_processor,
    follow_cache_builds,
    resolve_url,
    train_set,
    validation_sets,
)
from ponente.trainer.data.cache_build import open_or_build

TOKENIZER = "package://ponente.trainer.assets/shakespeare_tokenizer.json"
EOS = "<|endoftext|>"
WORDS = ["the", "king", "queen", "sword", "crown", "night", "love", "death", "fool", "ghost", "castle", "sea"]
WAIT = 120.0  # generous: the machine may be loaded; only a failing test ever waits this long


@pytest.fixture(autouse=True)
def builder_mode() -> Iterator[None]:
    """Every test starts as a builder and leaves the process's mode as it found it."""
    previous = follow_cache_builds(False)
    yield
    follow_cache_builds(previous.enabled, timeout=previous.timeout)


def _documents(seed: int, count: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), int(rng.integers(3, 30)))) for _ in range(count)
    ]


def _write_jsonl(path: Path, docs: Sequence[str]) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def _reference_tokens(docs: Sequence[str]) -> list[list[int]]:
    """The tokenizer applied to each document directly, EOS appended (what every cache row must hold)."""
    tok = Tokenizer.from_file(resolve_url(TOKENIZER))
    eos = tok.token_to_id(EOS)
    return [[*tok.encode(d, add_special_tokens=False).ids, eos] for d in docs]


class _Paused:
    """A processor that delegates to ``inner`` but, from call ``after`` on, first waits for ``release``."""

    def __init__(self, inner: BatchProcessor, after: int) -> None:
        self.inner = inner
        self.after = after
        self.calls = 0
        self.release = threading.Event()

    @property
    def fields(self) -> Mapping[str, str]:
        return self.inner.fields

    def config(self) -> dict[str, Any]:
        return self.inner.config()

    def check(self, record: Mapping[str, Any]) -> tuple[str, str] | None:
        return self.inner.check(record)

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, list[np.ndarray]]:
        self.calls += 1
        if self.calls > self.after and not self.release.wait(WAIT):
            raise TimeoutError("the test never released the paused builder")
        return self.inner(records)


class _Builder:
    """``build_cache`` in a thread ("process 0"), paused after ``after`` batches of ``batch_rows`` documents."""

    def __init__(self, inputs: list[str], location: str, processor: BatchProcessor, *, after: int = 2) -> None:
        self.processor = _Paused(processor, after)
        self.error: BaseException | None = None
        self.location = location
        self.thread = threading.Thread(target=self._run, args=(inputs,), daemon=True)
        self.thread.start()

    def _run(self, inputs: list[str]) -> None:
        try:
            build_cache(
                inputs,
                self.location,
                processor=self.processor,
                workers=0,
                batch_rows=2,
                commit_interval=0,
                progress=False,
            )
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> None:
        self.processor.release.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the builder did not finish"
        if self.error is not None:
            raise self.error


def _config(tmp_path: Path, docs: Sequence[str]) -> LMDatasetConfig:
    url = _write_jsonl(tmp_path / "train.jsonl", docs)
    return LMDatasetConfig(train_urls=[url], tokenizer=TOKENIZER, cache_dir=str(tmp_path / "cache"), workers=0)


def _rows(cache: CacheDataset, count: int | None = None) -> list[list[int]]:
    return [cache[i]["input_ids"].tolist() for i in range(len(cache) if count is None else count)]


def test_follower_reads_the_cache_while_another_thread_builds_it(tmp_path: Path) -> None:
    docs = _documents(1, 15)
    cfg = _config(tmp_path, docs)
    location = str(tmp_path / "cache" / "c")
    builder = _Builder(cfg.train_urls, location, data_processor(cfg))
    follow_cache_builds(timeout=WAIT)
    try:
        cache = open_or_build(location, background=True, inputs=cfg.train_urls, processor=data_processor(cfg))
        # the builder is paused after two batches of two documents: the cache cannot be finished
        assert not cache.is_finished
        committed = len(cache)  # may still grow up to the pause: read it once
        assert 0 < committed <= 4 < len(docs)
        assert _rows(cache, committed) == _reference_tokens(docs)[:committed]
    finally:
        builder.finish()
    assert cache.wait_until(rows=None, timeout=WAIT)
    assert cache.is_finished
    assert _rows(cache) == _reference_tokens(docs)


def test_follower_asked_for_a_finished_cache_waits_for_the_end_of_the_build(tmp_path: Path) -> None:
    docs = _documents(2, 9)
    cfg = _config(tmp_path, docs)
    location = str(tmp_path / "cache" / "c")
    builder = _Builder(cfg.train_urls, location, data_processor(cfg), after=1)
    follow_cache_builds(timeout=WAIT)
    result: dict[str, Any] = {}

    def follow() -> None:
        try:
            result["cache"] = open_or_build(location, background=False, inputs=cfg.train_urls)
        except BaseException as exc:
            result["error"] = exc

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    try:
        follower.join(1.0)
        assert follower.is_alive(), f"returned before the paused build could finish: {result}"
    finally:
        builder.finish()
    follower.join(WAIT)
    assert "error" not in result, result.get("error")
    cache = result["cache"]
    assert cache.is_finished
    assert _rows(cache) == _reference_tokens(docs)


def test_follower_opens_a_finished_cache_at_once(tmp_path: Path) -> None:
    docs = _documents(3, 5)
    cfg = _config(tmp_path, docs)
    location = str(tmp_path / "cache" / "c")
    build_cache(cfg.train_urls, location, processor=data_processor(cfg), workers=0, progress=False)
    follow_cache_builds(timeout=0)
    for background in (True, False):
        cache = open_or_build(location, background=background)
        assert cache.is_finished
        assert _rows(cache) == _reference_tokens(docs)


def test_follower_times_out_naming_the_location_and_writes_nothing(tmp_path: Path) -> None:
    location = str(tmp_path / "nobody" / "builds" / "this")
    cfg = _config(tmp_path, _documents(4, 3))
    follow_cache_builds(timeout=0.3)
    with pytest.raises(TimeoutError, match=re.escape(repr(location))) as info:
        open_or_build(location, background=True, inputs=cfg.train_urls, processor=data_processor(cfg))
    assert "process 0" in str(info.value)
    assert not (tmp_path / "nobody").exists()
    with pytest.raises(TimeoutError, match="process 0"):
        build_caches(cfg, "train")  # through the data config: no build either
    assert not (tmp_path / "cache").exists()


def test_train_set_in_follower_mode_reads_the_cache_process_zero_builds(tmp_path: Path) -> None:
    docs = _documents(5, 14)
    cfg = _config(tmp_path, docs)
    seq_len = 8
    builder = _Builder(cfg.train_urls, cfg.cache_path("train"), data_processor(cfg))
    follow_cache_builds(timeout=WAIT)
    flat = [t for doc in _reference_tokens(docs) for t in doc]
    final = len(flat) // seq_len
    try:
        windows = train_set(cfg, seq_len, seed=0)
        assert not windows.is_finished
        assert len(windows) < final
    finally:
        builder.finish()
    assert windows.wait_for_length(None, timeout=WAIT)
    assert len(windows) == final
    got = [windows[i]["input_ids"].tolist() for i in range(final)]
    assert got == [flat[i * seq_len : (i + 1) * seq_len] for i in range(final)]


def test_mixture_validation_sets_in_follower_mode(tmp_path: Path) -> None:
    docs = _documents(6, 6)
    url = _write_jsonl(tmp_path / "v.jsonl", docs)
    mix = LMMixtureDatasetConfig(
        configs={"a": LMDatasetConfig(validation_urls=[url], workers=0)},
        train_weights={"a": 1.0},
        tokenizer=TOKENIZER,
        cache_dir=str(tmp_path / "mix"),
    )
    processor = data_processor(LMDatasetConfig(tokenizer=TOKENIZER))
    build_cache([url], mix.cache_path("a", "validation"), processor=processor, workers=0, progress=False)
    follow_cache_builds(timeout=0)
    (name, windows), *rest = validation_sets(mix, 4).items()
    assert (name, rest) == ("a", [])
    flat = [t for doc in _reference_tokens(docs) for t in doc]
    assert [windows[i]["input_ids"].tolist() for i in range(len(windows))] == [
        flat[i * 4 : i * 4 + 4] for i in range(len(flat) // 4)
    ]


def test_follow_cache_builds_returns_the_previous_mode() -> None:
    assert follow_cache_builds(True, timeout=5) == FollowMode(False, DEFAULT_FOLLOW_TIMEOUT)
    assert follow_cache_builds(False, timeout=None) == FollowMode(True, 5)
    assert follow_cache_builds(False) == FollowMode(False, None)
    with pytest.raises(ValueError, match="timeout"):
        follow_cache_builds(True, timeout=-1)
