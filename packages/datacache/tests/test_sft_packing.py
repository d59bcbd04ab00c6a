"""PackedExampleDataset against a naive packing loop; growth, truncation, caches with a loss mask."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from ponente.datacache import (
    InMemoryTokenStore,
    PackedExampleDataset,
    PassthroughProcessor,
    SupervisedProcessor,
    build_cache,
)


def naive_rows(
    examples: list[list[int]], masks: list[list[int]] | None, seq_len: int, pack: bool
) -> list[dict[str, list[int]]]:
    """Pack by hand: a list of rows, each a list of (tokens, mask) examples, then padded lists."""
    if masks is None:
        masks = [[1] * len(e) for e in examples]
    groups: list[list[tuple[list[int], list[int]]]] = []
    for tokens, mask in zip(examples, masks, strict=True):
        if not tokens:
            continue
        tokens, mask = tokens[:seq_len], mask[:seq_len]
        used = sum(len(t) for t, _ in groups[-1]) if groups else 0
        if pack and groups and used + len(tokens) <= seq_len:
            groups[-1].append((tokens, mask))
        else:
            groups.append([(tokens, mask)])
    rows = []
    for group in groups:
        row: dict[str, list[int]] = {"input_ids": [], "segment_ids": [], "loss_mask": [], "position_ids": []}
        for segment, (tokens, mask) in enumerate(group):
            row["input_ids"] += tokens
            row["segment_ids"] += [segment] * len(tokens)
            row["loss_mask"] += mask
            row["position_ids"] += list(range(len(tokens)))
        pad = seq_len - len(row["input_ids"])
        row["input_ids"] += [0] * pad
        row["segment_ids"] += [-1] * pad
        row["loss_mask"] += [0] * pad
        row["position_ids"] += [0] * pad
        rows.append(row)
    return rows


def _as_lists(ds: PackedExampleDataset) -> list[dict[str, list[int]]]:
    out = []
    for row in ds.get_batch(range(len(ds))):
        assert set(row) == {"input_ids", "segment_ids", "loss_mask", "position_ids"}
        assert all(v.dtype == np.int32 and v.shape == (ds.seq_len,) for v in row.values())
        out.append({k: v.tolist() for k, v in row.items()})
    return out


def _random_examples(rng: np.random.Generator, count: int, max_len: int) -> list[list[int]]:
    return [rng.integers(1, 100, size=int(rng.integers(0, max_len + 1))).tolist() for _ in range(count)]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), max_size=25),
    seq_len=st.integers(1, 10),
    pack=st.booleans(),
)
def test_matches_naive_packing(lengths: list[int], seq_len: int, pack: bool) -> None:
    examples = [list(range(100 * k + 1, 100 * k + 1 + n)) for k, n in enumerate(lengths)]
    ds = PackedExampleDataset(InMemoryTokenStore.from_documents(examples), seq_len, pack=pack)
    expected = naive_rows(examples, None, seq_len, pack)
    assert _as_lists(ds) == expected
    assert ds.truncated == sum(n > seq_len for n in lengths)
    if expected:
        last = len(expected) - 1
        assert {k: v.tolist() for k, v in ds[last].items()} == expected[last]


def test_example_from_the_docstring() -> None:
    store = InMemoryTokenStore.from_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    ds = PackedExampleDataset(store, seq_len=6)
    assert len(ds) == 2
    assert ds[0]["input_ids"].tolist() == [1, 2, 3, 4, 5, 0]
    assert ds[0]["segment_ids"].tolist() == [0, 0, 0, 1, 1, -1]
    assert ds[0]["position_ids"].tolist() == [0, 1, 2, 0, 1, 0]
    assert ds[0]["loss_mask"].tolist() == [1, 1, 1, 1, 1, 0]
    assert ds[1]["input_ids"].tolist() == [6, 7, 8, 9, 0, 0]
    unpacked = PackedExampleDataset(store, seq_len=6, pack=False, pad_id=7)
    assert len(unpacked) == 3
    assert unpacked[1]["input_ids"].tolist() == [4, 5, 7, 7, 7, 7]
    with pytest.raises(IndexError, match="index 3 is out of range"):
        unpacked[3]
    with pytest.raises(ValueError, match="seq_len must be at least 1"):
        PackedExampleDataset(store, 0)


@pytest.mark.parametrize("pack", [True, False])
def test_rows_are_stable_while_the_store_grows(pack: bool) -> None:
    rng = np.random.default_rng(3)
    examples = [*_random_examples(rng, 60, 9), [5]]
    seq_len = 8
    expected = naive_rows(examples, None, seq_len, pack)
    store = InMemoryTokenStore(finished=False)
    ds = PackedExampleDataset(store, seq_len, pack=pack)
    seen: list[dict[str, list[int]]] = []
    for start in range(0, len(examples), 7):
        store.append(examples[start : start + 7])
        rows = _as_lists(ds)
        assert rows[: len(seen)] == seen  # rows already returned never change
        assert rows == expected[: len(rows)]
        seen = rows
        assert not ds.is_finished
    last_full = -1 not in expected[-1]["segment_ids"]
    # a packed last row that is not full waits for the end of the store (it could take more examples)
    assert len(ds) == len(expected) - (1 if pack and not last_full else 0)
    store.finish()
    assert ds.is_finished
    assert _as_lists(ds) == expected


def test_wait_for_length_follows_a_growing_store() -> None:
    store = InMemoryTokenStore(finished=False)
    ds = PackedExampleDataset(store, 4)
    assert not ds.wait_for_length(1, timeout=0.05)

    def feed() -> None:
        store.append([[1, 2], [3, 4]])  # one complete row of 4 tokens
        store.append([[5]])
        store.finish()

    thread = threading.Thread(target=feed)
    thread.start()
    assert ds.wait_for_length(2, timeout=10)
    thread.join()
    assert len(ds) == 2
    assert ds.is_finished
    assert ds[1]["input_ids"].tolist() == [5, 0, 0, 0]


def test_truncation_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    store = InMemoryTokenStore.from_documents([[1] * 3, [2] * 9, [3] * 2, [4] * 12])
    with caplog.at_level(logging.WARNING, logger="ponente.datacache.packing"):
        ds = PackedExampleDataset(store, 5)
    assert ds.truncated == 2
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "example 1 has 9 tokens, more than seq_len=5" in messages[0]
    assert [r["input_ids"] for r in _as_lists(ds)] == [[1, 1, 1, 0, 0], [2] * 5, [3, 3, 0, 0, 0], [4] * 5]


def test_reads_the_loss_mask_of_a_cache(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    examples = _random_examples(rng, 40, 10)
    masks = [rng.integers(0, 2, size=len(e)).tolist() for e in examples]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"input_ids": e, "loss_mask": m}) + "\n" for e, m in zip(examples, masks)))
    processor = PassthroughProcessor({"input_ids": "int32", "loss_mask": "uint8"})
    cache = build_cache(str(path), tmp_path / "cache", processor=processor, workers=0, progress=False, keep_empty=True)
    for pack in (True, False):
        ds = PackedExampleDataset(cache, 12, pack=pack)
        assert _as_lists(ds) == naive_rows(examples, masks, 12, pack)


def test_supervised_cache_end_to_end(tmp_path: Path, tokenizer_path: Path, tokenizer: Tokenizer) -> None:
    rows = [{"input": f"the quick {w}", "output": f"{w} jumps over"} for w in ["fox", "dog", "zarr", "ledger"] * 3]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = SupervisedProcessor(tokenizer_path, eos="<eos>", bos="<bos>")
    cache = build_cache(str(path), tmp_path / "cache", processor=processor, workers=0, progress=False)
    eos, bos = tokenizer.token_to_id("<eos>"), tokenizer.token_to_id("<bos>")
    assert eos is not None
    assert bos is not None
    examples, masks = [], []
    for row in rows:
        head = [bos, *tokenizer.encode(row["input"], add_special_tokens=False).ids]
        tail = [*tokenizer.encode(row["output"], add_special_tokens=False).ids, eos]
        examples.append(head + tail)
        masks.append([0] * len(head) + [1] * len(tail))
    ds = PackedExampleDataset(cache, 32)
    assert _as_lists(ds) == naive_rows(examples, masks, 32, True)
    assert len(ds) < len(rows)  # several examples per row
