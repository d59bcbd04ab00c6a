"""Tests of MixtureDataset: exact weights per block, schedules, resumability, stop strategies, growth."""

import asyncio
import sys
import threading
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ponente.datacache import InMemoryTokenStore, MixtureDataset, block_counts

TAG = 1000  # component j's row i holds the single token j * TAG + i


def tagged(j: int, n: int, finished: bool = True) -> InMemoryTokenStore:
    return InMemoryTokenStore.from_documents([[j * TAG + i] for i in range(n)], finished=finished)


def decode(examples) -> list[tuple[int, int]]:
    """(component, row) of each example, read back from the token values."""
    return [divmod(int(ex["input_ids"][0]), TAG) for ex in examples]


def reference_counts(weights: list[int], block_size: int) -> list[int]:
    """Largest remainder in exact rational arithmetic, one component at a time."""
    total = sum(weights)
    exact = [Fraction(w * block_size, total) for w in weights]
    counts = [int(e) for e in exact]  # floor for non-negative fractions
    while sum(counts) < block_size:  # each round, the largest remainder not yet rounded up (earliest on ties)
        best = max((j for j in range(len(weights)) if counts[j] == int(exact[j])), key=lambda j: (exact[j] % 1, -j))
        counts[best] += 1
    return counts


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=6).filter(any), st.integers(1, 500))
def test_block_counts_hit_the_weights(weights, block_size):
    counts = block_counts(weights, block_size)
    assert counts.sum() == block_size
    total = sum(weights)
    for c, w in zip(counts.tolist(), weights):
        assert abs(Fraction(c) - Fraction(w * block_size, total)) < 1
    assert counts.tolist() == reference_counts(weights, block_size)


def test_block_counts_rejects_bad_weights():
    for bad in ([0, 0], [1, -1], [float("nan")], []):
        with pytest.raises(ValueError, match="weight"):
            block_counts(bad, 10)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=4).filter(any),
    st.integers(1, 40),
    st.integers(0, 2**32),
    st.integers(1, 5),
)
def test_every_block_hits_its_counts_and_consumes_components_in_order(weights, block_size, seed, num_blocks):
    comps = {f"c{j}": tagged(j, 10_000) for j in range(len(weights))}
    mix = MixtureDataset(comps, dict(zip(comps, weights)), block_size=block_size, seed=seed)
    assert len(mix) == sys.maxsize
    assert mix.is_finished
    got = decode(mix.get_batch(range(num_blocks * block_size)))
    counts = block_counts(weights, block_size)
    for b in range(num_blocks):
        block = [c for c, _ in got[b * block_size : (b + 1) * block_size]]
        assert [block.count(j) for j in range(len(weights))] == counts.tolist()
    for j in range(len(weights)):
        rows = sorted(r for c, r in got if c == j)
        assert rows == list(range(num_blocks * int(counts[j])))  # no gap, no duplicate


def test_resumable_from_an_index_alone():
    def make() -> MixtureDataset:
        comps = {"a": tagged(0, 500), "b": tagged(1, 500), "c": tagged(2, 500)}
        return MixtureDataset(comps, {"a": 0.5, "b": 0.3, "c": 0.2}, block_size=16, seed=11)

    full = decode(make().get_batch(range(200)))
    rng = np.random.default_rng(0)
    picks = rng.integers(0, 200, size=50)
    fresh = make()
    assert decode([fresh[int(i)] for i in picks]) == [full[i] for i in picks]
    assert decode(make().get_batch(picks)) == [full[i] for i in picks]
    assert decode(make().get_batch(range(120, 200))) == full[120:]


def test_seed_changes_the_order_but_not_the_counts():
    comps = {"a": tagged(0, 100), "b": tagged(1, 100)}
    one = decode(MixtureDataset(comps, {"a": 1, "b": 1}, block_size=32, seed=1).get_batch(range(32)))
    two = decode(MixtureDataset(comps, {"a": 1, "b": 1}, block_size=32, seed=2).get_batch(range(32)))
    assert one != two
    assert sorted(one) == sorted(two)


def test_weight_schedule_changes_counts_at_the_stage_starts():
    comps = {"a": tagged(0, 1000), "b": tagged(1, 1000)}
    schedule = [(0, {"a": 1.0}), (20, {"a": 1, "b": 1}), (40, {"b": 3, "a": 1})]
    mix = MixtureDataset(comps, schedule, block_size=10, seed=4)
    got = decode(mix.get_batch(range(80)))
    expected = [[10, 0], [10, 0], [5, 5], [5, 5], *[block_counts([1, 3], 10).tolist()] * 4]
    for b in range(8):
        block = [c for c, _ in got[b * 10 : (b + 1) * 10]]
        assert [block.count(0), block.count(1)] == expected[b]
    assert sorted(r for c, r in got if c == 0) == list(range(10 + 10 + 5 + 5 + 4 * 3))
    assert sorted(r for c, r in got if c == 1) == list(range(5 + 5 + 4 * 7))


@pytest.mark.parametrize(
    ("schedule", "match"),
    [
        ([(10, {"a": 1})], "must start at index 0"),
        ([(0, {"a": 1}), (15, {"a": 1})], "multiple of block_size"),
        ([(0, {"a": 1}), (0, {"a": 1})], "increase strictly"),
        ([(0, {"a": 1}), (10, {"z": 1})], r"stage 1 .*unknown component\(s\) \['z'\]"),
        ([(0, {"a": 0})], "stage 0 .*positive"),
        ([], "empty"),
    ],
)
def test_bad_schedules_are_reported(schedule, match):
    with pytest.raises(ValueError, match=match):
        MixtureDataset({"a": tagged(0, 5)}, schedule, block_size=10)


def naive_length(mix: MixtureDataset, lengths: list[int], limit: int = 10_000) -> int:
    comp, local = mix.component_of(range(limit))
    for i in range(limit):
        if local[i] >= lengths[comp[i]]:
            return i
    return limit


def test_error_strategy_ends_at_the_first_missing_example():
    comps = {"a": tagged(0, 37), "b": tagged(1, 100)}
    mix = MixtureDataset(comps, {"a": 0.7, "b": 0.3}, block_size=10, seed=9, stop_strategy="error")
    n = naive_length(mix, [37, 100])
    assert len(mix) == n
    assert mix.is_finished
    got = decode(mix.get_batch(range(n)))
    assert sorted(r for c, r in got if c == 0) == list(range(37))
    assert [r for c, r in got if c == 0] == list(range(37))  # each component is read in order
    with pytest.raises(IndexError, match=rf"index {n} needs example 3[7-9] of component 'a', which has 37 examples"):
        mix.get_batch(range(n + 10))


def test_restart_strategy_cycles_finished_components():
    comps = {"a": tagged(0, 7), "b": tagged(1, 1000)}
    mix = MixtureDataset(comps, {"a": 0.5, "b": 0.5}, block_size=8, seed=0)
    comp, local = mix.component_of(range(64))
    got = decode(mix.get_batch(range(64)))
    n = [7, 1000]
    assert got == [(int(c), int(k) % n[c]) for c, k in zip(comp, local)]
    assert sum(1 for c, _ in got if c == 0) == 32  # a cycled more than 4 times


def test_growing_component_limits_and_waits():
    a = tagged(0, 5, finished=False)
    b = tagged(1, 1000)
    mix = MixtureDataset({"a": a, "b": b}, {"a": 1, "b": 1}, block_size=4, seed=3)
    assert len(mix) == naive_length(mix, [5, 1000])
    assert not mix.is_finished
    target = 40
    assert not mix.wait_for_length(target, timeout=0.01)

    def grow() -> None:
        a.append([[i] for i in range(5, 30)])

    async def read():
        timer = threading.Timer(0.05, grow)
        timer.start()
        return await mix.get_batch_async(range(target), timeout=10)

    got = decode(asyncio.run(read()))
    comp, local = mix.component_of(range(target))
    assert got == list(zip(comp.tolist(), local.tolist()))
    assert len(mix) >= target
    a.finish()
    assert len(mix) == sys.maxsize
    assert mix.is_finished


def test_reading_a_not_yet_committed_example_says_so():
    a = tagged(0, 2, finished=False)
    mix = MixtureDataset({"a": a}, {"a": 1}, block_size=4)
    assert len(mix) == 2
    assert [int(ex["input_ids"][0]) for ex in mix.get_batch([1, 0])] == [1, 0]  # one component: identity
    with pytest.raises(IndexError, match="index 2 needs example 2 of component 'a', which has 2 examples \\(still b"):
        mix[2]
