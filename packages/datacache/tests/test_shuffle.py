"""Tests of EraShuffleDataset and EpochDataset against index-level references."""

import asyncio
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ponente.datacache import EpochDataset, EraShuffleDataset, InMemoryTokenStore


def ids(store_examples) -> list[int]:
    return [int(ex["input_ids"][0]) for ex in store_examples]


def numbered(n: int, finished: bool = True) -> InMemoryTokenStore:
    """A store whose row i is [i], so a read reveals which inner index it came from."""
    return InMemoryTokenStore.from_documents([[i] for i in range(n)], finished=finished)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 300), st.integers(1, 64), st.integers(0, 2**32))
def test_era_shuffle_permutes_within_each_era(n, era, seed):
    ds = EraShuffleDataset(numbered(n), era, seed)
    assert len(ds) == n
    got = ids(ds.get_batch(range(n)))
    assert sorted(got) == list(range(n))
    for i, inner in enumerate(got):
        assert inner // era == i // era  # stays inside its era
    assert got == [int(ds[i]["input_ids"][0]) for i in range(n)]
    assert got == ids(EraShuffleDataset(numbered(n), era, seed).get_batch(range(n)))


def test_era_shuffle_of_a_growing_dataset_shows_full_eras_only():
    store = numbered(10, finished=False)
    ds = EraShuffleDataset(store, 4, seed=5)
    assert len(ds) == 8
    assert not ds.is_finished
    early = ids(ds.get_batch(range(8)))
    assert sorted(early[:4]) == [0, 1, 2, 3]
    assert sorted(early[4:]) == [4, 5, 6, 7]
    with pytest.raises(IndexError, match="index 8"):
        ds[8]
    store.append([[10], [11]])
    assert len(ds) == 12
    store.append([[12]])
    store.finish()
    assert len(ds) == 13
    assert ds.is_finished
    late = ids(ds.get_batch(range(13)))
    assert late[:8] == early  # what was visible never changes
    assert sorted(late[8:12]) == [8, 9, 10, 11]
    assert late[12] == 12


def test_era_shuffle_waits_for_a_full_era():
    store = numbered(3, finished=False)
    ds = EraShuffleDataset(store, 4, seed=0)
    assert not ds.wait_for_length(1, timeout=0.01)

    async def read() -> list[int]:
        timer = threading.Timer(0.05, store.append, args=([[3], [4]],))
        timer.start()
        return ids(await ds.get_batch_async([3, 0], timeout=10))

    got = asyncio.run(read())
    assert set(got) <= {0, 1, 2, 3}
    assert len(set(got)) == 2


def test_era_shuffle_rejects_bad_era_length():
    with pytest.raises(ValueError, match="era_length"):
        EraShuffleDataset(numbered(3), 0, seed=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 60), st.integers(1, 4), st.integers(0, 2**32))
def test_epochs_are_reshuffled_permutations(n, epochs, seed):
    ds = EpochDataset(numbered(n), epochs, seed=seed)
    assert len(ds) == n * epochs
    got = np.array(ids(ds.get_batch(range(len(ds))))).reshape(epochs, n)
    for e in range(epochs):
        assert sorted(got[e].tolist()) == list(range(n))
    if n >= 20 and epochs > 1:
        assert not np.array_equal(got[0], got[1])
    assert [int(ds[i]["input_ids"][0]) for i in range(len(ds))] == got.reshape(-1).tolist()


def test_epochs_without_seed_repeat_in_order():
    ds = EpochDataset(numbered(4), 3)
    assert ids(ds.get_batch(range(12))) == [0, 1, 2, 3] * 3
    with pytest.raises(IndexError, match="index 12"):
        ds[12]
    with pytest.raises(ValueError, match="num_epochs"):
        EpochDataset(numbered(4), 0)


def test_epochs_need_the_final_length():
    store = numbered(3, finished=False)
    ds = EpochDataset(store, 2, seed=1)
    assert len(ds) == 0
    store.finish()
    assert len(ds) == 6
    assert ds.wait_for_length(6, timeout=0)
