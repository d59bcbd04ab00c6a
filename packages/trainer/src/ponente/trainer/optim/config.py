"""``OptimizerConfig``: the family of optimizer configs selected by ``type:`` and their shared fields."""

from __future__ import annotations

import abc
import dataclasses
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import optax

from ponente.trainer.config._registry import Registrable

from .metrics import track_norms
from .schedule import LR_SCHEDULES, build_lr_schedule, frac_or_steps
from .skip_step import skip_bad_steps
from .wd_mask import weight_decay_mask

__all__ = ["OptimizerConfig"]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Registrable, abc.ABC):
    """Base of the optimizer configs (``type: adam | lion | sophia-h | muon``), with Levanter's shared keys.

    ``build(num_train_steps)`` returns an ``optax.GradientTransformationExtraArgs`` whose ``update`` takes
    ``(grads, state, params, loss=..., obj_fn=..., key=...)``; the chain is, from the outside in:
    norm tracking (:func:`optimizer_metrics` reads it), skip-step (if ``skip_bad_steps``), then the
    optimizer with its injected learning-rate schedule, gradient clipping first and update-norm clipping last.

    Attributes:
        learning_rate: the peak learning rate.
        weight_decay: decoupled weight decay (multiplied by the learning rate), applied where the mask says.
        beta1: first-moment decay (momentum).
        beta2: second-moment decay.
        epsilon: the denominator's epsilon.
        max_grad_norm: clip the global gradient norm to this before the optimizer; None or 0: no clipping.
        min_lr_ratio: the final learning rate as a fraction of ``learning_rate``.
        warmup: linear warmup, a fraction of the run (float ``<= 1``) or a number of steps.
        decay: the decay phase of each cycle (fraction or steps); None: everything after warmup.
        rewarmup: the warmup of cycles after the first (fraction of the cycle or steps).
        cooldown: a final linear decay to ``min_lr`` over this part of the run (fraction or steps), as
            Levanter's deprecated key; None: none.
        lr_schedule: the decay shape, one of ``constant``, ``cosine``, ``linear``, ``inv_sqrt``, ``inv``, ``wsd``.
        cycles: None (one cycle), a number of equal cycles, or the steps at which cycles end.
        cycle_length: instead of ``cycles``: every cycle's length (fraction or steps) or the list of lengths.
        weight_decay_modules: a regex (``re.match``) or a list of regexes (``re.search``) over parameter
            paths (``transformer.h.stacked.mlp.c_fc.weight`` or ``Linear.weight``) whose matches are decayed.
        default_weight_decay_mask: whether unmatched parameters follow the default rule (decay all but norms,
            embeddings and biases); None: when ``weight_decay_modules`` is None.
        skip_bad_steps: skip steps whose loss or gradient norm is non-finite or above the rolling
            ``mean + skip_step_sigma * std``.
        skip_step_window: the number of recent steps the rolling statistics cover.
        skip_step_sigma: how many standard deviations above the mean make a spike.
        skip_step_warmup: how many steps to observe before detecting spikes.
        max_update_norm: clip the global norm of the final update to this; None: no clipping.
    """

    default_choice: ClassVar[str | None] = "adam"

    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0
    min_lr_ratio: float = 0.1
    warmup: float = 0.01
    decay: float | None = None
    rewarmup: float = 0.0
    cooldown: float | None = None
    lr_schedule: str = "cosine"
    cycles: int | tuple[int, ...] | None = None
    cycle_length: float | tuple[int, ...] | None = None
    weight_decay_modules: tuple[str, ...] | str | None = None
    default_weight_decay_mask: bool | None = None
    skip_bad_steps: bool = False
    skip_step_window: int = 100
    skip_step_sigma: float = 6.0
    skip_step_warmup: int = 10
    max_update_norm: float | None = None

    def __post_init__(self) -> None:
        """Checks the fields a user can get wrong before anything is built.

        Raises:
            ValueError: naming the offending key, for an unknown ``lr_schedule``, a bad fraction/step count,
                a negative learning rate or weight decay, or bad skip-step settings.
        """
        name = self.choice_name or type(self).__name__
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"optimizer.lr_schedule ({name}): unknown schedule {self.lr_schedule!r}; "
                f"expected one of {list(LR_SCHEDULES)}"
            )
        for key in ("warmup", "decay", "rewarmup", "cooldown"):
            value = getattr(self, key)
            if value is not None:
                frac_or_steps(value, 1, key=key)
        for key in ("learning_rate", "weight_decay", "min_lr_ratio"):
            if getattr(self, key) < 0:
                raise ValueError(f"optimizer.{key} ({name}): must be >= 0, found {getattr(self, key)}")
        _check_regexes("weight_decay_modules", self.weight_decay_modules)
        if self.skip_step_window < 1 or self.skip_step_warmup < 1 or self.skip_step_sigma < 0:
            raise ValueError(
                f"optimizer ({name}): expected skip_step_window >= 1, skip_step_warmup >= 1, skip_step_sigma >= 0; "
                f"found {self.skip_step_window}, {self.skip_step_warmup}, {self.skip_step_sigma}"
            )

    def lr_scheduler(self, num_train_steps: int) -> optax.Schedule:
        """The learning rate as a function of the step (see :func:`build_lr_schedule`).

        Args:
            num_train_steps: the length of the run.

        Returns:
            The schedule.
        """
        return build_lr_schedule(
            learning_rate=self.learning_rate,
            num_train_steps=num_train_steps,
            lr_schedule=self.lr_schedule,
            warmup=self.warmup,
            decay=self.decay,
            rewarmup=self.rewarmup,
            cooldown=self.cooldown,
            min_lr_ratio=self.min_lr_ratio,
            cycles=self.cycles,
            cycle_length=self.cycle_length,
        )

    def build_weight_decay_mask(self) -> Callable[[Any], Any]:
        """The weight-decay mask as a function of the parameter tree (see :func:`weight_decay_mask`)."""
        modules, use_default = self.weight_decay_modules, self.default_weight_decay_mask
        return lambda params: weight_decay_mask(params, modules=modules, use_default=use_default)

    def _schedules(self, num_train_steps: int) -> dict[str, optax.Schedule]:
        """The injected hyperparameter schedules, keyword arguments of :meth:`_optimizer`."""
        return {"learning_rate": self.lr_scheduler(num_train_steps)}

    @abc.abstractmethod
    def _optimizer(self, learning_rate: Any) -> optax.GradientTransformation:
        """The optimizer at a given learning rate (a traced scalar), without clipping or skip-step."""

    def build(self, num_train_steps: int) -> optax.GradientTransformationExtraArgs:
        """Builds the optimizer for a run of ``num_train_steps`` steps.

        Args:
            num_train_steps: the length of the run (the schedule's horizon).

        Returns:
            The optimizer; ``update(grads, state, params, loss=..., obj_fn=..., key=...)``.
        """

        def factory(**hyperparams: Any) -> optax.GradientTransformation:
            parts = []
            if self.max_grad_norm:
                parts.append(optax.clip_by_global_norm(self.max_grad_norm))
            parts.append(self._optimizer(**hyperparams))
            if self.max_update_norm:
                parts.append(optax.clip_by_global_norm(self.max_update_norm))
            return optax.chain(*parts)

        schedules = self._schedules(num_train_steps)
        # inject_hyperparams reads the factory's signature: give it the schedules' names explicitly
        inner: optax.GradientTransformation = optax.inject_hyperparams(_named_factory(factory, list(schedules)))(
            **schedules
        )
        if self.skip_bad_steps:
            inner = skip_bad_steps(
                inner, window=self.skip_step_window, sigma=self.skip_step_sigma, warmup=self.skip_step_warmup
            )
        return track_norms(inner)


def _check_regexes(key: str, patterns: str | Sequence[str] | None) -> None:
    """Raises a ValueError naming ``optimizer.<key>`` if one of ``patterns`` is not a valid regular expression."""
    for pattern in [patterns] if isinstance(patterns, str) else list(patterns or ()):
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"optimizer.{key}: invalid regular expression {pattern!r}: {err}") from err


def _named_factory(
    factory: Callable[..., optax.GradientTransformation], names: list[str]
) -> Callable[..., optax.GradientTransformation]:
    """``factory`` with an explicit keyword signature ``(name1, name2, ...)`` (inject_hyperparams inspects it)."""

    def named(*args: Any, **kwargs: Any) -> optax.GradientTransformation:
        bound = dict(zip(names, args))
        bound.update(kwargs)
        return factory(**bound)

    named.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    )
    return named
