"""The language-model run that ``train_lm``, ``sft`` and ``lora_lm`` share: from a chosen model to a result.

An entry point says what is particular to it in an :class:`LmRecipe` (the model, where its first weights come
from, adapters and which parameters train, what to export) and :func:`train_language_model` turns it into the
:class:`~ponente.trainer.run.RunTask` of a language model (packed token rows, the next-token loss, log-prob pages,
lm-eval, the final sample) for the shared run (:func:`~ponente.trainer.run.run_task`): run record and trackers,
data caches, trainer and state, resume, training with evaluation and checkpoints, the final checkpoint, exports
and summary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from ._core import Exporter, RunContext, RunTask, run_task
from ._devices import pad_vocab_for_partitioning, start_distributed
from ._eval_harness import eval_harness_hook
from ._pretrained import load_hf_weights
from ._result import TrainResult
from ._sampling import SampleConfig, sample_text
from ._startup import Startup
from ._training import batch_fields, placeholder_rows
from ._viz_logprobs import VizLogprobsConfig, logprob_pages

if TYPE_CHECKING:
    from ponente.models import LmConfig
    from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig
    from ponente.trainer.eval_harness import EvalHarnessConfig
    from ponente.trainer.optim import OptimizerConfig
    from ponente.trainer.trainer import TrainerConfig


__all__ = ["LmRecipe", "LmRunConfig", "check_training_data", "row_length", "start_run", "train_language_model"]


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
        allow_pickle: let ``initialize_from_hf`` load pickle weights (``pytorch_model*.bin``) without safetensors.
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
    allow_pickle: bool = False
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


def check_training_data(data: Any, hint: str) -> None:
    """Fail early when a single-source data config names no training data.

    Args:
        data: the data config (``LMDatasetConfig``, ``LMMixtureDatasetConfig``, ``AsrDatasetConfig``, ...).
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
    process started). A run whose config has a ``model`` section records the padded model config there. The
    steps are those of every run (:func:`~ponente.trainer.run.run_task`); this function says what a language
    model adds: packed token rows, the next-token loss, adapters, the log-prob pages, lm-eval and the sample.

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
    from ponente.trainer.lm import lm_batch

    data = config.data
    model_config = pad_vocab_for_partitioning(recipe.model_config, config.trainer, jax.device_count())
    seq_len = recipe.seq_len or model_config.seq_len
    Vocab = hax.Axis("vocab", max(recipe.vocab_size or 0, data.the_vocab_size))
    models = _Models(recipe, model_config, Vocab, config.trainer.seed)
    fields = batch_fields(data)

    def datasets(seed: int, batch_size: int) -> tuple[Any, dict[str, Any]]:
        from ponente.trainer.data import train_set, validation_sets

        return train_set(data, seq_len, seed=seed, batch_size=batch_size), validation_sets(data, seq_len)

    def pretrained(mp: Any) -> Any:
        assert recipe.initialize_from_hf is not None
        weights = load_hf_weights(recipe.initialize_from_hf, model_config, mp, allow_pickle=recipe.allow_pickle)
        return models.adapted(weights)

    def hooks(context: RunContext) -> list[Any]:
        found = []
        if recipe.viz_logprobs is not None:
            found.append(
                logprob_pages(
                    recipe.viz_logprobs,
                    datasets=context.validation,
                    tokenizer=data.the_tokenizer,
                    tracker=context.tracker,
                    run_id=context.record.run_id,
                    run_dir=context.record.run_dir,
                    steps_per_eval=context.trainer.config.steps_per_eval,
                    mesh=context.trainer.mesh,
                    eval_model=context.eval_model,
                )
            )
        if recipe.eval_harness is not None:
            found.append(
                eval_harness_hook(
                    recipe.eval_harness,
                    tokenizer=data.the_tokenizer,
                    tracker=context.tracker,
                    vocab_size=data.the_vocab_size,
                    mesh=context.trainer.mesh,
                    axis_mapping=context.trainer.compute_axis_mapping,
                    parameter_axis_mapping=context.trainer.parameter_axis_mapping,
                    eval_model=context.eval_model,
                )
            )
        return found

    sample_config = recipe.sample

    def finish(state: Any, context: RunContext) -> str | None:
        if sample_config is None or sample_config.num_tokens <= 0:
            return None
        key = jax.random.fold_in(state.training_key, 1)
        sample = sample_text(state.model, data.the_tokenizer, data.the_vocab_size, sample_config, key)
        context.tracker.log_summary({"sample": sample})
        return sample

    task = RunTask(
        model_config=model_config,
        build=models.build,
        loss_fn=_loss_fn(recipe),
        make_batch=lm_batch,
        placeholder_rows=lambda n: placeholder_rows(n, seq_len, fields=fields),
        datasets=datasets,
        is_trainable=models.is_trainable(),
        flops_per_token=model_config.flops_per_token(data.the_vocab_size),
        pretrained=pretrained if recipe.initialize_from_hf else None,
        hooks=hooks,
        export=recipe.export,
        export_every=recipe.export_every,
        finish=finish,
        log_parameter_counts=recipe.trainable is not None,
        eval_model=models.for_eval,
    )
    return run_task(config, task, startup)


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
