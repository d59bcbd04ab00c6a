"""Tests of the Dataset base class, the TokenStore protocol and InMemoryTokenStore (incl. growing stores)."""

import asyncio
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ponente.datacache import Dataset, InMemoryTokenStore, TokenStore

documents = st.lists(st.lists(st.integers(0, 1000), max_size=6), max_size=8)


class ListDataset(Dataset[int]):
    """A minimal growing dataset that relies on the base-class defaults (get_batch, polling wait)."""

    def __init__(self, items: list[int], finished: bool = True) -> None:
        self.items = items
        self.finished = finished

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < len(self.items):
            raise IndexError(index)
        return self.items[index]

    @property
    def is_finished(self) -> bool:
        return self.finished


@settings(max_examples=40, deadline=None)
@given(documents)
def test_in_memory_store_matches_python_lists(docs):
    store = InMemoryTokenStore.from_documents(docs)
    flat = [t for doc in docs for t in doc]
    assert len(store) == len(docs)
    assert store.num_tokens() == len(flat)
    assert store.read_flat(0, len(flat)).tolist() == flat
    expected_offsets = [0]
    for doc in docs:
        expected_offsets.append(expected_offsets[-1] + len(doc))
    assert store.row_offsets(0, len(docs)).tolist() == expected_offsets
    for i, doc in enumerate(docs):
        assert store[i]["input_ids"].tolist() == doc
        lo, hi = store.row_offsets(i, i + 1)
        assert store.read_flat(int(lo), int(hi)).tolist() == doc
    assert [ex["input_ids"].tolist() for ex in store.get_batch(list(range(len(docs)))[::-1])] == docs[::-1]


def test_in_memory_store_is_a_token_store():
    assert isinstance(InMemoryTokenStore.from_documents([[1]]), TokenStore)


def test_growing_store_appends_and_finishes():
    store = InMemoryTokenStore(finished=False)
    assert len(store) == 0
    assert not store.is_finished
    assert not store.wait_until(rows=1, timeout=0.01)
    store.append([[1, 2], [3]])
    store.append([])
    assert store.wait_until(rows=2, timeout=0.01)
    assert store.read_flat(0, 3).tolist() == [1, 2, 3]
    store.finish()
    assert store.is_finished
    assert store.wait_until(timeout=0.01)
    with pytest.raises(RuntimeError, match="finished"):
        store.append([[4]])


def test_store_errors_name_the_problem():
    store = InMemoryTokenStore.from_documents([[1, 2], [3]])
    with pytest.raises(KeyError, match="'labels'"):
        store.read_flat(0, 1, field="labels")
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        store.read_flat(0, 5)
    with pytest.raises(IndexError, match="rows"):
        store.row_offsets(1, 3)
    with pytest.raises(IndexError, match="index 2 is out of range"):
        store[2]
    with pytest.raises(IndexError, match="negative index -1"):
        store.get_batch([0, -1])
    with pytest.raises(TypeError, match="integers"):
        store.get_batch(np.array([0.5]))
    with pytest.raises(ValueError, match="document 1"):
        InMemoryTokenStore.from_documents([[1], [[2, 3]]])


def test_read_flat_returns_read_only_views():
    store = InMemoryTokenStore.from_documents([[1, 2, 3]])
    with pytest.raises(ValueError, match="read-only"):
        store.read_flat(0, 2)[0] = 7


def test_default_get_batch_and_polling_wait():
    ds = ListDataset([10, 11, 12], finished=False)
    assert ds.get_batch([2, 0, 2]) == [12, 10, 12]
    assert ds.get_batch([]) == []
    assert not ds.wait_for_length(4, timeout=0.02)

    def grow() -> None:
        time.sleep(0.05)
        ds.items.append(13)

    thread = threading.Thread(target=grow)
    thread.start()
    assert ds.wait_for_length(4, timeout=5)
    thread.join()
    assert ds.get_batch([3]) == [13]
    ds.finished = True
    assert ds.wait_for_length(None, timeout=0)
    assert ds.wait_for_length(100, timeout=0)


def test_async_batch_waits_for_rows_of_a_growing_store():
    store = InMemoryTokenStore(finished=False)
    docs = [[i, i + 1] for i in range(0, 40, 2)]

    def build() -> None:
        for doc in docs:
            time.sleep(0.005)
            store.append([doc])
        store.finish()

    async def read() -> list[list[int]]:
        thread = threading.Thread(target=build)
        thread.start()
        try:
            batch = await store.get_batch_async([19, 3, 0], timeout=10)
            single = await store.getitem_async(7, timeout=10)
        finally:
            thread.join()
        return [ex["input_ids"].tolist() for ex in [*batch, single]]

    assert asyncio.run(read()) == [docs[19], docs[3], docs[0], docs[7]]


def test_async_batch_times_out_and_reports_short_finished_store():
    growing = InMemoryTokenStore.from_documents([[1]], finished=False)
    with pytest.raises(TimeoutError, match="2 examples"):
        asyncio.run(growing.get_batch_async([1], timeout=0.02))
    finished = InMemoryTokenStore.from_documents([[1]])
    with pytest.raises(IndexError, match="index 1"):
        asyncio.run(finished.get_batch_async([1], timeout=0.02))
    with pytest.raises(TypeError, match="integers"):
        asyncio.run(finished.get_batch_async([0.0], timeout=0.02))
