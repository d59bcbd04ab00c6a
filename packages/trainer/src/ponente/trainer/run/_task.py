"""The :class:`Task`: what a training run trains (the model, its batches, its loss, evaluation and exports).

A :class:`~ponente.trainer.run.Run` calls these methods, in the order its ``train`` reads top to bottom; a task
holds its resolved configuration and implements them. Language-model pre-training, SFT and LoRA
(:mod:`ponente.trainer.tasks.lm`, :mod:`ponente.trainer.tasks.lora`) and Whisper speech recognition
(:mod:`ponente.trainer.tasks.asr`) are tasks; a new kind of training is one new subclass.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ._evaluation import Evaluator

if TYPE_CHECKING:
    import numpy as np

    from ponente.trainer.optim import OptimizerConfig
    from ponente.trainer.trainer import Trainer, TrainerConfig

    from ._provenance import RunRecord

__all__ = ["RunContext", "Task", "TaskConfig"]


class TaskConfig(Protocol):
    """The sections every training entry point's config has (``TrainLmConfig``, ``TrainAsrConfig``, ...)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def data(self) -> Any: ...

    @property
    def trainer(self) -> TrainerConfig: ...

    @property
    def optimizer(self) -> OptimizerConfig: ...

    @property
    def data_seed(self) -> int | None: ...


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What the run hands :meth:`Task.evaluator`, :meth:`Task.hooks` and :meth:`Task.finish` once training is ready.

    Attributes:
        trainer: the trainer.
        tracker: the run's tracker.
        record: the run record (``run_id``, ``run_dir``).
        validation: the validation sets by name.
        task: the task the run trains.
        state: the state training starts from (the initial state, with pretrained weights or a restored
            checkpoint), e.g. for a task that samples from the current model; read it in :meth:`Task.hooks` only: the
            first training step donates its buffers (None where no run made the context).
    """

    trainer: Trainer
    tracker: Any
    record: RunRecord
    validation: Mapping[str, Any]
    task: Task
    state: Any = None

    def eval_model(self, model: Any) -> Any:
        """The model as evaluation sees it: :meth:`Task.eval_model`, in the trainer's compute dtype."""
        return self.trainer.mp.cast_to_compute(self.task.eval_model(model))


class Task(abc.ABC):
    """What a run trains: the methods :meth:`ponente.trainer.run.Run.train` calls, and the config it runs.

    Subclasses set :attr:`config` (the resolved configuration: the one the run records, so a checkpoint says
    which model it holds) and implement the abstract methods; the others have the defaults of a plain run.

    Attributes:
        config: the entry point's resolved configuration (``data``, ``trainer``, ``optimizer``, ``data_seed``
            sections; a ``model`` section holds the model as trained).
        pretrained_key: the config key that names the pretrained weights, for error messages.
        export_every: also :meth:`export` every this many steps, to ``"step-N"`` subfolders (None: only at the end).
        log_parameter_counts: log ``parameter_count``, ``trainable_parameter_count`` and ``fraction_trainable``.
    """

    config: TaskConfig
    pretrained_key: str = "initialize_from_hf"
    export_every: int | None = None
    log_parameter_counts: bool = False

    @abc.abstractmethod
    def build_model(self, key: Any) -> Any:
        """A freshly initialized model (``model_init`` of ``Trainer.initial_state``)."""

    @abc.abstractmethod
    def loss(self, model: Any, batch: Any, *, key: Any) -> Any:
        """The training loss of ``model`` on ``batch`` (``loss_fn`` of the :class:`~ponente.trainer.trainer.Trainer`:
        a scalar, or ``(loss, {name: metric})``); ``key`` is the step's PRNG key (None when evaluating)."""

    @abc.abstractmethod
    def make_batch(self, rows: Mapping[str, np.ndarray]) -> Any:
        """NumPy rows of the datasets (``{field: [rows, ...]}``) to the named batch the loss reads; it carries a
        ``loss_mask`` (the weight of a batch in evaluation)."""

    @abc.abstractmethod
    def placeholder_rows(self, count: int) -> dict[str, np.ndarray]:
        """Zeros in the layout of ``count`` dataset rows, to compile the training step before the data arrives."""

    @abc.abstractmethod
    def datasets(self, seed: int, batch_size: int) -> tuple[Any, dict[str, Any]]:
        """``(train_set, {name: validation_set})``; called in a background thread once the caches started."""

    def flops_per_token(self) -> float | None:
        """Forward FLOPs per token of the model, for MFU (None: no MFU)."""
        return None

    def trainable(self) -> Any:
        """Which parts of the model train (``Trainer.initial_state``'s ``is_trainable``; True: every parameter)."""
        return True

    def after_update(self, model: Any, extra: Mapping[str, Any]) -> Any:
        """The model after an optimizer step, changed outside the gradient from the loss function's extra outputs
        (``Trainer``'s ``after_update``; default: unchanged)."""
        return model

    def pretrained_model(self, mp: Any) -> Any | None:
        """The weights that start a fresh run, in ``mp``'s parameter dtype (None: the built model); not called when
        ``trainer.initialize_from`` is set (and a resumed run replaces them)."""
        return None

    def eval_model(self, model: Any) -> Any:
        """The model the loss sees when evaluating, before the cast to the compute dtype (default: ``model``)."""
        return model

    def evaluator(self, context: RunContext) -> Evaluator:
        """The evaluation run every ``trainer.steps_per_eval`` steps (default: the loss on each validation set)."""
        trainer = context.trainer
        return Evaluator(trainer, context.validation, trainer.config.max_eval_batches, make_batch=self.make_batch)

    def hooks(self, context: RunContext) -> list[Any]:
        """More trainer hooks (``Hook`` objects or functions of a ``StepInfo``; default: none)."""
        return []

    def export(self, model: Any, subfolder: str | None) -> dict[str, str]:
        """Write the exports of ``model`` and return ``{what: where}``; ``subfolder`` is ``"step-N"`` during the
        run, None for the final export (default: nothing)."""
        return {}

    def finish(self, state: Any, context: RunContext) -> str | None:
        """Called after the final export of a run that was not stopped; returns the sample text (default: none)."""
        return None
