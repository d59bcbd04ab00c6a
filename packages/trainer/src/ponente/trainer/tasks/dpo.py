"""The preference task: DPO, IPO, hinge and SimPO on chosen/rejected pairs (``train_dpo``), with or without LoRA.

:class:`DpoTask` is the :class:`~ponente.trainer.tasks.lm.LmTask` of a trained model (``initialize_from_hf`` or
``initialize_from_checkpoint_path``) on the pair rows of ``data.format: preference_chat``. Its loss reads the
sequence log-probs of both responses under the policy and under a frozen reference
(:func:`ponente.models.loss.sequence_logprobs`, :func:`ponente.models.loss.preference_loss`). Where the reference
comes from:

- full DPO: the model trained is a :class:`PolicyAndReference`; the reference half (``reference_model_path``, or a
  copy of the initial model) is not trainable, so it is in no optimizer state and gets no gradient;
- LoRA-DPO (``lora:``): the reference is the model with its adapters switched off (the base weights, which are
  frozen anyway): no second copy of the weights;
- ``precompute_reference: true``: the reference log-probs of every pair are computed once before training and
  travel in the batch; the model is the policy alone and a step runs one forward pass per response, not two;
- SimPO (``loss_type: simpo``) reads no reference at all.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import equinox as eqx
import numpy as np

import ponente.namedtensor as hax
from ponente.trainer.run import (
    Evaluator,
    RunContext,
    check_training_data,
    hf_model_config,
    hf_vocab_size,
    load_hf_weights,
    load_model_from_checkpoint,
)

from .lm import LmTask, row_length

if TYPE_CHECKING:
    from ponente.models.lora import LoraConfig

__all__ = ["PAIR_FIELDS", "DpoTask", "PolicyAndReference", "dpo_batch", "pair_loss", "with_epochs"]

logger = logging.getLogger(__name__)

PAIR_FIELDS = ("chosen_input_ids", "chosen_loss_mask", "rejected_input_ids", "rejected_loss_mask")
"""The fields of a ``preference_chat`` row (int32 ``[seq_len]``; the masks target-aligned)."""

REFERENCE_FIELDS = ("reference_chosen_logp", "reference_rejected_logp")
"""The fields ``precompute_reference`` adds to each row (float32 scalars)."""

AXES = ("batch", "position")


class PolicyAndReference(eqx.Module):
    """The model a full DPO run trains: the policy, and the frozen reference it is compared with.

    Only :attr:`policy` is trainable (:meth:`DpoTask.trainable`); checkpoints hold both, so a resumed run compares
    with the same reference; exports write the policy.
    """

    policy: Any
    reference: Any


def dpo_batch(rows: Mapping[str, np.ndarray]) -> dict[str, hax.NamedArray]:
    """Pair rows (``[batch, position]`` arrays, see :data:`PAIR_FIELDS`) to named arrays, plus ``loss_mask``:
    the weight of each pair (1; evaluation zeroes it for padding rows) and any precomputed reference log-probs.

    Raises:
        ValueError: naming the field, if a pair field is missing or the arrays are not ``[batch, position]``.
    """
    missing = [name for name in PAIR_FIELDS if name not in rows]
    if missing:
        raise ValueError(
            f"preference rows need the fields {', '.join(PAIR_FIELDS)}; missing {', '.join(missing)} "
            "(is data.format preference_chat?)"
        )
    arrays = {name: np.asarray(rows[name], dtype=np.int32) for name in PAIR_FIELDS}
    shape = arrays["chosen_input_ids"].shape
    if len(shape) != 2 or any(a.shape != shape for a in arrays.values()):
        raise ValueError(
            f"dpo_batch: every pair field must be [batch, position] of one shape, got "
            f"{ {k: a.shape for k, a in arrays.items()} }"
        )
    batch = {name: hax.named(a, AXES) for name, a in arrays.items()}
    batch["loss_mask"] = hax.named(np.ones(shape[:1], dtype=np.float32), ("batch",))
    for name in REFERENCE_FIELDS:
        if name in rows:
            batch[name] = hax.named(np.asarray(rows[name], dtype=np.float32).reshape(shape[:1]), ("batch",))
    return batch


def pair_loss(
    policy: tuple[Any, Any],
    reference: tuple[Any, Any] | None,
    batch: Mapping[str, hax.NamedArray],
    *,
    loss_type: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> Any:
    """The preference loss and ``dpo_*`` metrics of a batch of pairs (:func:`ponente.models.loss.preference_loss`).

    Args:
        policy: the policy's sequence log-probs ``(chosen, rejected)``.
        reference: the reference's (no gradient flows into them), or None for a reference-free loss.
        batch: the pair batch (:func:`dpo_batch`): its masks give the responses' lengths, ``loss_mask`` the pairs'
            weights.
        loss_type: ``sigmoid``, ``ipo``, ``hinge`` or ``simpo``.
        beta: the reward temperature.
        label_smoothing: conservative DPO's flip probability.
        simpo_gamma: SimPO's target margin.
    """
    import jax

    from ponente.models.loss import preference_loss

    ref_chosen = ref_rejected = None
    if reference is not None:
        ref_chosen, ref_rejected = jax.lax.stop_gradient(reference)
    return preference_loss(
        policy[0],
        policy[1],
        ref_chosen,
        ref_rejected,
        chosen_tokens=hax.sum(batch["chosen_loss_mask"], "position"),
        rejected_tokens=hax.sum(batch["rejected_loss_mask"], "position"),
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
        weights=batch["loss_mask"],
    )


def _pair_logprobs(model: Any, batch: Mapping[str, hax.NamedArray], *, key: Any) -> tuple[Any, Any]:
    """Sequence log-probs ``(chosen, rejected)`` of ``model``, both responses in one forward pass."""
    from ponente.models.loss import sequence_logprobs

    Batch = batch["chosen_input_ids"].resolve_axis("batch")
    tokens = hax.concatenate("batch", [batch["chosen_input_ids"], batch["rejected_input_ids"]])
    mask = hax.concatenate("batch", [batch["chosen_loss_mask"], batch["rejected_loss_mask"]])
    logp = sequence_logprobs(model, tokens, mask, key=key)
    return logp["batch", hax.ds(0, Batch.size)], logp["batch", hax.ds(Batch.size, Batch.size)]


class DpoTask(LmTask):
    """Preference-tune a trained language model (a ``TrainDpoConfig``: Levanter's ``train_dpo`` keys).

    Call :func:`~ponente.trainer.run.start_run` first: the vocabulary is padded for the devices' mesh.

    Args:
        config: the configuration (``initialize_from_hf`` or ``initialize_from_checkpoint_path``, ``data`` with
            ``format: preference_chat``, ``beta``, ``loss_type``, ``reference_model_path``, ``lora``, ...).

    Raises:
        ValueError: naming the key, if ``data`` is not preference data, or nothing says where the model starts.
    """

    def __init__(self, config: Any) -> None:
        check_training_data(config.data, hint="data.train_urls=[pairs.jsonl] data.format=preference_chat")
        found = getattr(getattr(config.data, "format", None), "choice_name", None)
        if found != "preference_chat":
            from ponente.trainer.config import ConfigError

            raise ConfigError(
                f"data.format: train_dpo trains on preference pairs; set data.format: preference_chat (got {found})"
            )
        model_config, vocab_size = config.model, None
        if config.initialize_from_hf and config.use_hf_model_config:
            model_config = hf_model_config(config.initialize_from_hf)
            vocab_size = hf_vocab_size(config.initialize_from_hf)
        self._setup(config, model_config, vocab_size, row_length(model_config.seq_len, config.train_seq_len))
        self.config = dataclasses.replace(config, model=self.model_config)
        self.dpo: Any = self.config  # the TrainDpoConfig (its keys beyond the task protocol's)
        self.export_every = config.hf_save_steps
        self.sample = None
        self.viz_logprobs = None
        self.eval_harness = None
        self.loss_type: str = config.loss_type
        self.lora: LoraConfig | None = config.lora
        self.peft_save_path: str | None = config.peft_save_path
        self.merged_hf_save_path: str | None = config.merged_hf_save_path
        self.checkpoint_path: str | None = config.initialize_from_checkpoint_path
        self.pretrained_key = "initialize_from_hf" if config.initialize_from_hf else "initialize_from_checkpoint_path"
        # where the reference log-probs come from: none (SimPO), the batch, the adapters switched off, or a model
        from ponente.models.loss import REFERENCE_FREE_LOSS_TYPES

        if self.loss_type in REFERENCE_FREE_LOSS_TYPES:
            self.reference = "none"
        elif config.precompute_reference:
            self.reference = "batch"
        elif self.lora is not None and config.reference_model_path is None:
            self.reference = "adapters off"
        else:
            self.reference = "model"
        self.reference_logps: dict[str, Any] = {}
        if self.lora is not None:
            import jax

            self.log_parameter_counts = True
            self.adapt_key = jax.random.fold_in(jax.random.PRNGKey(config.trainer.seed), 1)

    # -- the model --------------------------------------------------------------------------------------------
    def _adapted(self, model: Any) -> Any:
        if self.lora is None:
            return model
        from ponente.models.lora import loraize

        return loraize(model, self.lora, key=self.adapt_key)

    def _paired(self, policy: Any, reference: Any) -> Any:
        return PolicyAndReference(policy, reference) if self.reference == "model" else policy

    def build_model(self, key: Any) -> Any:
        """A freshly initialized model of the padded config (with adapters; paired with a reference for full DPO)."""
        base = super().build_model(key)
        return self._paired(self._adapted(base), base)

    def initial_model(self, mp: Any) -> Any:
        """The model the run starts from: ``initialize_from_hf`` or ``initialize_from_checkpoint_path``."""
        if self.initialize_from_hf:
            return super().pretrained_model(mp)
        if self.checkpoint_path:
            return mp.cast_to_param(
                load_model_from_checkpoint(self.model_config, self.vocab_size, self.checkpoint_path)
            )
        raise ValueError(
            "initialize_from_hf: preference tuning starts from a trained model; set initialize_from_hf (a Hugging "
            "Face folder or hub id) or initialize_from_checkpoint_path (a Ponente checkpoint)"
        )

    def reference_model(self, mp: Any, initial: Any) -> Any:
        """The frozen reference: ``reference_model_path`` (checked against the policy's shapes), else ``initial``."""
        path = self.dpo.reference_model_path
        if path is None:
            return initial
        if self.dpo.reference_is_hf:
            reference = load_hf_weights(path, self.model_config, mp, key="reference_model_path")
        else:
            reference = mp.cast_to_param(load_model_from_checkpoint(self.model_config, self.vocab_size, path))
        _check_same_shapes(reference, initial, path)
        return reference

    def pretrained_model(self, mp: Any) -> Any | None:
        """The initial model (with fresh adapters), paired with the reference for full DPO."""
        initial = self.initial_model(mp)
        reference = self.reference_model(mp, initial) if self.reference in ("model", "batch") else initial
        self._reference_weights = reference  # the precomputation's model (released once it ran)
        return self._paired(self._adapted(initial), reference)

    def trainable(self) -> Any:
        """The policy (its adapters only, with LoRA); never the reference."""
        import jax

        shapes = eqx.filter_eval_shape(self.build_model, jax.random.PRNGKey(0))
        policy = shapes.policy if isinstance(shapes, PolicyAndReference) else shapes
        if self.lora is not None:
            from ponente.models.lora import lora_trainable_filter

            mask = lora_trainable_filter(policy)
        else:
            mask = jax.tree_util.tree_map(lambda _: True, policy)
        if isinstance(shapes, PolicyAndReference):
            return PolicyAndReference(mask, jax.tree_util.tree_map(lambda _: False, shapes.reference))
        return mask

    def policy(self, model: Any) -> Any:
        """The policy of the trained model (what is exported and served)."""
        return model.policy if isinstance(model, PolicyAndReference) else model

    def eval_model(self, model: Any, key: Any = None) -> Any:
        """The model with the dropout keys of ``key`` in its adapters (None: no dropout)."""
        if self.lora is None:
            return model
        from ponente.models.lora import with_dropout_keys

        return with_dropout_keys(model, key)

    # -- batches and the loss ---------------------------------------------------------------------------------
    def make_batch(self, rows: Mapping[str, np.ndarray]) -> Any:
        """Pair rows to the named batch (:func:`dpo_batch`)."""
        return dpo_batch(rows)

    def placeholder_rows(self, count: int) -> dict[str, np.ndarray]:
        """Zeros in the layout of ``count`` pair rows of the run's length (with the reference log-probs if
        precomputed)."""
        rows = dict.fromkeys(PAIR_FIELDS, np.zeros((count, self.seq_len), dtype=np.int32))
        if self.reference == "batch":
            rows.update(dict.fromkeys(REFERENCE_FIELDS, np.zeros((count,), dtype=np.float32)))
        return rows

    def loss(self, model: Any, batch: Any, *, key: Any) -> Any:
        """The preference loss of the batch's pairs and the ``dpo_*`` metrics (see
        :func:`pair_loss`)."""
        policy = self.eval_model(self.policy(model), key)
        reference: tuple[Any, Any] | None = None
        if self.reference == "batch":
            reference = (batch["reference_chosen_logp"], batch["reference_rejected_logp"])
        elif self.reference == "model":
            reference = _pair_logprobs(model.reference, batch, key=None)
        elif self.reference == "adapters off":
            from ponente.models.lora import unwrap

            reference = _pair_logprobs(unwrap(self.policy(model)), batch, key=None)
        cfg = self.dpo
        return pair_loss(
            _pair_logprobs(policy, batch, key=key),
            reference,
            batch,
            loss_type=self.loss_type,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            simpo_gamma=cfg.simpo_gamma,
        )

    def flops_per_token(self) -> float | None:
        """Forward FLOPs per token of the policy (the reference's forward is not counted)."""
        return self.model_config.flops_per_token(self.vocab_size)

    # -- data -------------------------------------------------------------------------------------------------
    def datasets(self, seed: int, batch_size: int) -> tuple[Any, dict[str, Any]]:
        """The shuffled training pairs and the validation pairs (``validation_split_fraction`` of the training
        pairs when ``data`` has no validation set)."""
        from ponente.trainer.data import pair_datasets

        train, validation = pair_datasets(
            self.data, self.seq_len, seed=seed, validation_split_fraction=self.dpo.validation_split_fraction
        )
        if self.reference == "batch":
            train, validation = self._with_reference_fields(train, validation)
        return train, validation

    def _with_reference_fields(self, train: Any, validation: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        from ponente.trainer.data import WithRowFields

        def fields(name: str) -> Any:
            def lookup(indices: np.ndarray) -> dict[str, np.ndarray]:
                if name not in self.reference_logps:
                    raise RuntimeError(f"precompute_reference: the reference log-probs of {name!r} were not computed")
                values = self.reference_logps[name]
                return {REFERENCE_FIELDS[0]: values[0, indices], REFERENCE_FIELDS[1]: values[1, indices]}

            return lookup

        self._precompute_sets = {"train": WithRowFields(train, "train", fields("train"))}
        self._precompute_sets.update({name: WithRowFields(ds, name, fields(name)) for name, ds in validation.items()})
        sets = dict(self._precompute_sets)
        return sets.pop("train"), sets

    def evaluator(self, context: RunContext) -> Evaluator:
        """The loss and the ``dpo_*`` metrics on each validation set (``eval/<name>/dpo_accuracy``, ...)."""
        trainer = context.trainer
        return Evaluator(
            trainer, context.validation, trainer.config.max_eval_batches, make_batch=self.make_batch, metrics=True
        )

    def hooks(self, context: RunContext) -> list[Any]:
        """No LM hooks; with ``precompute_reference``, the reference log-probs are computed here, before step 1."""
        if self.reference == "batch":
            self._precompute(context)
        return []

    def _precompute(self, context: RunContext) -> None:
        """The reference log-probs of every training and validation pair, in batches on the trainer's mesh."""
        import jax

        from ponente.namedtensor.partitioning import named_jit

        trainer = context.trainer
        if jax.process_count() > 1:
            raise ValueError("precompute_reference: not supported in a multi-process run yet; set it to false")
        reference = trainer.mp.cast_to_compute(self._reference_weights)

        def logps(model: Any, batch: Any) -> Any:
            chosen, rejected = _pair_logprobs(model, batch, key=None)
            return chosen.array, rejected.array

        forward = named_jit(logps, trainer.compute_axis_mapping, in_axis_resources=trainer.parameter_axis_mapping)
        size = trainer.eval_batch_size
        for name, ds in self._precompute_sets.items():
            inner = ds.inner
            inner.wait_for_length(None)
            n = len(inner)
            out = np.zeros((2, n), dtype=np.float32)
            with jax.set_mesh(trainer.mesh):
                for start in range(0, n, size):
                    indices = np.minimum(np.arange(start, start + size), n - 1)  # the last batch repeats a row
                    rows = inner.get_batch(indices)
                    batch = self.make_batch({key: np.stack([r[key] for r in rows]) for key in PAIR_FIELDS})
                    chosen, rejected = forward(reference, batch)
                    keep = slice(0, min(size, n - start))
                    out[0, start : start + size] = np.asarray(chosen)[keep]
                    out[1, start : start + size] = np.asarray(rejected)[keep]
            self.reference_logps[name] = out
            logger.info("precompute_reference: reference log-probs of %d %s pairs", n, name)
        self._reference_weights = None

    # -- exports ----------------------------------------------------------------------------------------------
    def export(self, model: Any, subfolder: str | None) -> dict[str, str]:
        """The policy: a Hugging Face folder at ``hf_save_path``; with LoRA, the PEFT adapter at ``peft_save_path``
        and the merged model at ``merged_hf_save_path``."""
        from ponente.trainer.run import resolve_path

        policy = self.policy(model)
        written: dict[str, str] = {}
        if self.lora is None:
            return super().export(policy, subfolder)
        from ponente.models.hf import save_peft_pretrained
        from ponente.models.lora import merge_lora

        if self.peft_save_path is not None:
            where = resolve_path(self.peft_save_path + ("" if subfolder is None else f"/{subfolder}"))
            save_peft_pretrained(policy, self.lora, where, base_model_name_or_path=self.initialize_from_hf)
            written["peft adapter"] = where
        if self.merged_hf_save_path:
            written["hugging face export"] = self._export_hf(merge_lora(policy), self.merged_hf_save_path, subfolder)
        if self.hf_save_path:
            written["hugging face export"] = self._export_hf(merge_lora(policy), self.hf_save_path, subfolder)
        return written

    def finish(self, state: Any, context: RunContext) -> str | None:
        """Nothing sampled at the end of a preference run."""
        return None


def _check_same_shapes(reference: Any, policy: Any, path: str) -> None:
    """Raise ``ConfigError`` naming ``reference_model_path`` if the reference's parameters differ from the
    policy's."""
    import jax

    from ponente.trainer.config import ConfigError

    ref = {jax.tree_util.keystr(p): np.shape(x) for p, x in jax.tree_util.tree_leaves_with_path(reference)}
    pol = {jax.tree_util.keystr(p): np.shape(x) for p, x in jax.tree_util.tree_leaves_with_path(policy)}
    if ref.keys() != pol.keys():
        extra = sorted(set(ref) ^ set(pol))[:3]
        raise ConfigError(
            f"reference_model_path: the reference model at {path} is not the policy's architecture (parameters "
            f"differ: {', '.join(extra)})"
        )
    for name, shape in ref.items():
        if shape != pol[name]:
            raise ConfigError(
                f"reference_model_path: the reference model at {path} has {name} of shape {shape}, the policy "
                f"{pol[name]}; the reference must be the policy's architecture"
            )


def with_epochs(config: Any) -> Any:
    """``config`` (a ``TrainDpoConfig``) with ``trainer.num_train_steps`` of ``epoch`` passes over the training pairs
    (read from the cache, built here if needed), ``ceil(epoch * pairs / train_batch_size)``.

    Raises:
        ValueError: naming ``epoch`` if the batch size is not a number of pairs yet (``train_batch_size: -1``).
    """
    import math

    from ponente.trainer.data import pair_datasets

    batch = config.trainer.train_batch_size
    if batch < 1:
        raise ValueError(f"epoch: needs trainer.train_batch_size as a number of pairs, got {batch}")
    train_pairs, _ = pair_datasets(
        config.data, 2, seed=0, validation_split_fraction=config.validation_split_fraction
    )  # one pair per row whatever the length: the count does not depend on train_seq_len
    train_pairs.wait_for_length(None)
    steps = max(1, math.ceil(config.epoch * len(train_pairs) / batch))
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, num_train_steps=steps))
