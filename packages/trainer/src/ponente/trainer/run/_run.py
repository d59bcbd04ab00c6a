"""The :class:`Run`: one training run of a :class:`~ponente.trainer.run.Task`, from its config to a result.

An entry point parses its config, picks its task and trains it::

    startup = start_run(config.trainer)      start-up timing; partitionable PRNG, jax.distributed
    task = LmTask(config)                    what is trained: model, batches, loss, evaluation, exports
    result = Run(task, startup).train()

:meth:`Run.train` reads top to bottom: the run record and trackers, the data caches, the trainer and the initial
state, the compilation of the training step (in the background), pretrained weights, resume, the training loop
(with evaluation, hooks, checkpoints, exports every N steps; SIGINT and SIGTERM stop it at a step boundary), the
final checkpoint, the final export, the task's last word (e.g. a sampled text) and the summary.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ._data import build_caches_once
from ._pretrained import replace_model
from ._provenance import RunRecord, with_run_id
from ._restore import restore
from ._result import TrainResult, final_checkpoint, finish_trackers, output_locations, stop_exit_code
from ._startup import Startup, resolve_train_batch_size, start_distributed
from ._task import RunContext, Task
from ._training import train_on

if TYPE_CHECKING:
    from ponente.trainer.trainer import TrainerConfig

__all__ = ["Run", "start_run"]


def start_run(tcfg: TrainerConfig) -> Startup:
    """The first step of an entry point: time the start-up phases, and prepare JAX before anything touches a device.

    Args:
        tcfg: the trainer config (its ``distributed`` section).

    Returns:
        The start-up timing, since the process started.
    """
    startup = Startup.since_process_start()
    start_distributed(tcfg.distributed)
    return startup


class Run:
    """Train a task's model on its data as its ``config.trainer`` says, and report what the run produced.

    Args:
        task: what is trained (its :attr:`~ponente.trainer.run.Task.config` is the run's configuration).
        startup: the start-up timing of this process (from :func:`start_run`; call it before building the task,
            which may look at the devices).
    """

    def __init__(self, task: Task, startup: Startup) -> None:
        self.task = task
        self.startup = startup

    def train(self) -> TrainResult:
        """Run every step (see the module docstring) and return what the run produced.

        Raises:
            ValueError: for a configuration that cannot run (bad sizes, a resume that changes a field that must
                stay fixed, a checkpoint whose shapes do not match the model, ...).
            FileNotFoundError: if ``trainer.load_checkpoint`` is true and there is no checkpoint.
        """
        import jax

        from ponente.trainer.checkpoint import acquire_writer_lease

        config = with_run_id(self.task.config)
        config = dataclasses.replace(config, trainer=resolve_train_batch_size(config.trainer, jax.device_count()))
        record = RunRecord.of(config)
        # one writer per run id: a second process on this run's checkpoints waits, then stops naming the holder
        ckpt = config.trainer.checkpointer
        lease = acquire_writer_lease(ckpt.expanded_path(record.run_id), seconds=ckpt.lease_seconds)
        try:
            return self._train(config, record, None if lease is None else lease.check)
        finally:
            if lease is not None:
                lease.release()

    def _train(self, config: Any, record: RunRecord, guard: Any) -> TrainResult:
        """:meth:`train` once the run's config is resolved and its writer lease held (``guard`` checks it)."""

        from ponente.trainer.callbacks import as_hook
        from ponente.trainer.tracker import init_trackers
        from ponente.trainer.trainer import Trainer, plain_model

        task, startup = self.task, self.startup
        tcfg = config.trainer
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
            checkpointer.guard = guard
            outputs = output_locations(record, checkpoints=checkpointer.run_path, trackers=tcfg.tracker)
            data_seed = tcfg.seed if config.data_seed is None else config.data_seed
            build_caches_once(config.data, tcfg)
            data_ready = startup.background(
                pool, "datasets (first cache rows)", task.datasets, data_seed, tcfg.train_batch_size
            )
            trainer = Trainer(
                tcfg,
                config.optimizer.build(tcfg.num_train_steps),
                task.loss,
                lr_schedule=config.optimizer.lr_scheduler(tcfg.num_train_steps),
                log_fn=lambda metrics, step: tracker.log(metrics, step=step),
                flops_per_token=task.flops_per_token(),
                after_update=task.after_update,
            )
            rows = trainer.process_batch_rows()  # this process loads only the rows of its own devices
            state = trainer.initial_state(task.build_model, is_trainable=task.trainable())
            startup.mark("model and optimizer init")
            # the initial state's shapes and shardings are those of the loaded weights and of any checkpoint restored
            placeholder = task.make_batch(task.placeholder_rows(rows.stop - rows.start))
            step_compiled: Future[Any] = startup.background(
                pool, "train step compile", trainer.compile_step, state, placeholder
            )
            if tcfg.initialize_from is None:
                pretrained = task.pretrained_model(trainer.mp)
                if pretrained is not None:
                    state = replace_model(state, trainer.prepare_model(pretrained), what=task.pretrained_key)
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

        context = RunContext(trainer, tracker, record, validation, task, state)
        # exports (and the final sample) have plain products: quantization is how the run trains, not the model
        exported = plain_model if tcfg.quantization is not None else _same
        evaluator = task.evaluator(context)
        losses: list[float] = []

        def on_step(info: Any) -> None:
            startup.first_step()
            if not info.final:
                losses.append(info.loss)
                checkpointer.on_step(info.state, info.step)
                every = task.export_every
                if every and info.step % every == 0 and info.step < tcfg.num_train_steps:
                    task.export(exported(info.state.model), f"step-{info.step}")  # the last step's is the final one

        trainer.hooks.append(as_hook(on_step))
        trainer.hooks.extend(task.hooks(context))
        profiler = None
        if tcfg.profiler:
            from pathlib import Path

            from ponente.trainer.profiler import Profiler

            where = Path(record.run_dir or f"logs/{record.run_id}") / "profile"
            profiler = Profiler(
                where,
                tcfg.profiler_start_step,
                tcfg.profiler_num_steps,
                perfetto_link=tcfg.profiler_perfetto_link,
                tracker=tracker,
            )
            trainer.hooks.append(as_hook(profiler))
        state = train_on(
            trainer, state, train_set, rows=rows, eval_fn=evaluator if validation else None, make_batch=task.make_batch
        )
        if profiler is not None:
            profiler.close(int(state.step))
        stopped = trainer.last_stop_reason
        steps = int(state.step)
        checkpoint_path = final_checkpoint(checkpointer, state)

        sample = None
        if stopped is None:
            outputs.update(task.export(exported(state.model), None))
            sample = task.finish(_with_model(state, exported(state.model)), context)
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


def _same(model: Any) -> Any:
    return model


def _with_model(state: Any, model: Any) -> Any:
    import equinox as eqx

    return eqx.tree_at(lambda s: s.model, state, model)
