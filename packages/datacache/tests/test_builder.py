"""The builder: token ids, determinism (workers, backends, kill -9 and resume), readers while building,
fingerprints, bad-input policies and empty documents."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from ponente.datacache import BadRecordError, FingerprintMismatchError, build_cache, open_cache
from ponente.datacache.errors import (
    EMPTY,
    INVALID_UTF8,
    MALFORMED_JSON,
    MISSING_FIELD,
    TRUNCATED_FILE,
    UNREADABLE_PATH,
    WRONG_TYPE,
)


def _rows(location: str | Path) -> list[list[int]]:
    cache = open_cache(str(location))
    return [row["input_ids"].tolist() for row in cache.get_batch(range(len(cache)))]


@pytest.fixture
def corpus(write_jsonl: Callable[..., Path], helpers: type) -> tuple[list[Path], list[str]]:
    """Three jsonl shards (one gzipped) of 40 documents each."""
    docs = helpers.make_documents(120, seed=7)
    paths = [write_jsonl(f"in/part{i}.jsonl", docs[40 * i : 40 * i + 40]) for i in range(3)]
    paths[2].with_suffix(".jsonl.gz").write_bytes(gzip.compress(paths[2].read_bytes()))
    paths[2].unlink()
    paths[2] = paths[2].with_suffix(".jsonl.gz")
    return paths, docs


def test_tokens_match_encode_batch(
    tmp_path: Path, corpus: tuple, tokenizer_path: Path, tokenizer: Tokenizer, helpers: type
) -> None:
    paths, docs = corpus
    pattern = str(paths[0].parent / "part{0..2}.jsonl*")
    cache = build_cache(
        pattern, tmp_path / "cache", tokenizer=tokenizer_path, eos="<eos>", workers=0, progress=False, batch_rows=16
    )
    assert cache.is_finished
    assert len(cache) == len(docs)
    expected = helpers.reference_ids(tokenizer, docs, eos=tokenizer.token_to_id("<eos>"))
    assert _rows(tmp_path / "cache") == expected
    assert cache.num_tokens() == sum(map(len, expected))
    assert [s.rows_written for s in cache.ledger.shards] == [40, 40, 40]


def test_memory_location(corpus: tuple, tokenizer_path: Path, tokenizer: Tokenizer, helpers: type) -> None:
    paths, docs = corpus
    cache = build_cache(
        [str(p) for p in paths], "memory://test_builder/cache", tokenizer=tokenizer_path, workers=0, progress=False
    )
    assert _rows("memory://test_builder/cache") == helpers.reference_ids(tokenizer, docs)
    assert cache.is_finished


def test_workers_give_identical_bytes(tmp_path: Path, corpus: tuple, tokenizer_path: Path, helpers: type) -> None:
    paths, _ = corpus
    digests = []
    for workers, batch_rows in ((0, 1024), (1, 7), (2, 5)):
        out = tmp_path / f"cache{workers}"
        build_cache(
            [str(p) for p in paths],
            out,
            tokenizer=tokenizer_path,
            workers=workers,
            batch_rows=batch_rows,
            progress=False,
        )
        digests.append(helpers.tree_digest(out))
    assert digests[0] == digests[1] == digests[2]
    assert len(digests[0]) <= 6  # ledger + two zarr.json + two shard files per field: few files


@pytest.mark.integration
def test_ray_backend_gives_identical_bytes(
    tmp_path: Path, corpus: tuple, tokenizer_path: Path, helpers: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    paths, _ = corpus
    inputs = [str(p) for p in paths]
    build_cache(inputs, tmp_path / "local", tokenizer=tokenizer_path, workers=0, progress=False)
    build_cache(
        inputs, tmp_path / "ray", tokenizer=tokenizer_path, backend="ray", workers=2, batch_rows=9, progress=False
    )
    assert helpers.tree_digest(tmp_path / "ray") == helpers.tree_digest(tmp_path / "local")


def _start_build(
    tmp_path: Path, inputs: list[str], out: Path, tokenizer_path: Path, **options: object
) -> subprocess.Popen:
    script = tmp_path / "build_script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from ponente.datacache import build_cache

            if __name__ == "__main__":
                build_cache({inputs!r}, {str(out)!r}, tokenizer={str(tokenizer_path)!r}, progress=False, **{options!r})
            """
        )
    )
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for_cache(out: Path, process: subprocess.Popen, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "ledger.json").exists():
            return open_cache(out)
        if process.poll() is not None:
            raise AssertionError(f"build exited early: {process.stderr.read().decode() if process.stderr else ''}")
        time.sleep(0.02)
    raise AssertionError("the cache never appeared")


def test_kill_9_then_resume_is_byte_identical(
    tmp_path: Path, write_jsonl: Callable[..., Path], tokenizer_path: Path, helpers: type
) -> None:
    # enough rows after the last kill target that the build cannot finish before SIGKILL lands, even under load
    docs = helpers.make_documents(2000, seed=3)
    inputs = [str(write_jsonl(f"k/part{i}.jsonl", docs[500 * i : 500 * i + 500])) for i in range(4)]
    reference = tmp_path / "reference"
    build_cache(inputs, reference, tokenizer=tokenizer_path, workers=0, progress=False)

    out = tmp_path / "killed"
    options = {"workers": 0, "batch_rows": 3, "commit_interval": 0.0}
    # A kill before anything is committed, then kills after more and more rows committed.
    process = _start_build(tmp_path, inputs, out, tokenizer_path, **options)
    time.sleep(0.3)
    process.send_signal(signal.SIGKILL)
    process.wait()
    seen = []
    for target in (30, 700, 1300):
        process = _start_build(tmp_path, inputs, out, tokenizer_path, **options)
        cache = _wait_for_cache(out, process)
        assert cache.wait_until(rows=target, timeout=120)  # type: ignore[attr-defined]
        process.send_signal(signal.SIGKILL)
        process.wait()
        rows = len(cache)  # type: ignore[arg-type]
        assert not cache.is_finished, "the build finished before it could be killed"  # type: ignore[attr-defined]
        seen.append(rows)
    assert seen == sorted(seen)
    build_cache(inputs, out, tokenizer=tokenizer_path, progress=False, **options)  # type: ignore[arg-type]
    assert helpers.tree_digest(out) == helpers.tree_digest(reference)


def test_resume_does_not_redo_finished_shards(
    tmp_path: Path, corpus: tuple, tokenizer_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths, _docs = corpus
    inputs = [str(p) for p in paths]
    out = tmp_path / "cache"
    # Stop in the middle of the last shard by making its 11th line bad.
    lines = gzip.decompress(paths[2].read_bytes()).splitlines(keepends=True)
    lines[10] = b"{broken\n"
    paths[2].write_bytes(gzip.compress(b"".join(lines)))
    with pytest.raises(BadRecordError):
        build_cache(inputs, out, tokenizer=tokenizer_path, workers=0, progress=False, batch_rows=4)
    assert len(open_cache(out)) == 90
    opened: list[tuple[str, int]] = []
    from ponente.datacache.source import FileSource

    original = FileSource.open_shard

    def spy(self: FileSource, name: str, row: int = 0):  # type: ignore[no-untyped-def]
        opened.append((Path(name).name, row))
        return original(self, name, row)

    monkeypatch.setattr(FileSource, "open_shard", spy)
    cache = build_cache(inputs, out, tokenizer=tokenizer_path, workers=0, progress=False, bad_records="skip")
    assert opened == [("part2.jsonl.gz", 10)]
    assert len(cache) == 119
    assert cache.ledger.skipped == {MALFORMED_JSON: 1}


def test_readers_see_rows_while_building(
    tmp_path: Path, write_jsonl: Callable[..., Path], tokenizer_path: Path, tokenizer: Tokenizer, helpers: type
) -> None:
    docs = helpers.make_documents(1500, seed=5)
    inputs = [str(write_jsonl("r/part.jsonl", docs))]
    out = tmp_path / "growing"
    process = _start_build(tmp_path, inputs, out, tokenizer_path, workers=0, batch_rows=2)
    try:
        cache = _wait_for_cache(out, process)
        assert cache.wait_until(rows=20, timeout=60)  # type: ignore[attr-defined]
        early = len(cache)  # type: ignore[arg-type]
        assert cache.is_finished is False  # type: ignore[attr-defined]
        expected = helpers.reference_ids(tokenizer, docs)
        assert [cache[i]["input_ids"].tolist() for i in range(early)] == expected[:early]  # type: ignore[index]
        assert cache.wait_until(timeout=120)  # type: ignore[attr-defined]
        assert process.wait(timeout=60) == 0
        assert cache.is_finished
        assert len(cache) == len(docs)
        assert [r["input_ids"].tolist() for r in cache.get_batch(range(len(docs)))] == expected  # type: ignore[attr-defined]
    finally:
        process.kill()
        process.wait()


def test_fingerprint_mismatch(tmp_path: Path, corpus: tuple, tokenizer_path: Path) -> None:
    paths, _ = corpus
    inputs = [str(p) for p in paths]
    out = tmp_path / "cache"
    build_cache(inputs, out, tokenizer=tokenizer_path, workers=0, progress=False)
    with pytest.raises(FingerprintMismatchError, match=r"processor\.eos: cache has null, the request has \"<eos>\""):
        build_cache(inputs, out, tokenizer=tokenizer_path, eos="<eos>", workers=0, progress=False)
    with pytest.raises(FingerprintMismatchError, match=r"part2\.jsonl\.gz' is in the cache but not in the request"):
        build_cache(inputs[:2], out, tokenizer=tokenizer_path, workers=0, progress=False)
    with pytest.raises(FingerprintMismatchError, match="keep_empty"):
        build_cache(inputs, out, tokenizer=tokenizer_path, keep_empty=True, workers=0, progress=False)
    assert len(open_cache(out)) == 120  # untouched
    rebuilt = build_cache(inputs[:2], out, tokenizer=tokenizer_path, workers=0, progress=False, rebuild=True)
    assert len(rebuilt) == 80
    # Same request again: opens the finished cache without work.
    assert len(build_cache(inputs[:2], out, tokenizer=tokenizer_path, workers=0, progress=False)) == 80


def _bad_input(kind: str, tmp_path: Path) -> tuple[list[str], int, str]:
    """A corpus of good.jsonl (3 docs) then one bad file; returns (inputs, good rows, location text)."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"good {i}"}) + "\n" for i in range(3)))
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"fine {i}"}).encode() for i in range(4)]
    bad_line = {
        MALFORMED_JSON: b'{"text": "unterminated',
        MISSING_FIELD: json.dumps({"content": "x"}).encode(),
        WRONG_TYPE: json.dumps({"text": 42}).encode(),
        INVALID_UTF8: b'{"text": "caf\xe9"}',
    }.get(kind)
    if bad_line is not None:
        bad.write_bytes(b"\n".join([*lines[:2], bad_line, *lines[2:]]) + b"\n")
        return [str(good), str(bad)], 3 + 2, f"{bad}, line 3"
    if kind == TRUNCATED_FILE:
        raw = "".join(json.dumps({"text": f"fine {i} " * 30}) + "\n" for i in range(300)).encode()
        data = gzip.compress(raw)
        cut = tmp_path / "bad.jsonl.gz"
        cut.write_bytes(data[: len(data) // 2])
        return [str(good), str(cut)], -1, str(cut)
    missing = tmp_path / "missing.jsonl"
    return [str(good), str(missing)], 3, str(missing)


@pytest.mark.parametrize(
    "kind", [MALFORMED_JSON, MISSING_FIELD, WRONG_TYPE, INVALID_UTF8, TRUNCATED_FILE, UNREADABLE_PATH]
)
def test_bad_input_policies(tmp_path: Path, tokenizer_path: Path, helpers: type, kind: str) -> None:
    inputs, good_rows, location = _bad_input(kind, tmp_path)
    out = tmp_path / "error_then_skip"
    with pytest.raises(BadRecordError) as info:
        build_cache(inputs, out, tokenizer=tokenizer_path, workers=0, progress=False, batch_rows=1000)
    assert info.value.kind == kind
    assert info.value.location == location
    assert location in str(info.value)
    interrupted = open_cache(out)
    assert not interrupted.is_finished
    if good_rows >= 0:
        assert len(interrupted) == good_rows  # everything before the bad record is committed
    resumed = build_cache(inputs, out, tokenizer=tokenizer_path, workers=0, progress=False, bad_records="skip")
    assert resumed.ledger.skipped == {kind: 1}
    assert resumed.ledger.shards[1].skipped == {kind: 1}
    assert location in resumed.ledger.skip_examples[0]

    direct = tmp_path / "skip"
    cache = build_cache(inputs, direct, tokenizer=tokenizer_path, workers=0, progress=False, bad_records="skip")
    assert cache.ledger.skipped == {kind: 1}
    texts = [json.loads(line)["text"] for line in Path(inputs[0]).read_text().splitlines()]
    if kind not in (TRUNCATED_FILE, UNREADABLE_PATH):
        texts += [f"fine {i}" for i in range(4)]
        assert len(cache) == 7
    assert [cache[i]["input_ids"].tolist() for i in range(len(texts))] == _rows(direct)[: len(texts)]
    assert helpers.tree_digest(direct) == helpers.tree_digest(out)


def test_empty_documents(
    tmp_path: Path, write_jsonl: Callable[..., Path], tokenizer_path: Path, tokenizer: Tokenizer, helpers: type
) -> None:
    docs = ["one", "", "two", ""]
    inputs = [str(write_jsonl("e.jsonl", docs))]
    eos = tokenizer.token_to_id("<eos>")
    skipped = build_cache(inputs, tmp_path / "skip", tokenizer=tokenizer_path, eos="<eos>", workers=0, progress=False)
    assert skipped.ledger.skipped == {EMPTY: 2}
    assert _rows(tmp_path / "skip") == helpers.reference_ids(tokenizer, ["one", "two"], eos=eos)
    kept = build_cache(
        inputs, tmp_path / "keep", tokenizer=tokenizer_path, eos="<eos>", keep_empty=True, workers=0, progress=False
    )
    assert kept.ledger.skipped == {}
    assert _rows(tmp_path / "keep") == helpers.reference_ids(tokenizer, docs, eos=eos)


def test_invalid_options(tmp_path: Path, corpus: tuple, tokenizer_path: Path) -> None:
    paths, _ = corpus
    with pytest.raises(ValueError, match="bad_records"):
        build_cache(str(paths[0]), tmp_path / "x", tokenizer=tokenizer_path, bad_records="ignore")
    with pytest.raises(ValueError, match="backend"):
        build_cache(str(paths[0]), tmp_path / "x", tokenizer=tokenizer_path, backend="dask", progress=False)
    with pytest.raises(ValueError, match="exactly one of tokenizer"):
        build_cache(str(paths[0]), tmp_path / "x")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_rows=st.integers(1, 60), batch_bytes=st.integers(1, 5000), keep_empty=st.booleans())
def test_batching_never_changes_the_bytes(
    tmp_path: Path,
    write_jsonl: Callable[..., Path],
    tokenizer_path: Path,
    helpers: type,
    batch_rows: int,
    batch_bytes: int,
    keep_empty: bool,
) -> None:
    docs = helpers.make_documents(70, seed=9)
    docs[5] = docs[33] = ""
    inputs = [str(write_jsonl("h/a.jsonl", docs[:30])), str(write_jsonl("h/b.jsonl", docs[30:]))]
    common = {"tokenizer": tokenizer_path, "workers": 0, "progress": False, "keep_empty": keep_empty}
    reference = tmp_path / f"reference-{keep_empty}"
    if not reference.exists():
        build_cache(inputs, reference, **common)  # type: ignore[arg-type]
    out = tmp_path / "batched"
    build_cache(inputs, out, batch_rows=batch_rows, batch_bytes=batch_bytes, rebuild=True, commit_interval=0, **common)  # type: ignore[arg-type]
    assert helpers.tree_digest(out) == helpers.tree_digest(reference)
