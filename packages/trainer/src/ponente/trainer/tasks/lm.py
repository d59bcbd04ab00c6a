"""The language-model task: pre-training (``train_lm``) and fine-tuning (``sft``) of a causal language model.

:class:`LmTask` says what a language-model run trains: the model of ``model`` (or of the Hugging Face checkpoint
``initialize_from_hf``), its vocabulary padded for the mesh; packed token rows (:func:`lm_batch`); the next-token
loss (:func:`lm_loss_fn`); log-prob pages and lm-eval scores during training; the Hugging Face export; the sample
at the end. :class:`~ponente.trainer.tasks.lora.LoraTask` adds adapters to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

import ponente.namedtensor as hax
from ponente.models import LmExample, compute_next_token_loss_and_aux
from ponente.models.context_parallel import zigzag_example
from ponente.models.decoder import EXPERT_LOAD
from ponente.trainer.data import AsrDatasetFormat, data_tokenizer, data_vocab_size
from ponente.trainer.run import (
    RunContext,
    Task,
    TaskConfig,
    check_context_parallel,
    check_expert_parallel,
    check_training_data,
    eval_harness_hook,
    export_hf,
    hf_model_config,
    hf_vocab_size,
    load_hf_weights,
    logprob_pages,
    pad_vocab_for_partitioning,
    resolve_path,
    sample_text,
)

if TYPE_CHECKING:
    from ponente.models import LmConfig
    from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig
    from ponente.trainer.eval_harness import EvalHarnessConfig
    from ponente.trainer.run import SampleConfig, VizLogprobsConfig

__all__ = [
    "EXAMPLE_FIELDS",
    "TEXT_FIELDS",
    "LmTask",
    "LmTaskConfig",
    "batch_fields",
    "lm_batch",
    "lm_example",
    "lm_loss_fn",
    "placeholder_rows",
    "row_length",
]

BATCH_AXES = ("batch", "position")


def lm_batch(rows: Mapping[str, np.ndarray]) -> dict[str, hax.NamedArray]:
    """Turn packed rows (``[batch, position]`` arrays) into named arrays plus a prediction-aligned loss mask.

    Position ``i`` predicts token ``i + 1``; it counts only when that token exists and belongs to the same
    document (segment), so no loss crosses a document boundary. Rows of supervised and chat data (see
    :class:`~ponente.datacache.PackedExampleDataset`) also carry a *target-aligned* ``loss_mask`` (1 where the
    token is a training target) and ``position_ids``: then position ``i`` counts only if, in addition,
    token ``i + 1`` is a target, and ``position_ids`` is passed on to the model. The mask travels with the
    batch, so the loss is the mean over trained tokens and gradient accumulation can weight each microbatch
    by its number of loss tokens.

    Args:
        rows: int arrays of shape ``[batch, position]``: ``input_ids`` and ``segment_ids``, optionally
            ``loss_mask`` (target-aligned) and ``position_ids``.

    Returns:
        ``{"input_ids", "segment_ids", "loss_mask"}`` (+ ``"position_ids"`` when given) as NamedArrays over
        ``(batch, position)``; ``loss_mask`` is prediction-aligned float32.

    Raises:
        ValueError: if the arrays are not 2-D or their shapes differ.

    Example:
        >>> import numpy as np
        >>> b = lm_batch({"input_ids": np.array([[5, 6, 7, 8]]), "segment_ids": np.array([[0, 0, 1, 1]])})
        >>> b["loss_mask"].array.tolist()
        [[1.0, 0.0, 1.0, 0.0]]
        >>> b = lm_batch(
        ...     {
        ...         "input_ids": np.array([[5, 6, 7, 0]]),
        ...         "segment_ids": np.array([[0, 0, 0, -1]]),
        ...         "loss_mask": np.array([[0, 0, 1, 0]]),
        ...         "position_ids": np.array([[0, 1, 2, 0]]),
        ...     }
        ... )
        >>> b["loss_mask"].array.tolist()  # only the prediction of token 2 (position 1) trains
        [[0.0, 1.0, 0.0, 0.0]]
    """
    ids = np.asarray(rows["input_ids"], dtype=np.int32)
    seg = np.asarray(rows["segment_ids"], dtype=np.int32)
    optional = {key: np.asarray(rows[key], dtype=np.int32) for key in ("loss_mask", "position_ids") if key in rows}
    if ids.ndim != 2 or any(a.shape != ids.shape for a in (seg, *optional.values())):
        shapes = {key: np.shape(rows[key]) for key in ("input_ids", "segment_ids", *optional)}
        raise ValueError(f"lm_batch: every array must be [batch, position] of one shape, got {shapes}")
    mask = np.zeros(ids.shape, dtype=np.float32)
    mask[:, :-1] = seg[:, 1:] == seg[:, :-1]
    if "loss_mask" in optional:
        mask[:, :-1] *= optional["loss_mask"][:, 1:] != 0
    batch = {
        "input_ids": hax.named(ids, BATCH_AXES),
        "segment_ids": hax.named(seg, BATCH_AXES),
        "loss_mask": hax.named(mask, BATCH_AXES),
    }
    if "position_ids" in optional:
        batch["position_ids"] = hax.named(optional["position_ids"], BATCH_AXES)
    return batch


def lm_example(batch: Mapping[str, hax.NamedArray]) -> LmExample:
    """The causal :class:`~ponente.models.LmExample` of a batch made by :func:`lm_batch` (segments kept apart,
    positions restarting per example when the batch has ``position_ids``)."""
    return LmExample.causal(
        batch["input_ids"],
        loss_mask=batch["loss_mask"],
        segment_ids=batch["segment_ids"],
        pos_ids=batch.get("position_ids"),
    )


def lm_loss_fn(
    z_loss_weight: float = 0.0, block_size: int | str | None = "auto", *, context: int = 1
) -> Callable[..., Any]:
    """The training loss ``loss_fn(model, batch, *, key)``: next-token cross-entropy (+ z-loss, + aux losses).

    Args:
        z_loss_weight: weight of ``logsumexp(logits)**2`` (0: none).
        block_size: compute the loss blockwise over this many vocabulary entries (None: plain; ``"auto"``:
            blockwise for large vocabularies, see :func:`ponente.models.loss.cross_entropy_block_size`).
        context: ``trainer.context_axis_size``; > 1 puts every example's positions in zig-zag order first
            (:func:`ponente.models.context_parallel.zigzag_example`), which leaves the loss unchanged.

    Returns:
        The loss function for :class:`~ponente.trainer.trainer.Trainer`.
    """

    def loss_fn(model: Any, batch: Mapping[str, hax.NamedArray], *, key: Any) -> Any:
        example = zigzag_example(lm_example(batch), context)
        loss, aux = compute_next_token_loss_and_aux(
            model, example, key=key, logsumexp_weight=z_loss_weight or None, block_size=block_size
        )
        # auxiliary terms (e.g. a MoE router's load-balancing loss) are already in ``loss``; they are also
        # returned by name so that the trainer logs them
        return (loss, aux) if aux else loss

    return loss_fn


TEXT_FIELDS = ("input_ids", "segment_ids")
"""The fields of a packed text row (``TokenSeqDataset``)."""

EXAMPLE_FIELDS = ("input_ids", "segment_ids", "loss_mask", "position_ids")
"""The fields of a packed supervised or chat row (``PackedExampleDataset``)."""


def batch_fields(data: Any) -> tuple[str, ...]:
    """The fields of the training rows of a data config: :data:`EXAMPLE_FIELDS` when any source (or mixture
    component) has a ``format`` other than ``text``, else :data:`TEXT_FIELDS`.

    Raises:
        ValueError: naming ``data.format`` for speech data (``asr``), which is not token rows.
    """
    sources = list(getattr(data, "configs", {}).values()) or [data]
    if any(isinstance(getattr(source, "format", None), AsrDatasetFormat) for source in sources):
        raise ValueError("data.format: type 'asr' is speech data; train it with ponente-train-asr")
    if any(getattr(getattr(source, "format", None), "has_loss_mask", False) for source in sources):
        return EXAMPLE_FIELDS
    return TEXT_FIELDS


def placeholder_rows(count: int, seq_len: int, *, fields: tuple[str, ...] = TEXT_FIELDS) -> dict[str, Any]:
    """Zeros in the layout of ``count`` packed rows of ``seq_len`` tokens (``{field: int32 [count, seq_len]}``).

    Args:
        count: the number of rows.
        seq_len: the length of a row.
        fields: the fields of the dataset's rows (see :func:`batch_fields`).
    """
    zeros = np.zeros((count, seq_len), dtype=np.int32)
    return dict.fromkeys(fields, zeros)


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


class LmTaskConfig(TaskConfig, Protocol):
    """The keys :class:`LmTask` reads (``TrainLmConfig``'s; ``SftConfig`` has them too)."""

    @property
    def data(self) -> LMDatasetConfig | LMMixtureDatasetConfig: ...

    @property
    def model(self) -> LmConfig: ...

    @property
    def initialize_from_hf(self) -> str | None: ...

    @property
    def allow_pickle(self) -> bool: ...

    @property
    def z_loss_weight(self) -> float: ...

    @property
    def cross_entropy_block_size(self) -> int | Literal["auto"] | None: ...

    @property
    def hf_save_path(self) -> str | None: ...

    @property
    def hf_save_steps(self) -> int | None: ...

    @property
    def sample(self) -> SampleConfig: ...

    @property
    def viz_logprobs(self) -> VizLogprobsConfig | None: ...

    @property
    def eval_harness(self) -> EvalHarnessConfig | None: ...


class LmTask(Task):
    """Train a causal language model on packed token rows with the next-token loss.

    Call :func:`~ponente.trainer.run.start_run` first: the vocabulary is padded for the devices' mesh.

    Args:
        config: a ``TrainLmConfig`` (or ``SftConfig``); the task's :attr:`config` is it with ``model`` the model
            as trained (the checkpoint's config with ``use_hf_model_config``, the vocabulary padded).
        use_hf_model_config: take the model config from ``initialize_from_hf`` rather than ``model``.
        max_train_length: train on rows of at most this many tokens (None: the model's ``seq_len``).
        hint: what to pass when the data names no training data, for the message.

    Raises:
        ValueError: if ``data`` names no training data, or ``max_train_length`` is below 2.
    """

    def __init__(
        self,
        config: LmTaskConfig,
        *,
        use_hf_model_config: bool = False,
        max_train_length: int | None = None,
        hint: str = "the packaged hello world: --config_path gpt2_nano",
    ) -> None:
        check_training_data(config.data, hint=hint)
        model_config, vocab_size = config.model, None
        if config.initialize_from_hf and use_hf_model_config:
            model_config = hf_model_config(config.initialize_from_hf)
            vocab_size = hf_vocab_size(config.initialize_from_hf)
        self._setup(config, model_config, vocab_size, row_length(model_config.seq_len, max_train_length))
        self.config = dataclasses.replace(config, model=self.model_config)
        self.export_every = config.hf_save_steps
        self.sample: SampleConfig | None = config.sample
        self._loss_fn = lm_loss_fn(
            config.z_loss_weight, config.cross_entropy_block_size, context=config.trainer.context_axis_size
        )

    def _setup(self, config: Any, model_config: LmConfig, vocab_size: int | None, seq_len: int) -> None:
        """What every language-model task sets: the padded model config, the vocabulary axis and the row layout."""
        import jax

        self.config = config
        self.data: LMDatasetConfig | LMMixtureDatasetConfig = config.data
        check_expert_parallel(model_config, config.trainer)
        check_context_parallel(model_config, config.trainer, seq_len)
        self.model_config = pad_vocab_for_partitioning(model_config, config.trainer, jax.device_count())
        self.seq_len = seq_len
        self.fields = batch_fields(self.data)
        self.tokenizer = data_tokenizer(self.data)
        self.vocab_size = data_vocab_size(self.data)
        self.Vocab = hax.Axis("vocab", max(vocab_size or 0, self.vocab_size))
        self.initialize_from_hf: str | None = config.initialize_from_hf
        self.allow_pickle: bool = config.allow_pickle
        self.hf_save_path: str | None = getattr(config, "hf_save_path", None)
        self.viz_logprobs: VizLogprobsConfig | None = getattr(config, "viz_logprobs", None)
        self.eval_harness: EvalHarnessConfig | None = getattr(config, "eval_harness", None)

    def build_model(self, key: Any) -> Any:
        """A freshly initialized model of the padded config."""
        return self.model_config.build(self.Vocab, key=key)

    def _bias_rate(self) -> float:
        return float(getattr(self.model_config, "router_bias_update_rate", 0.0))

    def trainable(self) -> Any:
        """Every parameter but the MoE balancing biases (``model.router_bias_update_rate``), updated by
        :meth:`after_update` instead."""
        if not self._bias_rate():
            return True
        import equinox as eqx
        import jax

        from ponente.models.moe import balance_bias_frozen

        shapes = eqx.filter_eval_shape(self.build_model, jax.random.PRNGKey(0))
        return balance_bias_frozen(jax.tree_util.tree_map(lambda _: True, shapes))

    def after_update(self, model: Any, extra: Mapping[str, Any]) -> Any:
        """The MoE balancing biases moved by ``rate * sign(mean load - load)`` (DeepSeek-V3), when enabled."""
        rate = self._bias_rate()
        if not rate or EXPERT_LOAD not in extra:
            return model
        from ponente.models.moe import update_balance_bias

        return update_balance_bias(model, extra[EXPERT_LOAD], rate)

    def pretrained_model(self, mp: Any) -> Any | None:
        """The weights of ``initialize_from_hf``, the vocabulary padded like the model's (None when not set)."""
        if not self.initialize_from_hf:
            return None
        return load_hf_weights(self.initialize_from_hf, self.model_config, mp, allow_pickle=self.allow_pickle)

    def loss(self, model: Any, batch: Any, *, key: Any) -> Any:
        """The next-token loss (+ z-loss, + auxiliary losses), see :func:`lm_loss_fn`."""
        return self._loss_fn(model, batch, key=key)

    def make_batch(self, rows: Mapping[str, np.ndarray]) -> Any:
        """Packed rows to the named batch (:func:`lm_batch`)."""
        return lm_batch(rows)

    def placeholder_rows(self, count: int) -> dict[str, np.ndarray]:
        """Zeros in the layout of ``count`` packed rows of the run's length."""
        return placeholder_rows(count, self.seq_len, fields=self.fields)

    def datasets(self, seed: int, batch_size: int) -> tuple[Any, dict[str, Any]]:
        """The packed training rows of ``data`` and its validation sets."""
        from ponente.trainer.data import train_set, validation_sets

        return train_set(self.data, self.seq_len, seed=seed, batch_size=batch_size), validation_sets(
            self.data, self.seq_len
        )

    def flops_per_token(self) -> float | None:
        """The model's forward FLOPs per token."""
        return self.model_config.flops_per_token(self.vocab_size)

    def hooks(self, context: RunContext) -> list[Any]:
        """The log-prob pages (``viz_logprobs``) and the lm-eval scores (``eval_harness``), when configured."""
        found = []
        trainer = context.trainer
        if self.viz_logprobs is not None:
            found.append(
                logprob_pages(
                    self.viz_logprobs,
                    datasets=context.validation,
                    tokenizer=self.tokenizer,
                    tracker=context.tracker,
                    run_id=context.record.run_id,
                    run_dir=context.record.run_dir,
                    steps_per_eval=trainer.config.steps_per_eval,
                    mesh=trainer.mesh,
                    eval_model=context.eval_model,
                )
            )
        if self.eval_harness is not None:
            found.append(
                eval_harness_hook(
                    self.eval_harness,
                    tokenizer=self.tokenizer,
                    tracker=context.tracker,
                    vocab_size=self.vocab_size,
                    mesh=trainer.mesh,
                    axis_mapping=trainer.compute_axis_mapping,
                    parameter_axis_mapping=trainer.parameter_axis_mapping,
                    eval_model=context.eval_model,
                )
            )
        return found

    def export(self, model: Any, subfolder: str | None) -> dict[str, str]:
        """The Hugging Face folder at ``hf_save_path`` (``step-N`` under it during the run), when set."""
        if not self.hf_save_path:
            return {}
        return {"hugging face export": self._export_hf(model, self.hf_save_path, subfolder)}

    def _export_hf(self, model: Any, path: str, subfolder: str | None) -> str:
        where = resolve_path(path if subfolder is None else f"{path}/{subfolder}")
        return export_hf(model, where, tokenizer=self.tokenizer, seq_len=self.seq_len)

    def finish(self, state: Any, context: RunContext) -> str | None:
        """The text sampled from the trained model (``sample``), logged to the trackers' summary."""
        import jax

        if self.sample is None or self.sample.num_tokens <= 0:
            return None
        key = jax.random.fold_in(state.training_key, 1)
        sample = sample_text(state.model, self.tokenizer, self.vocab_size, self.sample, key)
        context.tracker.log_summary({"sample": sample})
        return sample
