"""Hooks: functions the training loop calls every N steps with a :class:`StepInfo`.

A hook sees the state after a step, the step's metrics and timings. Checkpointing, evaluation,
logging to a tracker and custom diagnostics are all hooks, so the loop itself imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .state import TrainerState

__all__ = ["Hook", "StepInfo", "as_hook"]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook learns about the step that just finished.

    Attributes:
        state: the training state after the step (its ``step`` is :attr:`step`).
        step: the number of completed steps (1 after the first step).
        loss: the step's training loss.
        metrics: every metric of the step as Python floats (loss, grad_norm, learning_rate,
            throughput, MFU where known, timings).
        step_seconds: wall-clock seconds of the step (compute, until the loss was on the host).
        data_seconds: seconds spent waiting for the batch before the step.
        final: True for the extra call made when training ends (see :class:`Hook`).
    """

    state: TrainerState
    step: int
    loss: float
    metrics: Mapping[str, float]
    step_seconds: float
    data_seconds: float
    final: bool = False


@dataclasses.dataclass(frozen=True)
class Hook:
    """A function called with a :class:`StepInfo` after every ``every``-th step.

    The loop calls ``fn(info)`` when ``info.step % every == 0``. When training ends (all steps done
    or a stop was requested), every hook that did not run at the last completed step runs once more
    with ``info.final = True``, so a checkpoint or an evaluation always sees the final state.

    Attributes:
        fn: the function.
        every: the period in steps (>= 1).
        name: a name for messages (default: the function's name).

    Raises:
        ValueError: if ``every`` < 1.

    Example:
        >>> seen = []
        >>> hook = Hook(lambda info: seen.append(info.step), every=10)
        >>> hook.due(20), hook.due(25)
        (True, False)
    """

    fn: Callable[[StepInfo], Any]
    every: int = 1
    name: str | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"Hook {self.label!r}: every must be >= 1, got {self.every}")

    @property
    def label(self) -> str:
        """The hook's name, or its function's name."""
        return self.name or str(getattr(self.fn, "__name__", repr(self.fn)))

    def due(self, step: int) -> bool:
        """Whether the hook runs after completed step ``step``.

        Args:
            step: the number of completed steps.

        Returns:
            True if ``step`` is a positive multiple of :attr:`every`.
        """
        return step > 0 and step % self.every == 0


def as_hook(hook: Hook | Callable[[StepInfo], Any]) -> Hook:
    """A :class:`Hook`, wrapping a bare function as a hook called after every step.

    Args:
        hook: a hook or a function of a :class:`StepInfo`.

    Returns:
        The hook.

    Raises:
        TypeError: if ``hook`` is neither.
    """
    if isinstance(hook, Hook):
        return hook
    if callable(hook):
        return Hook(hook)
    raise TypeError(f"expected a Hook or a callable taking a StepInfo, got {type(hook).__name__}")
