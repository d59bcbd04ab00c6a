"""The model-agnostic run: from a :class:`RunTask` (what to build, feed and score) to a :class:`TrainResult`.

Every training entry point shares these steps: run record and trackers, data caches, trainer and state, pretrained
weights, resume, training with evaluation and checkpoints, the final checkpoint, exports and summary. What differs
between model families (a language model, Whisper) is said by a :class:`RunTask`: how to build the model, the loss,
how dataset rows become a batch, the datasets, the evaluation, the hooks and the exports. The language-model
run (:func:`~ponente.trainer.run.train_language_model`) and the speech run
(:func:`~ponente.trainer.run.train_speech_model`) each make a task and call :func:`run_task`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ._data import build_caches_once
from ._devices import resolve_train_batch_size
from ._evaluation import Evaluator
from ._finish import final_checkpoint, finish_trackers
from ._outputs import output_locations
from ._pretrained import replace_model
from ._provenance import RunRecord, with_run_id
from ._restore import restore
from ._result import TrainResult
from ._signals import stop_exit_code
from ._startup import Startup
from ._training import train_on

if TYPE_CHECKING:
    import numpy as np

    from ponente.trainer.optim import OptimizerConfig
    from ponente.trainer.trainer import Trainer, TrainerConfig

__all__ = ["Exporter", "RunContext", "RunTask", "TaskRunConfig", "run_task"]

Exporter = Callable[[Any, str | None], Mapping[str, str]]
"""``export(model, subfolder) -> {what: where}``: writes the run's exports of ``model``; ``subfolder`` is
``"step-N"`` for the exports during the run and None for the final one."""


class TaskRunConfig(Protocol):
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
    """What the run hands a task's :attr:`RunTask.hooks` and :attr:`RunTask.finish` once training is ready.

    Attributes:
        trainer: the trainer.
        tracker: the run's tracker.
        record: the run record (``run_id``, ``run_dir``).
        validation: the validation sets by name.
        eval_model: ``eval_model(model)``: the model as evaluation sees it (in the compute dtype).
    """

    trainer: Trainer
    tracker: Any
    record: RunRecord
    validation: Mapping[str, Any]
    eval_model: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class RunTask:
    """What a model family adds to the shared run (:func:`run_task`).

    Attributes:
        model_config: the model config the run records in the config's ``model`` section (if it has one).
        build: ``build(key) -> model``: a freshly initialized model (``model_init`` of ``Trainer.initial_state``).
        loss_fn: ``loss_fn(model, batch, *, key)``, as :class:`~ponente.trainer.trainer.Trainer` takes it.
        make_batch: ``make_batch(rows) -> batch``: NumPy rows of the datasets (``{field: [rows, ...]}``) to the
            named batch the loss reads; it must carry a ``loss_mask`` (the weight of a batch in evaluation).
        placeholder_rows: ``placeholder_rows(n) -> rows``: zeros in the layout of ``n`` dataset rows, to compile the
            training step before the data arrives.
        datasets: ``datasets(seed, batch_size) -> (train_set, {name: validation_set})``; called in a background
            thread once the caches started.
        is_trainable: which parts of the model train (``Trainer.initial_state``'s ``is_trainable``).
        flops_per_token: forward FLOPs per token of the model, for MFU (None: no MFU).
        pretrained: ``pretrained(mp) -> model``: the weights that start a fresh run, in ``mp``'s parameter dtype
            (None: the built model); ignored when ``trainer.initialize_from`` is set or the run resumes.
        pretrained_key: the config key that named the pretrained weights, for error messages.
        evaluator: ``evaluator(trainer, validation, max_batches, context)``: the evaluation run every
            ``trainer.steps_per_eval`` steps; an object with ``__call__(state) -> {name: value}`` and ``last``
            (None: :class:`Evaluator` with :attr:`make_batch`).
        hooks: ``hooks(context) -> [hook, ...]``: more trainer hooks (None: none).
        export: writes the exports of a model (see :data:`Exporter`; None: nothing to export).
        export_every: also export every this many steps, to ``"step-N"`` subfolders (None: only at the end).
        finish: ``finish(state, context) -> sample``: called after the final export of a run that was not
            stopped; its text becomes :attr:`TrainResult.sample` (None: nothing).
        log_parameter_counts: log ``parameter_count``, ``trainable_parameter_count`` and ``fraction_trainable``.
        eval_model: ``eval_model(model)``: the model evaluation sees, before the cast to the compute dtype (None:
            the model as it is).
    """

    model_config: Any
    build: Callable[[Any], Any]
    loss_fn: Callable[..., Any]
    make_batch: Callable[[Mapping[str, np.ndarray]], Any]
    placeholder_rows: Callable[[int], dict[str, np.ndarray]]
    datasets: Callable[[int, int], tuple[Any, dict[str, Any]]]
    is_trainable: Any = True
    flops_per_token: float | None = None
    pretrained: Callable[[Any], Any] | None = None
    pretrained_key: str = "initialize_from_hf"
    evaluator: Callable[[Trainer, Mapping[str, Any], int | None, RunContext], Any] | None = None
    hooks: Callable[[RunContext], list[Any]] | None = None
    export: Exporter | None = None
    export_every: int | None = None
    finish: Callable[[Any, RunContext], str | None] | None = None
    log_parameter_counts: bool = False
    eval_model: Callable[[Any], Any] | None = None


def run_task(config: TaskRunConfig, task: RunTask, startup: Startup) -> TrainResult:
    """Train the task's model on ``config.data`` as ``config.trainer`` says, and report what the run produced.

    Call :func:`~ponente.trainer.run.start_run` first (``startup`` times the phases since the process started). A
    run whose config has a ``model`` section records ``task.model_config`` there.

    Args:
        config: the entry point's resolved configuration.
        task: what the entry point trains, feeds, evaluates and exports.
        startup: the start-up timing of this process.

    Returns:
        What the run produced.

    Raises:
        ValueError: for a configuration that cannot run (bad sizes, a resume that changes a field that must
            stay fixed, a checkpoint whose shapes do not match the model, ...).
        FileNotFoundError: if ``trainer.load_checkpoint`` is true and there is no checkpoint.
    """
    import jax

    from ponente.trainer.callbacks import as_hook
    from ponente.trainer.tracker import init_trackers
    from ponente.trainer.trainer import Trainer

    data = config.data
    config = with_run_id(config)
    config = dataclasses.replace(config, trainer=resolve_train_batch_size(config.trainer, jax.device_count()))
    if "model" in config.__dataclass_fields__:
        config = dataclasses.replace(config, model=task.model_config)
    tcfg = config.trainer
    record = RunRecord.of(config)
    startup.mark("config and tokenizer")

    # trackers are created before any other thread starts: the tensorboard tracker hides torch while it imports
    tracker = init_trackers(tcfg.tracker, record.run_id)
    startup.mark("trackers")
    # Until the first step, four things proceed at once (XLA compiles and tokenizers release the GIL): the
    # run record (git, pip freeze), the caches (built in their own threads; the datasets wait for the first
    # rows), the compilation of the training step, and on this thread the initial state and checkpoint.
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="ponente-startup") as pool:
        recorded = startup.background(pool, "run record", record.write, tracker)
        checkpointer = tcfg.checkpointer.create(record.run_id, metadata=record.provenance)
        outputs = output_locations(record, checkpoints=checkpointer.run_path, trackers=tcfg.tracker)
        data_seed = tcfg.seed if config.data_seed is None else config.data_seed
        build_caches_once(data, tcfg)
        data_ready = startup.background(
            pool, "datasets (first cache rows)", task.datasets, data_seed, tcfg.train_batch_size
        )
        trainer = Trainer(
            tcfg,
            config.optimizer.build(tcfg.num_train_steps),
            task.loss_fn,
            lr_schedule=config.optimizer.lr_scheduler(tcfg.num_train_steps),
            log_fn=lambda metrics, step: tracker.log(metrics, step=step),
            flops_per_token=task.flops_per_token,
        )
        rows = trainer.process_batch_rows()  # this process loads only the rows of its own devices
        state = trainer.initial_state(task.build, is_trainable=task.is_trainable)
        startup.mark("model and optimizer init")
        # the initial state's shapes and shardings are those of the loaded weights and of any checkpoint restored
        placeholder = task.make_batch(task.placeholder_rows(rows.stop - rows.start))
        step_compiled: Future[Any] = startup.background(
            pool, "train step compile", trainer.compile_step, state, placeholder
        )
        if task.pretrained is not None and tcfg.initialize_from is None:
            state = replace_model(state, task.pretrained(trainer.mp), what=task.pretrained_key)
            startup.mark("hugging face weights")
        state, resumed_from = restore(state, tcfg, checkpointer, record.provenance)
        startup.mark("checkpoint restore")
        recorded.result()
        # the log then holds each step once: records a killed run wrote after its last checkpoint are dropped
        tracker.resume_from(int(state.step))
        if task.log_parameter_counts:
            tracker.log_summary(_parameter_counts(state))
        train_set, validation = data_ready.result()
        step_compiled.result()
        startup.mark("waiting for the background work")

    for_eval = task.eval_model

    def eval_model(model: Any) -> Any:
        return trainer.mp.cast_to_compute(model if for_eval is None else for_eval(model))

    context = RunContext(trainer, tracker, record, validation, eval_model)
    if task.evaluator is None:
        evaluator: Any = Evaluator(trainer, validation, tcfg.max_eval_batches, make_batch=task.make_batch)
    else:
        evaluator = task.evaluator(trainer, validation, tcfg.max_eval_batches, context)
    losses: list[float] = []

    def on_step(info: Any) -> None:
        startup.first_step()
        if not info.final:
            losses.append(info.loss)
            checkpointer.on_step(info.state, info.step)
            every = task.export_every
            if task.export is not None and every and info.step % every == 0 and info.step < tcfg.num_train_steps:
                task.export(info.state.model, f"step-{info.step}")  # the last step's export is the final one

    trainer.hooks.append(as_hook(on_step))
    if task.hooks is not None:
        trainer.hooks.extend(task.hooks(context))
    state = train_on(
        trainer,
        state,
        train_set,
        rows=rows,
        eval_fn=evaluator if validation else None,
        make_batch=task.make_batch,
    )
    stopped = trainer.last_stop_reason
    steps = int(state.step)
    checkpoint_path = final_checkpoint(checkpointer, state)

    if task.export is not None and stopped is None:
        outputs.update(task.export(state.model, None))
    sample = None
    if task.finish is not None and stopped is None:
        sample = task.finish(state, context)
    final_loss = losses[-1] if losses else None
    finish_trackers(tracker, steps=steps, final_loss=final_loss, eval_loss=evaluator.last)
    return TrainResult(
        run_id=record.run_id,
        steps=steps,
        final_loss=final_loss,
        eval_loss=dict(evaluator.last),
        checkpoint=checkpoint_path,
        resumed_from=resumed_from,
        hf_path=outputs.get("hugging face export"),
        sample=sample,
        stopped=stopped,
        exit_code=stop_exit_code(stopped, tcfg.preemption_exit_code),
        outputs=outputs,
    )


def _parameter_counts(state: Any) -> dict[str, float]:
    """``parameter_count``, ``trainable_parameter_count`` and ``fraction_trainable`` of a state (Levanter's names)."""
    import equinox as eqx
    import jax

    def count(tree: Any) -> int:
        return sum(int(x.size) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_inexact_array)))

    total = count(state.model)
    trainable = count(state.trainable_model)
    return {
        "parameter_count": total,
        "trainable_parameter_count": trainable,
        "fraction_trainable": trainable / max(total, 1),
    }
