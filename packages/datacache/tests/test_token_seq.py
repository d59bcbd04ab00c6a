"""Tests of TokenSeqDataset against a naive concatenate-and-slice reference in pure Python."""

import asyncio
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ponente.datacache import InMemoryTokenStore, TokenSeqDataset

documents = st.lists(st.lists(st.integers(0, 50_000), max_size=9), max_size=12)


def naive_windows(docs: list[list[int]], seq_len: int) -> list[tuple[list[int], list[int]]]:
    """(tokens, segment ids) of every full window, by concatenating the documents in Python."""
    tokens, doc_of = [], []
    for d, doc in enumerate(docs):
        tokens.extend(doc)
        doc_of.extend([d] * len(doc))
    windows = []
    for w in range(len(tokens) // seq_len):
        span = range(w * seq_len, (w + 1) * seq_len)
        seen: list[int] = []
        segments = []
        for t in span:
            if doc_of[t] not in seen:
                seen.append(doc_of[t])
            segments.append(len(seen) - 1)
        windows.append(([tokens[t] for t in span], segments))
    return windows


@settings(max_examples=50, deadline=None)
@given(documents, st.integers(1, 7), st.data())
def test_windows_match_naive_reference(docs, seq_len, data):
    store = InMemoryTokenStore.from_documents(docs)
    ds = TokenSeqDataset(store, seq_len)
    expected = naive_windows(docs, seq_len)
    assert len(ds) == len(expected)
    assert ds.is_finished
    if not expected:
        assert ds.get_batch([]) == []
        return
    order = data.draw(st.lists(st.integers(0, len(expected) - 1), max_size=10))
    batch = ds.get_batch_arrays(order)
    assert batch["input_ids"].shape == (len(order), seq_len)
    assert batch["input_ids"].tolist() == [expected[i][0] for i in order]
    assert batch["segment_ids"].dtype == np.int32
    assert batch["segment_ids"].tolist() == [expected[i][1] for i in order]
    for i in order:
        example = ds[i]
        assert example["input_ids"].tolist() == expected[i][0]
        assert example["segment_ids"].tolist() == expected[i][1]


def test_different_seq_len_over_the_same_store():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=rng.integers(1, 30)).tolist() for _ in range(40)]
    store = InMemoryTokenStore.from_documents(docs, dtype=np.uint16)
    for seq_len in (1, 3, 8, 64):
        ds = TokenSeqDataset(store, seq_len)
        expected = naive_windows(docs, seq_len)
        got = ds.get_batch(range(len(ds)))
        assert [ex["input_ids"].tolist() for ex in got] == [w[0] for w in expected]
        assert [ex["segment_ids"].tolist() for ex in got] == [w[1] for w in expected]
        assert got[0]["input_ids"].dtype == np.uint16


def test_errors_name_the_index():
    ds = TokenSeqDataset(InMemoryTokenStore.from_documents([[1, 2, 3, 4, 5]]), 2)
    with pytest.raises(IndexError, match="index 2 is out of range for a dataset with 2"):
        ds.get_batch([0, 2])
    with pytest.raises(IndexError, match="negative"):
        ds[-1]
    with pytest.raises(ValueError, match="seq_len"):
        TokenSeqDataset(InMemoryTokenStore(), 0)


def test_length_grows_with_a_growing_store():
    store = InMemoryTokenStore(finished=False)
    ds = TokenSeqDataset(store, 4)
    assert len(ds) == 0
    assert not ds.is_finished
    store.append([[1, 2, 3]])
    assert len(ds) == 0
    assert not ds.wait_for_length(1, timeout=0.01)
    store.append([[4, 5], [6, 7, 8, 9]])
    assert len(ds) == 2
    assert ds[1]["input_ids"].tolist() == [5, 6, 7, 8]
    assert ds[1]["segment_ids"].tolist() == [0, 1, 1, 1]
    store.finish()
    assert ds.is_finished
    assert len(ds) == 2


def test_async_read_waits_for_a_growing_store():
    docs = [list(range(k * 10, k * 10 + 5)) for k in range(30)]
    store = InMemoryTokenStore(finished=False)
    ds = TokenSeqDataset(store, 6)

    def build() -> None:
        for doc in docs:
            time.sleep(0.003)
            store.append([doc])
        store.finish()

    async def read() -> list[list[int]]:
        thread = threading.Thread(target=build)
        thread.start()
        try:
            batch = await ds.get_batch_async([24, 0, 11], timeout=10)
        finally:
            thread.join()
        return [ex["input_ids"].tolist() for ex in batch]

    expected = naive_windows(docs, 6)
    assert asyncio.run(read()) == [expected[24][0], expected[0][0], expected[11][0]]
    with pytest.raises(IndexError, match="index 25"):
        asyncio.run(ds.get_batch_async([25], timeout=1))


def test_offsets_that_do_not_continue_are_reported():
    store = InMemoryTokenStore.from_documents([[1, 2]], finished=False)
    ds = TokenSeqDataset(store, 2)
    store._offsets = np.array([0, 1, 3], dtype=np.int64)  # simulate a cache rewritten under the reader
    store._flat = np.array([1, 2, 3], dtype=np.int32)
    with pytest.raises(RuntimeError, match="changed under a reader"):
        len(ds)


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    """A tiny cache built by build_cache from a jsonl corpus, with a BPE tokenizer trained here."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ponente.datacache import build_cache

    root = tmp_path_factory.mktemp("real_cache")
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 25)))) for _ in range(60)]
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=40, special_tokens=["[UNK]", "</s>"]))
    tokenizer.save(str(root / "tokenizer.json"))
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    cache = build_cache(
        str(root / "corpus.jsonl"),
        str(root / "cache"),
        tokenizer=str(root / "tokenizer.json"),
        eos="</s>",
        workers=0,
        progress=False,
        batch_rows=16,
    )
    eos = tokenizer.token_to_id("</s>")
    docs = [[*tokenizer.encode(text, add_special_tokens=False).ids, eos] for text in texts]
    return cache, docs


@pytest.mark.parametrize("seq_len", [1, 7, 32])
def test_windows_over_a_real_built_cache(real_cache, seq_len):
    from ponente.datacache import open_cache

    built, docs = real_cache
    for cache in (built, open_cache(built.location)):
        ds = TokenSeqDataset(cache, seq_len)
        expected = naive_windows(docs, seq_len)
        assert ds.is_finished
        assert len(ds) == len(expected)
        order = np.random.default_rng(seq_len).permutation(len(ds))[:50]
        batch = ds.get_batch_arrays(order)
        assert batch["input_ids"].tolist() == [expected[i][0] for i in order]
        assert batch["segment_ids"].tolist() == [expected[i][1] for i in order]


def test_wrappers_compose_over_a_real_cache(real_cache):
    from ponente.datacache import EraShuffleDataset, MixtureDataset

    cache, docs = real_cache
    expected = [w[0] for w in naive_windows(docs, 8)]
    shuffled = EraShuffleDataset(TokenSeqDataset(cache, 8), era_length=5, seed=2)
    got = [ex["input_ids"].tolist() for ex in shuffled.get_batch(range(len(shuffled)))]
    assert sorted(got) == sorted(expected)
    mix = MixtureDataset(
        {"short": TokenSeqDataset(cache, 8), "long": TokenSeqDataset(cache, 16)},
        {"short": 1, "long": 1},
        block_size=4,
        stop_strategy="error",
    )
    comp, local = mix.component_of(range(len(mix)))
    by_len = {0: expected, 1: [w[0] for w in naive_windows(docs, 16)]}
    assert [ex["input_ids"].tolist() for ex in mix.get_batch(range(len(mix)))] == [
        by_len[c][k] for c, k in zip(comp.tolist(), local.tolist())
    ]
