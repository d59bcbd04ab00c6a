"""The language-model run that ``train_lm``, ``sft`` and ``lora_lm`` share: from a chosen model to a result.

An entry point says what is particular to it in an :class:`LmRecipe` (the model, where its first weights come
from, adapters and which parameters train, what to export) and :func:`train_language_model` does the rest:
run record and trackers, data caches, trainer and state, resume, training with evaluation and checkpoints,
the final checkpoint, exports, sample and summary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from ._data import build_caches_once
from ._devices import pad_vocab_for_partitioning, resolve_train_batch_size, start_distributed
from ._eval_harness import eval_harness_hook
from ._evaluation import Evaluator
from ._finish import final_checkpoint, finish_trackers
from ._outputs import output_locations
from ._pretrained import load_hf_weights, replace_model
from ._provenance import RunRecord, with_run_id
from ._restore import restore
from ._result import TrainResult
from ._sampling import SampleConfig, sample_text
from ._startup import Startup
from ._training import batch_fields, placeholder_batch, train_on
from ._viz_logprobs import VizLogprobsConfig, logprob_pages

if TYPE_CHECKING:
    from ponente.models import LmConfig
    from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig
    from ponente.trainer.eval_harness import EvalHarnessConfig
    from ponente.trainer.optim import OptimizerConfig
    from ponente.trainer.trainer import TrainerConfig


__all__ = ["LmRecipe", "LmRunConfig", "check_training_data", "row_length", "start_run", "train_language_model"]

Exporter = Callable[[Any, str | None], Mapping[str, str]]
"""``export(model, subfolder) -> {what: where}``: writes the run's exports of ``model``; ``subfolder`` is
``"step-N"`` for the exports during the run and None for the final one."""


class LmRunConfig(Protocol):
    """The sections every language-model entry point's config has (``TrainLmConfig``, ``SftConfig``, ...)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def data(self) -> LMDatasetConfig | LMMixtureDatasetConfig: ...

    @property
    def trainer(self) -> TrainerConfig: ...

    @property
    def optimizer(self) -> OptimizerConfig: ...

    @property
    def data_seed(self) -> int | None: ...


@dataclasses.dataclass(frozen=True)
class LmRecipe:
    """What a language-model entry point adds to the shared run (:func:`train_language_model`).

    Attributes:
        model_config: the model (its vocabulary is padded for the mesh by the run).
        seq_len: the length of the training rows (None: ``model_config.seq_len``).
        vocab_size: the model's vocabulary size when it may exceed the data's (``data.vocab_size`` or the
            tokenizer's), e.g. that of a checkpoint whose embedding has spare rows (None: the data's).
        initialize_from_hf: a Hugging Face checkpoint (folder or hub id) whose weights start a fresh run
            (ignored when the run resumes or ``trainer.initialize_from`` is set).
        adapt: ``adapt(model, key) -> model``, applied to the model before training (e.g. LoRA adapters); the
            same ``key`` (from ``trainer.seed``) serves a built and a loaded model. None: the model as it is.
        trainable: ``trainable(model)``: which parts of the (adapted) model train, as ``Trainer.initial_state``'s
            ``is_trainable`` (None: every floating-point parameter).
        step_model: ``step_model(model, key) -> model``: the model the loss sees, given the step's PRNG key
            (None when evaluating), e.g. LoRA dropout keys (None: the model as it is).
        export: writes the exports of a model (see :data:`Exporter`; None: nothing to export).
        export_every: also export every this many steps, to ``"step-N"`` subfolders (None: only at the end).
        z_loss_weight: weight of the z-loss (0: none).
        cross_entropy_block_size: blockwise loss over this many vocabulary entries (see ``lm_loss_fn``).
        sample: the text sampled at the end of the run (None: none).
        viz_logprobs: the log-prob page of some validation rows written during training (None: none).
        eval_harness: lm-eval tasks scored every N steps, logged as ``lm_eval/<task>/<metric>`` (None: none).
    """

    model_config: LmConfig
    seq_len: int | None = None
    vocab_size: int | None = None
    initialize_from_hf: str | None = None
    adapt: Callable[[Any, Any], Any] | None = None
    trainable: Callable[[Any], Any] | None = None
    step_model: Callable[[Any, Any], Any] | None = None
    export: Exporter | None = None
    export_every: int | None = None
    z_loss_weight: float = 0.0
    cross_entropy_block_size: int | Literal["auto"] | None = "auto"
    sample: SampleConfig | None = None
    viz_logprobs: VizLogprobsConfig | None = None
    eval_harness: EvalHarnessConfig | None = None


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


def check_training_data(data: LMDatasetConfig | LMMixtureDatasetConfig, hint: str) -> None:
    """Fail early when a single-source data config names no training data.

    Args:
        data: the data config.
        hint: what to pass instead, for the message (e.g. ``"--config_path gpt2_nano"``).

    Raises:
        ValueError: if ``data.train_urls`` is empty and ``data.id`` is not set.
    """
    if not hasattr(data, "configs") and not getattr(data, "train_urls", None) and getattr(data, "id", None) is None:
        raise ValueError(f"data.train_urls is empty and data.id is not set: nothing to train on (for example, {hint})")


def row_length(model_seq_len: int, max_train_length: int | None) -> int:
    """The length of the training rows: the model's ``seq_len``, capped by ``max_train_length``.

    Raises:
        ValueError: if ``max_train_length`` is below 2 (a row must hold a token and its successor).
    """
    if max_train_length is None:
        return model_seq_len
    if max_train_length < 2:
        raise ValueError(f"max_train_length must be None or >= 2, got {max_train_length}")
    return min(model_seq_len, max_train_length)


def train_language_model(config: LmRunConfig, recipe: LmRecipe, startup: Startup) -> TrainResult:
    """Train the recipe's model on ``config.data`` as ``config.trainer`` says, and report what the run produced.

    Call :func:`~ponente.trainer.run.start_distributed` first (``startup`` times the phases since the
    process started). A run whose config has a ``model`` section records the padded model config there.

    Args:
        config: the entry point's resolved configuration.
        recipe: what the entry point trains and exports.
        startup: the start-up timing of this process.

    Returns:
        What the run produced.

    Raises:
        ValueError: for a configuration that cannot run (bad sizes, a resume that changes a field that must
            stay fixed, a checkpoint whose shapes do not match the model, ...).
        FileNotFoundError: if ``trainer.load_checkpoint`` is true and there is no checkpoint.
    """
    import jax

    import ponente.namedtensor as hax
    from ponente.trainer.callbacks import as_hook
    from ponente.trainer.tracker import init_trackers
    from ponente.trainer.trainer import Trainer

    data = config.data
    model_config = pad_vocab_for_partitioning(recipe.model_config, config.trainer, jax.device_count())
    seq_len = recipe.seq_len or model_config.seq_len
    config = with_run_id(config)
    trainer_config = resolve_train_batch_size(config.trainer, jax.device_count())
    config = dataclasses.replace(config, trainer=trainer_config)
    if "model" in config.__dataclass_fields__:
        config = dataclasses.replace(config, model=model_config)
    tcfg = config.trainer
    record = RunRecord.of(config)
    startup.mark("config and tokenizer")

    # trackers are created before any other thread starts: the tensorboard tracker hides torch while it imports
    tracker = init_trackers(tcfg.tracker, record.run_id)
    startup.mark("trackers")
    # Until the first step, four things proceed at once (XLA compiles and tokenizers release the GIL): the
    # run record (git, pip freeze), the token caches (built in their own threads; the datasets wait for the
    # first rows), the compilation of the training step, and on this thread the initial state and checkpoint.
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="ponente-startup") as pool:
        recorded = startup.background(pool, "run record", record.write, tracker)
        checkpointer = tcfg.checkpointer.create(record.run_id, metadata=record.provenance)
        outputs = output_locations(record, checkpoints=checkpointer.run_path, trackers=tcfg.tracker)
        data_seed = tcfg.seed if config.data_seed is None else config.data_seed
        build_caches_once(data, tcfg)

        def datasets() -> tuple[Any, dict[str, Any]]:
            train_set = data.train_set(seq_len, seed=data_seed, batch_size=tcfg.train_batch_size)
            return train_set, data.validation_sets(seq_len)

        data_ready = startup.background(pool, "datasets (first cache rows)", datasets)
        trainer = Trainer(
            tcfg,
            config.optimizer.build(tcfg.num_train_steps),
            _loss_fn(recipe),
            lr_schedule=config.optimizer.lr_scheduler(tcfg.num_train_steps),
            log_fn=lambda metrics, step: tracker.log(metrics, step=step),
            flops_per_token=model_config.flops_per_token(data.the_vocab_size),
        )
        rows = trainer.process_batch_rows()  # this process loads only the rows of its own devices
        Vocab = hax.Axis("vocab", max(recipe.vocab_size or 0, data.the_vocab_size))
        models = _Models(recipe, model_config, Vocab, tcfg.seed)
        state = trainer.initial_state(models.build, is_trainable=models.is_trainable())
        startup.mark("model and optimizer init")
        # the initial state's shapes and shardings are those of the loaded weights and of any checkpoint restored
        compile_args = (state, placeholder_batch(rows, seq_len, fields=batch_fields(data)))
        step_compiled: Future[Any] = startup.background(
            pool, "train step compile", trainer.compile_step, *compile_args
        )
        if recipe.initialize_from_hf and tcfg.initialize_from is None:
            weights = load_hf_weights(recipe.initialize_from_hf, model_config, trainer.mp)
            state = replace_model(state, models.adapted(weights), what="initialize_from_hf")
            startup.mark("hugging face weights")
        state, resumed_from = restore(state, tcfg, checkpointer, record.provenance)
        startup.mark("checkpoint restore")
        recorded.result()
        # the log then holds each step once: records a killed run wrote after its last checkpoint are dropped
        tracker.resume_from(int(state.step))
        if recipe.trainable is not None:
            tracker.log_summary(_parameter_counts(state))
        train_set, validation = data_ready.result()
        step_compiled.result()
        startup.mark("waiting for the background work")

    evaluator = Evaluator(trainer, validation, tcfg.max_eval_batches)
    losses: list[float] = []

    def on_step(info: Any) -> None:
        startup.first_step()
        if not info.final:
            losses.append(info.loss)
            checkpointer.on_step(info.state, info.step)
            every = recipe.export_every
            if recipe.export is not None and every and info.step % every == 0 and info.step < tcfg.num_train_steps:
                recipe.export(info.state.model, f"step-{info.step}")  # the last step's export is the final one

    trainer.hooks.append(as_hook(on_step))
    if recipe.viz_logprobs is not None:
        trainer.hooks.append(
            logprob_pages(
                recipe.viz_logprobs,
                datasets=validation,
                tokenizer=data.the_tokenizer,
                tracker=tracker,
                run_id=record.run_id,
                run_dir=record.run_dir,
                steps_per_eval=tcfg.steps_per_eval,
                mesh=trainer.mesh,
                eval_model=lambda model: trainer.mp.cast_to_compute(models.for_eval(model)),
            )
        )
    if recipe.eval_harness is not None:
        trainer.hooks.append(
            eval_harness_hook(
                recipe.eval_harness,
                tokenizer=data.the_tokenizer,
                tracker=tracker,
                vocab_size=data.the_vocab_size,
                mesh=trainer.mesh,
                axis_mapping=trainer.compute_axis_mapping,
                parameter_axis_mapping=trainer.parameter_axis_mapping,
                eval_model=lambda model: trainer.mp.cast_to_compute(models.for_eval(model)),
            )
        )
    state = train_on(trainer, state, train_set, rows=rows, eval_fn=evaluator if validation else None)
    stopped = trainer.last_stop_reason
    steps = int(state.step)
    checkpoint_path = final_checkpoint(checkpointer, state)

    if recipe.export is not None and stopped is None:
        outputs.update(recipe.export(state.model, None))
    sample = None
    if recipe.sample is not None and recipe.sample.num_tokens > 0 and stopped is None:
        key = jax.random.fold_in(state.training_key, 1)
        sample = sample_text(state.model, data.the_tokenizer, data.the_vocab_size, recipe.sample, key)
        tracker.log_summary({"sample": sample})
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
        outputs=outputs,
    )


class _Models:
    """The models of a run: built from the config or loaded, with the recipe's adapters, and what of them trains.

    Args:
        recipe: the recipe (its ``adapt`` and ``trainable``).
        model_config: the (padded) model config.
        Vocab: the vocabulary axis.
        seed: ``trainer.seed``; the adapters' key derives from it, so built and loaded models get the same ones.
    """

    def __init__(self, recipe: LmRecipe, model_config: LmConfig, Vocab: Any, seed: int) -> None:
        import jax

        self.recipe = recipe
        self.model_config = model_config
        self.Vocab = Vocab
        self.adapt_key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)

    def for_eval(self, model: Any) -> Any:
        """The model the loss sees when evaluating (:attr:`LmRecipe.step_model` without a key)."""
        return model if self.recipe.step_model is None else self.recipe.step_model(model, None)

    def adapted(self, model: Any) -> Any:
        """``model`` with the recipe's adapters (itself without ``adapt``)."""
        return model if self.recipe.adapt is None else self.recipe.adapt(model, self.adapt_key)

    def build(self, key: Any) -> Any:
        """A freshly initialized model (``model_init`` of ``Trainer.initial_state``)."""
        return self.adapted(self.model_config.build(self.Vocab, key=key))

    def is_trainable(self) -> Any:
        """The ``is_trainable`` of ``Trainer.initial_state``, read from the shapes of :meth:`build` alone."""
        import equinox as eqx
        import jax

        if self.recipe.trainable is None:
            return True
        return self.recipe.trainable(eqx.filter_eval_shape(self.build, jax.random.PRNGKey(0)))


def _loss_fn(recipe: LmRecipe) -> Callable[..., Any]:
    """The next-token loss of the recipe, on the model as :attr:`LmRecipe.step_model` makes it for the step."""
    from ponente.trainer.lm import lm_loss_fn

    loss_fn = lm_loss_fn(recipe.z_loss_weight, recipe.cross_entropy_block_size)
    step_model = recipe.step_model
    if step_model is None:
        return loss_fn

    def loss_on_step_model(model: Any, batch: Any, *, key: Any) -> Any:
        return loss_fn(step_model(model, key), batch, key=key)

    return loss_on_step_model


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
