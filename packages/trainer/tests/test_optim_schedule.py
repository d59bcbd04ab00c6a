"""Learning-rate schedules against a hand-written Python formula, step by step."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ponente.trainer.optim import build_lr_schedule, frac_or_steps

LR = 0.3


def _steps(value: float | int, total: int) -> int:
    return int(value * total) if value <= 1 else int(value)


def _reference(step: int, *, n: int, shape: str, warmup, decay, rewarmup, cooldown, ratio: float, cycles) -> float:
    """The schedule written out directly: cycles of warmup/stable/decay, then a linear cooldown."""
    min_lr = LR * ratio
    cool = _steps(cooldown, n) if cooldown is not None else 0
    main = n - cool
    if isinstance(cycles, tuple) and cycles[0] == "length":
        length = _steps(cycles[1], main)
        ends = [*range(length, main - length + 1, length), main]  # the last cycle takes the remainder
    elif cycles is None:
        ends = [main]
    elif isinstance(cycles, int):
        ends = [int(main / cycles * (i + 1)) for i in range(cycles - 1)] + [main]
    else:
        ends = [*cycles, main] if cycles[-1] != main else list(cycles)

    def decayed(t: int, d: int, w: int) -> float:
        if shape == "constant" or d == 0:
            return LR
        if shape == "cosine":
            t = min(t, d)
            return min_lr + (LR - min_lr) * 0.5 * (1 + math.cos(math.pi * t / d))
        if shape in ("linear", "wsd"):
            t = min(t, d)
            return LR + (min_lr - LR) * t / d
        if shape == "inv_sqrt":
            return max(LR * min(1.0, 1.0 / math.sqrt(max(t + w, 1) / 10000.0)), min_lr)
        assert shape == "inv"
        return max(LR * min(1.0, 1.0 / ((1 / ratio - 1) * max(t, 1) / d + 1)), min_lr)

    previous, start = 0.0, 0
    for c, end in enumerate(ends):
        length = end - start
        w = _steps(warmup if c == 0 else rewarmup, length)
        d = _steps(decay, length) if decay is not None else length - w
        s = length - w - d
        if s < 0:
            raise ValueError("the phases exceed the cycle")
        if step < end or (c == len(ends) - 1 and cool == 0):
            if step < start + w:
                return previous + (LR - previous) * (step - start) / w
            if step < start + w + s:
                return LR
            return decayed(step - start - w - s, d, w)
        previous, start = decayed(d, d, w), end
    t = min(step - main, cool)
    return previous + (min_lr - previous) * t / cool


def _check(n: int, **kw) -> None:
    steps = np.arange(n + 3)
    try:
        want = np.array([_reference(int(s), n=n, **kw) for s in steps])
    except ValueError:  # warmup + decay longer than a cycle: ours must refuse too
        with pytest.raises(ValueError, match="exceed cycle"):
            _build(n, **kw)
        return
    np.testing.assert_allclose(np.asarray(_build(n, **kw)(steps)), want, rtol=2e-5, atol=2e-6)


def _build(n: int, **kw):
    return build_lr_schedule(
        learning_rate=LR,
        num_train_steps=n,
        lr_schedule=kw["shape"],
        warmup=kw["warmup"],
        decay=kw["decay"],
        rewarmup=kw["rewarmup"],
        cooldown=kw["cooldown"],
        min_lr_ratio=kw["ratio"],
        cycles=None if isinstance(kw["cycles"], tuple) else kw["cycles"],
        cycle_length=kw["cycles"][1] if isinstance(kw["cycles"], tuple) else None,
    )


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(20, 120),
    shape=st.sampled_from(["constant", "cosine", "linear", "inv_sqrt", "inv", "wsd"]),
    warmup=st.one_of(st.sampled_from([0.0, 0.05, 0.2]), st.integers(2, 5)),
    decay=st.one_of(st.none(), st.sampled_from([0.3, 0.5]), st.integers(3, 6)),
    rewarmup=st.sampled_from([0.0, 0.1, 2]),
    cooldown=st.one_of(st.none(), st.sampled_from([0.1]), st.integers(2, 4)),
    ratio=st.sampled_from([0.1, 0.5]),
    cycles=st.one_of(
        st.none(), st.integers(1, 3), st.tuples(st.just("length"), st.sampled_from([0.3, 0.5, 0.34, 15, 40]))
    ),
)
def test_schedule_matches_python_formula(n, shape, warmup, decay, rewarmup, cooldown, ratio, cycles):
    if shape == "wsd" and decay is None:
        decay = 0.25
    _check(
        n, shape=shape, warmup=warmup, decay=decay, rewarmup=rewarmup, cooldown=cooldown, ratio=ratio, cycles=cycles
    )


def test_explicit_cycle_ends_and_hand_values():
    _check(60, shape="linear", warmup=4, decay=None, rewarmup=2, cooldown=None, ratio=0.0, cycles=[20, 45])
    sched = build_lr_schedule(learning_rate=1.0, num_train_steps=100, lr_schedule="wsd", warmup=10, decay=0.2)
    # warmup 0..10, stable to 80, linear to 0.0 (min_lr_ratio=0) over the last 20
    assert [round(float(sched(s)), 4) for s in (0, 5, 10, 50, 80, 90, 100)] == [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]


def test_cycle_lengths_list():
    common = {"learning_rate": 1.0, "num_train_steps": 50, "lr_schedule": "linear", "rewarmup": 2}
    a = build_lr_schedule(**common, cycle_length=[20, 20])
    b = build_lr_schedule(**common, cycles=[20, 40])
    np.testing.assert_array_equal(np.asarray(a(np.arange(55))), np.asarray(b(np.arange(55))))
    with pytest.raises(ValueError, match="at most one of cycles and cycle_length"):
        build_lr_schedule(learning_rate=1.0, num_train_steps=50, cycles=2, cycle_length=10)


def test_inv_sqrt_decays_after_timescale():
    sched = build_lr_schedule(learning_rate=1.0, num_train_steps=100_000, lr_schedule="inv_sqrt", warmup=0)
    assert float(sched(5_000)) == pytest.approx(1.0)
    assert float(sched(40_000)) == pytest.approx(0.5, rel=1e-5)


def test_frac_or_steps():
    assert frac_or_steps(0.25, 200, key="warmup") == 50
    assert frac_or_steps(1, 200, key="warmup") == 200
    assert frac_or_steps(30, 200, key="warmup") == 30
    with pytest.raises(ValueError, match=r"optimizer\.warmup"):
        frac_or_steps(1.5, 200, key="warmup")
    with pytest.raises(ValueError, match=r"optimizer\.decay"):
        frac_or_steps(-1, 200, key="decay")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr_schedule": "exponential"}, "unknown schedule 'exponential'"),
        ({"lr_schedule": "wsd"}, "'wsd' needs optimizer.decay"),
        ({"warmup": 60, "decay": 50}, "exceed cycle 0"),
        ({"cycles": [50, 30]}, "optimizer.cycles"),
        ({"cooldown": 100}, "leaves no steps"),
    ],
)
def test_schedule_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_lr_schedule(learning_rate=1.0, num_train_steps=100, **kwargs)
