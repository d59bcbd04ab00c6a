"""Tests of ponente.trainer.data: configs -> caches -> packed rows, shuffles, mixtures, loading, shipped assets."""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ponente.datacache import BadInput, BadRecordError, Dataset, InMemoryTokenStore, TokenSeqDataset
from ponente.trainer.data import (
    CacheBuildError,
    DataLoader,
    LMDatasetConfig,
    LMMixtureDatasetConfig,
    batch_for_step,
    build_all_caches,
    build_caches,
    data_processor,
    data_tokenizer,
    data_vocab_size,
    resolve_url,
    train_set,
    validation_sets,
)
from ponente.trainer.data.cache_build import build_in_background

EOS = "<|endoftext|>"
WORDS = ["the", "king", "queen", "sword", "crown", "night", "day", "love", "death", "fool", "ghost", "castle", "sea"]


def _documents(seed: int, count: int, word: str | None = None) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        n = int(rng.integers(1, 40))
        docs.append(" ".join(word or WORDS[int(i)] for i in rng.integers(0, len(WORDS), n)))
    return docs


def _write_jsonl(path: Path, docs: Sequence[str]) -> str:
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(lines.encode()))
    else:
        path.write_text(lines)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_documents(0, 200) + ["alpha beta gamma"] * 5, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[str]]:
    """Two shards (one gzipped) and their documents in cache order."""
    root = tmp_path_factory.mktemp("corpus")
    first, second = _documents(1, 30), _documents(2, 25)
    urls = [_write_jsonl(root / "a.jsonl", first), _write_jsonl(root / "b.jsonl.gz", second)]
    return urls, first + second


@pytest.fixture(scope="module")
def built(
    tokenizer_path: str, corpus: tuple[list[str], list[str]], tmp_path_factory: pytest.TempPathFactory
) -> LMDatasetConfig:
    urls, _ = corpus
    cfg = LMDatasetConfig(
        train_urls=urls,
        validation_urls=urls[:1],
        tokenizer=tokenizer_path,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        workers=0,
    )
    build_all_caches(cfg, progress=False)
    return cfg


def _reference_tokens(tokenizer_path: str, docs: Sequence[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(tokenizer_path)
    eos = tok.token_to_id(EOS)
    return [[*tok.encode(d, add_special_tokens=False).ids, eos] for d in docs]


def _naive_windows(docs: list[list[int]], seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Pack documents end to end; cut full windows; number the documents inside each window from 0."""
    flat: list[int] = []
    doc_of: list[int] = []
    for k, d in enumerate(docs):
        flat += d
        doc_of += [k] * len(d)
    out = []
    for start in range(0, len(flat) - seq_len + 1, seq_len):
        ids = flat[start : start + seq_len]
        owners = doc_of[start : start + seq_len]
        segs, seg = [], 0
        for j, owner in enumerate(owners):
            if j and owner != owners[j - 1]:
                seg += 1
            segs.append(seg)
        out.append((ids, segs))
    return out


def _rows(ds: Dataset[dict[str, np.ndarray]], indices: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    picked = range(len(ds)) if indices is None else indices
    return [tuple(int(t) for t in ex["input_ids"]) for ex in ds.get_batch(list(picked))]


# -- caches and packing --------------------------------------------------------------------------------


def test_cache_rows_match_direct_tokenization(built: LMDatasetConfig, corpus: tuple[list[str], list[str]]) -> None:
    cache = build_caches(built, "train", background=False)
    _, docs = corpus
    assert cache.is_finished
    assert len(cache) == len(docs)
    expected = _reference_tokens(built.tokenizer, docs)
    assert [cache[i]["input_ids"].tolist() for i in range(len(cache))] == expected
    assert cache.location.endswith("/default/train")


@settings(max_examples=20, deadline=None)
@given(seq_len=st.integers(1, 70))
def test_windows_and_segments_match_naive_packing(
    built: LMDatasetConfig, corpus: tuple[list[str], list[str]], seq_len: int
) -> None:
    ds = train_set(built, seq_len, seed=0)
    expected = _naive_windows(_reference_tokens(built.tokenizer, corpus[1]), seq_len)
    assert len(ds) == len(expected)
    batch = batch_for_step(ds, 0, len(expected))
    assert batch["input_ids"].dtype == np.int32
    assert batch["segment_ids"].dtype == np.int32
    assert batch["input_ids"].tolist() == [ids for ids, _ in expected]
    assert batch["segment_ids"].tolist() == [segs for _, segs in expected]


def test_validation_sets(built: LMDatasetConfig, corpus: tuple[list[str], list[str]]) -> None:
    sets = validation_sets(built, 16)
    assert list(sets) == ["default"]
    expected = _naive_windows(_reference_tokens(built.tokenizer, corpus[1][:30]), 16)
    assert _rows(sets["default"]) == [tuple(ids) for ids, _ in expected]
    no_validation = LMDatasetConfig(train_urls=corpus[0], tokenizer=built.tokenizer, cache_dir=built.cache_dir)
    assert validation_sets(no_validation, 16) == {}


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_full_shuffle_is_a_deterministic_permutation(built: LMDatasetConfig, seed: int) -> None:
    plain = _rows(train_set(built, 8, seed=seed))
    shuffled_cfg = dataclasses.replace(built, shuffle=True)
    shuffled = _rows(train_set(shuffled_cfg, 8, seed=seed))
    assert sorted(shuffled) == sorted(plain)  # every row exactly once per epoch
    assert shuffled == _rows(train_set(shuffled_cfg, 8, seed=seed))
    assert shuffled != _rows(train_set(shuffled_cfg, 8, seed=seed + 1))
    assert shuffled != plain


def test_era_shuffle_permutes_within_eras(built: LMDatasetConfig) -> None:
    plain = _rows(train_set(built, 8, seed=3))
    era = 5
    shuffled = _rows(train_set(dataclasses.replace(built, shuffle=era), 8, seed=3))
    assert len(shuffled) == len(plain)
    for start in range(0, len(plain), era):
        assert sorted(shuffled[start : start + era]) == sorted(plain[start : start + era])
    assert shuffled != plain


# -- mixtures --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixture_parts(tokenizer_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mix")
    a_docs, b_docs = _documents(5, 40, word="alpha"), _documents(6, 40, word="beta")
    a, b = _write_jsonl(root / "a.jsonl", a_docs), _write_jsonl(root / "b.jsonl", b_docs)
    return {"a": a, "b": b, "a_docs": a_docs, "b_docs": b_docs, "tokenizer": tokenizer_path, "cache_dir": str(root)}


def _mixture(parts: dict[str, Any], weights: Any, **kwargs: Any) -> LMMixtureDatasetConfig:
    return LMMixtureDatasetConfig(
        configs={k: LMDatasetConfig(train_urls=[parts[k]], workers=0) for k in ("a", "b")},
        train_weights=weights,
        tokenizer=parts["tokenizer"],
        cache_dir=parts["cache_dir"],
        **kwargs,
    )


def _component_of_rows(parts: dict[str, Any], batch: np.ndarray) -> list[str]:
    """Which component each row came from, by matching it against each component's naively packed windows."""
    windows = {
        k: {tuple(ids) for ids, _ in _naive_windows(_reference_tokens(parts["tokenizer"], parts[f"{k}_docs"]), 4)}
        for k in ("a", "b")
    }
    out = []
    for row in batch.tolist():
        (owner,) = [k for k in ("a", "b") if tuple(row) in windows[k]]
        out.append(owner)
    return out


def test_mixture_weights_hold_in_every_block(mixture_parts: dict[str, Any]) -> None:
    mix = _mixture(mixture_parts, {"a": 0.75, "b": 0.25}, mixture_block_size=8, shuffle=True)
    ds = train_set(mix, 4, seed=0)
    blocks = 30  # more blocks than component a has rows: it restarts
    rows = batch_for_step(ds, 0, 8 * blocks)["input_ids"]
    sources = _component_of_rows(mixture_parts, rows)
    for k in range(blocks):
        assert sources[8 * k : 8 * k + 8].count("a") == 6
    assert sources.count("a") / len(sources) == pytest.approx(0.75)
    assert mix.cache_path("a", "train") == f"{mixture_parts['cache_dir']}/a/train"


def test_mixture_schedule_switches_components_at_step(mixture_parts: dict[str, Any]) -> None:
    mix = _mixture(mixture_parts, [[0, {"a": 1.0}], [2, {"b": 1.0}]], mixture_block_size=8)
    with pytest.raises(ValueError, match=r"batch_size"):
        train_set(mix, 4, seed=0)
    ds = train_set(mix, 4, seed=0, batch_size=8)
    sources = [_component_of_rows(mixture_parts, batch_for_step(ds, s, 8)["input_ids"]) for s in range(4)]
    assert sources == [["a"] * 8, ["a"] * 8, ["b"] * 8, ["b"] * 8]
    with pytest.raises(ValueError, match=r"multiple of data\.mixture_block_size"):
        train_set(mix, 4, seed=0, batch_size=6)


def test_mixture_config_errors_name_the_key(mixture_parts: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"unknown component\(s\) \['c'\]"):
        _mixture(mixture_parts, {"a": 1.0, "c": 1.0})
    with pytest.raises(ValueError, match=r"first stage must start at step 0"):
        _mixture(mixture_parts, [[5, {"a": 1.0}]])
    with pytest.raises(ValueError, match=r"positive sum"):
        _mixture(mixture_parts, {"a": 0.0})


def test_config_errors_name_the_key(tokenizer_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"data\.shuffle"):
        LMDatasetConfig(shuffle=0)
    with pytest.raises(ValueError, match=r"data\.train_urls"):
        LMDatasetConfig(train_urls="a.jsonl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no train data"):
        train_set(LMDatasetConfig(tokenizer=tokenizer_path), 4, seed=0)
    with pytest.raises(ValueError, match=r"data\.vocab_size"):
        _ = data_vocab_size(LMDatasetConfig(tokenizer=tokenizer_path, vocab_size=10))
    assert data_vocab_size(LMDatasetConfig(tokenizer=tokenizer_path, vocab_size=512)) == 512
    with pytest.raises(ValueError, match=r"data\.bos_token"):
        data_processor(LMDatasetConfig(tokenizer=tokenizer_path, enforce_bos=True, bos_token="<s>"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"HF_HUB_OFFLINE"):
        _ = data_tokenizer(LMDatasetConfig(tokenizer="no-such-org/no-such-tokenizer"))


def test_eos_inference_needs_a_special_token(tmp_path: Path) -> None:
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "t.json"))
    cfg = LMDatasetConfig(tokenizer=str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match=r"data\.eos_token is not set"):
        data_processor(cfg)
    assert data_processor(LMDatasetConfig(tokenizer=str(tmp_path / "t.json"), enforce_eos=False)).eos is None


# -- background builds -----------------------------------------------------------------------------------


class _GatedSource:
    """A source of one shard whose rows are released one by one by a semaphore; optionally bad at the end."""

    def __init__(self, docs: list[str], *, bad_at_end: bool = False) -> None:
        self.docs = docs
        self.bad_at_end = bad_at_end
        self.gate = threading.Semaphore(0)

    @property
    def shard_names(self) -> list[str]:
        return ["gated"]

    def open_shard(self, name: str, row: int = 0) -> Iterator[tuple[int, Any, int]]:
        for i in range(row, len(self.docs)):
            if not self.gate.acquire(timeout=30):
                raise TimeoutError("test gate never opened")
            yield i, {"text": self.docs[i]}, len(self.docs[i])
        if self.bad_at_end:
            self.gate.acquire(timeout=30)
            yield len(self.docs), BadInput("malformed_json", "gated, line 99", "not JSON"), 1

    def describe(self) -> dict[str, Any]:
        return {"gated": len(self.docs), "bad": self.bad_at_end}

    def locate(self, name: str, row: int) -> str:
        return f"{name}, row {row}"


def _gated_build(source: _GatedSource, location: str, tokenizer_path: str) -> Any:
    return build_in_background(
        location,
        timeout=30,
        inputs=source,
        tokenizer=tokenizer_path,
        eos=EOS,
        workers=0,
        batch_rows=1,
        commit_interval=0,
        progress=False,
    )


def test_reading_while_the_cache_builds(tokenizer_path: str, tmp_path: Path) -> None:
    docs = _documents(9, 12)
    source = _GatedSource(docs)
    source.gate.release(2)  # the builder reads one batch ahead: the first row commits once two are read
    cache = _gated_build(source, str(tmp_path / "c"), tokenizer_path)
    assert len(cache) >= 1
    assert not cache.is_finished
    windows = TokenSeqDataset(cache, 8)
    expected = _naive_windows(_reference_tokens(tokenizer_path, docs), 8)
    late = len(expected) - 1  # the last window exists only once every document is in

    result: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: result.update(batch=batch_for_step(windows, late, 1, timeout=30)))
    reader.start()
    time.sleep(0.1)
    assert reader.is_alive()  # waiting for rows that are not committed yet
    source.gate.release(len(docs) - 2)
    reader.join(30)
    assert result["batch"]["input_ids"].tolist() == [expected[late][0]]
    assert result["batch"]["segment_ids"].tolist() == [expected[late][1]]
    assert windows.wait_for_length(None, timeout=30)
    assert cache.is_finished
    assert _rows(windows) == [tuple(ids) for ids, _ in expected]


def test_a_failed_build_surfaces_on_the_next_read(tokenizer_path: str, tmp_path: Path) -> None:
    source = _GatedSource(_documents(10, 3), bad_at_end=True)
    source.gate.release(2)
    cache = _gated_build(source, str(tmp_path / "c"), tokenizer_path)
    source.gate.release(2)
    with pytest.raises(CacheBuildError, match=r"gated, line 99") as info:
        cache.wait_until(rows=100, timeout=30)
    assert isinstance(info.value.__cause__, BadRecordError)
    with pytest.raises(CacheBuildError):
        len(cache)


def test_a_build_failing_before_any_row_raises_at_once(tokenizer_path: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    cfg = LMDatasetConfig(train_urls=[str(bad)], tokenizer=tokenizer_path, cache_dir=str(tmp_path / "c"), workers=0)
    with pytest.raises(CacheBuildError, match=r"bad\.jsonl, line 1") as info:
        build_caches(cfg, "train", progress=False)
    assert isinstance(info.value.__cause__, BadRecordError)


# -- batches and the loader --------------------------------------------------------------------------------


def _counting_dataset(n: int, seq_len: int = 3) -> TokenSeqDataset:
    return TokenSeqDataset(InMemoryTokenStore.from_documents([list(range(n * seq_len))]), seq_len)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 20), step=st.integers(0, 30), batch=st.integers(1, 9))
def test_batch_for_step_wraps_modulo_the_final_length(n: int, step: int, batch: int) -> None:
    ds = _counting_dataset(n)
    got = batch_for_step(ds, step, batch)["input_ids"][:, 0] // 3
    assert got.tolist() == [(step * batch + k) % n for k in range(batch)]


def test_batch_rows_select_part_of_the_global_batch() -> None:
    ds = _counting_dataset(50)
    full = batch_for_step(ds, 3, 8)
    part = batch_for_step(ds, 3, 8, rows=slice(2, 6))
    for key in full:
        np.testing.assert_array_equal(part[key], full[key][2:6])


def test_loader_order_equals_batch_for_step() -> None:
    ds = _counting_dataset(23)
    with DataLoader(ds, 4, start_step=2, stop_step=12, prefetch=3) as loader:
        seen = list(loader)
    assert [s for s, _ in seen] == list(range(2, 12))
    for step, batch in seen:
        expected = batch_for_step(ds, step, 4)
        assert batch.keys() == expected.keys()
        for key in batch:
            np.testing.assert_array_equal(batch[key], expected[key])
    assert loader.wait_time >= 0
    assert loader.total_wait_time >= loader.wait_time


def test_loader_close_stops_the_thread_even_while_waiting_for_rows() -> None:
    store = InMemoryTokenStore(finished=False)
    store.append([list(range(6))])
    loader = DataLoader(TokenSeqDataset(store, 3), 2, prefetch=1)
    step, batch = next(loader)
    assert step == 0
    assert batch["input_ids"].tolist() == [[0, 1, 2], [3, 4, 5]]
    time.sleep(0.1)  # the thread now waits for rows of step 1 that never come
    assert loader.is_alive
    loader.close()
    assert not loader.is_alive
    with pytest.raises(StopIteration):
        next(loader)


class _FailingDataset(Dataset[dict[str, np.ndarray]]):
    def __init__(self, fail_from: int) -> None:
        self.fail_from = fail_from

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if index >= self.fail_from:
            raise RuntimeError(f"row {index} is corrupt")
        return {"input_ids": np.array([index], dtype=np.int32)}


def test_loader_propagates_errors() -> None:
    loader = DataLoader(_FailingDataset(fail_from=6), 2)
    assert [next(loader)[0] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match=r"row 6 is corrupt"):
        next(loader)
    assert not loader.is_alive
    with pytest.raises(ValueError, match=r"prefetch"):
        DataLoader(_FailingDataset(0), 2, prefetch=0)


# -- package:// URLs and the shipped assets ------------------------------------------------------------------

ASSETS = "package://ponente.trainer.assets/"


def test_package_urls_resolve_to_the_installed_files() -> None:
    path = resolve_url(ASSETS + "shakespeare_tokenizer.json")
    expected = importlib.resources.files("ponente.trainer.assets") / "shakespeare_tokenizer.json"
    assert Path(path).read_bytes() == expected.read_bytes()
    assert resolve_url("gs://bucket/x.jsonl") == "gs://bucket/x.jsonl"
    with pytest.raises(FileNotFoundError, match=r"shakespeare_train\.jsonl\.gz"):  # lists what exists
        resolve_url(ASSETS + "missing.jsonl")
    with pytest.raises(ValueError, match=r"malformed"):
        resolve_url("package://ponente.trainer.assets")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("package://os/path.py", "ponente.* packages only"),  # importing another module would run its code
        ("package://json.tool/x", "ponente.* packages only"),
        ("package://ponente.trainer.assets/../config/gpt2_nano.yaml", "without '..'"),
        ("package://ponente.trainer.assets//etc/passwd", "without '..'"),
        ("package://ponente.trainer.assets/./README.md", "without '..'"),
    ],
)
def test_package_urls_stay_inside_ponente_packages(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_url(url)


def test_a_link_inside_a_package_that_leads_outside_is_refused(tmp_path: Path) -> None:
    package = Path(str(importlib.resources.files("ponente.trainer.assets")))
    link = package / "_test_link_outside.txt"
    secret = tmp_path / "secret.txt"
    secret.write_text("not ours")
    try:
        link.symlink_to(secret)
    except OSError:
        pytest.skip("cannot write a link into the installed package (read-only install)")
    try:
        with pytest.raises(ValueError, match=r"outside the package"):
            resolve_url(ASSETS + link.name)
    finally:
        link.unlink()


def _shipped_works(split: str) -> list[dict[str, str]]:
    with gzip.open(resolve_url(f"{ASSETS}shakespeare_{split}.jsonl.gz"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_shipped_corpus() -> None:
    train, validation = _shipped_works("train"), _shipped_works("validation")
    assert len(train) == 39
    assert len(validation) == 3
    titles = [w["title"] for w in train + validation]
    assert len(set(titles)) == 42
    assert {"Hamlet", "King Lear", "The Tempest", "Sonnets", "The Rape of Lucrece"} <= set(titles)
    assert sorted(w["title"] for w in validation) == ["A Lover's Complaint", "Macbeth", "The Comedy of Errors"]
    for work in train + validation:
        text = work["text"]
        assert len(text) > 1000, work["title"]
        licence = re.search(r"gutenberg|\*\*\* ?(start|end) of|small print|\be-?texts?\b|copyright", text, re.I)
        assert licence is None, (work["title"], licence)
    hamlet = next(w["text"] for w in train if w["title"] == "Hamlet")
    assert "To be, or not to be" in hamlet
    files = ("shakespeare_train.jsonl.gz", "shakespeare_validation.jsonl.gz", "shakespeare_tokenizer.json")
    assert sum(Path(resolve_url(ASSETS + name)).stat().st_size for name in files) < 3_000_000


def test_shipped_tokenizer() -> None:
    cfg = LMDatasetConfig(tokenizer=ASSETS + "shakespeare_tokenizer.json")
    tok = data_tokenizer(cfg)
    assert tok.get_vocab_size() == 4096 == data_vocab_size(cfg)
    assert tok.token_to_id(EOS) == 0
    text = "Now is the winter of our discontent\nMade glorious summer by this sun of York; café ☃"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # the merges compress English
    assert data_processor(cfg).eos == EOS
