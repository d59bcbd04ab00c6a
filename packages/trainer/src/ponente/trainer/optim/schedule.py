"""Learning-rate schedules: warmup, a stable phase, a decay of a chosen shape, cycles and a final cooldown.

The schedule follows Levanter's ``OptimizerConfig.lr_scheduler``: the run is split into cycles; each cycle
is ``[warmup] [stable] [decay]`` (the first cycle warms up from 0 over ``warmup``, later cycles re-warm
from where the previous decay ended over ``rewarmup``), and an optional ``cooldown`` tail decays linearly
from the last value to ``min_lr`` at the very end of the run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import optax

__all__ = ["LR_SCHEDULES", "build_lr_schedule", "frac_or_steps"]

LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear", "inv_sqrt", "inv", "wsd")
"""The names accepted by ``lr_schedule`` (the shape of the decay phase of each cycle)."""

_INV_SQRT_TIMESCALE = 10_000.0  # Levanter's inverse-sqrt timescale: peak until this step, then ∝ 1/sqrt(step)


def frac_or_steps(value: float | int, total: int, *, key: str) -> int:
    """Converts a fraction of ``total`` (a float in ``[0, 1]``) or a whole number of steps to steps.

    Args:
        value: a fraction of the run (``0.1``: 10% of ``total``) or a number of steps (``500``).
        total: the number of steps the fraction refers to.
        key: the config key being converted, named in errors.

    Returns:
        The number of steps, ``int(value * total)`` for a fraction.

    Raises:
        ValueError: if ``value`` is negative, or above 1 without being a whole number.

    Example:
        >>> frac_or_steps(0.1, 1000, key="warmup"), frac_or_steps(50, 1000, key="warmup")
        (100, 50)
    """
    if isinstance(value, bool) or value < 0 or (value > 1 and float(value) % 1 != 0):
        raise ValueError(
            f"optimizer.{key}: expected a fraction of the run in [0, 1] or a whole number of steps, found {value!r}"
        )
    if value <= 1:  # as in Levanter, 1 (even written as an int) means the whole run
        return int(value * total)
    return int(value)


def _decay_shape(name: str, learning_rate: float, min_lr_ratio: float, steps: int, warmup: int) -> optax.Schedule:
    """The decay-phase schedule (counted from the start of the phase) for the shape ``name``."""
    min_lr = learning_rate * min_lr_ratio
    if name == "constant" or steps == 0:
        return optax.constant_schedule(learning_rate)
    if name == "cosine":
        return optax.cosine_decay_schedule(learning_rate, steps, alpha=min_lr_ratio)
    if name in ("linear", "wsd"):
        return optax.linear_schedule(learning_rate, min_lr, steps)
    if name == "inv_sqrt":

        def inv_sqrt(count: jnp.ndarray) -> jnp.ndarray:
            factor = jnp.minimum(1.0, 1.0 / jnp.sqrt(jnp.maximum(count + warmup, 1) / _INV_SQRT_TIMESCALE))
            return jnp.maximum(learning_rate * factor, min_lr)

        return inv_sqrt
    if name == "inv":
        if min_lr_ratio <= 0:
            raise ValueError(f"optimizer.lr_schedule 'inv' needs min_lr_ratio > 0, found {min_lr_ratio}")

        def inv(count: jnp.ndarray) -> jnp.ndarray:
            factor = 1.0 / ((1.0 / min_lr_ratio - 1.0) * jnp.maximum(count, 1) / steps + 1.0)
            return jnp.maximum(learning_rate * jnp.minimum(1.0, factor), min_lr)

        return inv
    raise ValueError(f"optimizer.lr_schedule: unknown schedule {name!r}; expected one of {list(LR_SCHEDULES)}")


def _cycle_ends(
    cycles: int | Sequence[int] | None, cycle_length: float | Sequence[int] | None, main_steps: int
) -> list[int]:
    """The step at which each cycle ends (the last is ``main_steps``)."""
    if cycles is not None and cycle_length is not None:
        raise ValueError("optimizer: set at most one of cycles and cycle_length")
    if isinstance(cycle_length, int | float):
        length = frac_or_steps(cycle_length, main_steps, key="cycle_length")
        if length < 1:
            raise ValueError(f"optimizer.cycle_length ({cycle_length}) is shorter than one step of {main_steps}")
        ends: list[int] = [i * length for i in range(1, main_steps // length)]  # the last cycle takes the rest
    elif cycle_length is not None:
        ends = [int(e) for e in itertools.accumulate(cycle_length)]
        if any(n < 1 for n in cycle_length) or (ends and ends[-1] > main_steps):
            raise ValueError(
                f"optimizer.cycle_length: expected positive cycle lengths summing to at most {main_steps}, "
                f"found {list(cycle_length)}"
            )
    elif cycles is None:
        ends = []
    elif isinstance(cycles, int):
        if isinstance(cycles, bool) or cycles < 1:
            raise ValueError(f"optimizer.cycles: expected a positive number of cycles, found {cycles}")
        ends = [int(main_steps / cycles * (i + 1)) for i in range(cycles - 1)]
    else:
        ends = [int(c) for c in cycles]
        if any(b <= a for a, b in zip([0, *ends], ends)) or (ends and ends[-1] > main_steps):
            raise ValueError(
                f"optimizer.cycles: expected increasing cycle end steps in (0, {main_steps}], found {list(cycles)}"
            )
    if not ends or ends[-1] != main_steps:
        ends.append(main_steps)
    return ends


def build_lr_schedule(
    *,
    learning_rate: float,
    num_train_steps: int,
    lr_schedule: str = "cosine",
    warmup: float | int = 0.0,
    decay: float | int | None = None,
    rewarmup: float | int = 0.0,
    cooldown: float | int | None = None,
    min_lr_ratio: float = 0.0,
    cycles: int | Sequence[int] | None = None,
    cycle_length: float | Sequence[int] | None = None,
) -> optax.Schedule:
    """Builds the learning rate as a function of the step.

    Each cycle is a linear warmup (from 0 in the first cycle, from the previous cycle's final value over
    ``rewarmup`` in later ones), a stable phase at ``learning_rate`` and a decay phase of shape
    ``lr_schedule`` towards ``learning_rate * min_lr_ratio``. Fractions (floats ``<= 1``) of ``warmup``,
    ``rewarmup`` and ``decay`` refer to the cycle's length; ``cooldown`` refers to the whole run.

    Args:
        learning_rate: the peak learning rate.
        num_train_steps: the length of the run.
        lr_schedule: the decay shape: ``constant`` (no decay), ``cosine``, ``linear``, ``inv_sqrt``
            (Levanter's: peak until step 10000, then ``∝ 1/sqrt(step)``), ``inv`` (``∝ 1/step``, reaching
            ``min_lr`` at the end of the decay) or ``wsd`` (warmup-stable-decay: linear decay over
            ``decay``, which must be set).
        warmup: the warmup of the first cycle (fraction or steps).
        decay: the decay phase of each cycle (fraction or steps); None: all of the cycle after warmup.
        rewarmup: the warmup of later cycles (fraction or steps).
        cooldown: a final linear decay to ``min_lr`` over this part of the run (fraction or steps), after
            the cycles; None: none.
        min_lr_ratio: the final learning rate as a fraction of ``learning_rate``.
        cycles: None (one cycle), a number of equal cycles, or the list of steps at which cycles end.
        cycle_length: instead of ``cycles``: the length of every cycle (fraction or steps; the last cycle
            takes the remainder), or the list of the cycles' lengths.

    Returns:
        An ``optax.Schedule``: step (int array) to learning rate.

    Raises:
        ValueError: for an unknown ``lr_schedule``, phases that do not fit in a cycle, ``wsd`` without
            ``decay``, both ``cycles`` and ``cycle_length``, or bad fractions/step counts (the message names
            the config key).

    Example:
        >>> sched = build_lr_schedule(learning_rate=1.0, num_train_steps=100, lr_schedule="linear", warmup=10)
        >>> tuple(round(float(sched(s)), 3) for s in (0, 5, 10, 55, 100))
        (0.0, 0.5, 1.0, 0.5, 0.0)
    """
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(
            f"optimizer.lr_schedule: unknown schedule {lr_schedule!r}; expected one of {list(LR_SCHEDULES)}"
        )
    if lr_schedule == "wsd" and decay is None:
        raise ValueError("optimizer.lr_schedule 'wsd' needs optimizer.decay (the length of the decay phase)")
    if num_train_steps < 1:
        raise ValueError(f"optimizer: num_train_steps must be positive, found {num_train_steps}")
    cooldown_steps = frac_or_steps(cooldown, num_train_steps, key="cooldown") if cooldown is not None else 0
    main_steps = num_train_steps - cooldown_steps
    if main_steps < 1:
        raise ValueError(f"optimizer.cooldown ({cooldown}) leaves no steps of a {num_train_steps}-step run")

    pieces: list[tuple[int, Callable[[jnp.ndarray], jnp.ndarray]]] = []  # (start step, schedule from that step)
    start = 0
    previous_end = 0.0
    last_value = learning_rate
    for cycle, end in enumerate(_cycle_ends(cycles, cycle_length, main_steps)):
        length = end - start
        if cycle == 0:
            warm = frac_or_steps(warmup, length, key="warmup")
        else:
            warm = frac_or_steps(rewarmup, length, key="rewarmup")
        decay_steps = frac_or_steps(decay, length, key="decay") if decay is not None else length - warm
        stable = length - warm - decay_steps
        if stable < 0:
            raise ValueError(
                f"optimizer: warmup ({warm} steps) + decay ({decay_steps} steps) exceed cycle {cycle} "
                f"({length} steps, {start}..{end})"
            )
        if warm > 0:
            pieces.append((start, optax.linear_schedule(previous_end, learning_rate, warm)))
        if stable > 0:
            pieces.append((start + warm, optax.constant_schedule(learning_rate)))
        shape = _decay_shape(lr_schedule, learning_rate, min_lr_ratio, decay_steps, warm)
        pieces.append((start + warm + stable, shape))
        last_value = float(shape(jnp.asarray(decay_steps)))
        previous_end = last_value
        start = end
    if cooldown_steps > 0:
        pieces.append((main_steps, optax.linear_schedule(last_value, learning_rate * min_lr_ratio, cooldown_steps)))

    if len(pieces) == 1:
        return pieces[0][1]
    return optax.join_schedules([fn for _, fn in pieces], [s for s, _ in pieces[1:]])
