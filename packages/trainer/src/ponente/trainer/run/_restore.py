"""Resume or initialize a run's state from checkpoints, reporting what changed in the configuration."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ._provenance import config_differences

if TYPE_CHECKING:
    from ponente.models import LmConfig
    from ponente.trainer.checkpoint import Checkpointer
    from ponente.trainer.trainer import TrainerConfig

__all__ = ["ModelSource", "find_checkpoint", "load_model_from_checkpoint", "load_model_of", "restore"]

logger = logging.getLogger("ponente.trainer.run")


def restore(
    state: Any, tcfg: TrainerConfig, checkpointer: Checkpointer, provenance: Mapping[str, Any]
) -> tuple[Any, str | None]:
    """Resume or initialize ``state`` per ``trainer.load_checkpoint*`` / ``trainer.initialize_from``.

    A resume loads the whole state (model, optimizer, step, training key) of the latest committed checkpoint of
    the run (or of ``trainer.load_checkpoint_path``), after comparing the checkpoint's provenance with
    ``provenance`` (:func:`config_differences`): a change of a key that must stay fixed is an error unless
    ``trainer.allow_config_change``, in which case it is a warning; other changes are logged.
    ``trainer.initialize_from`` (when there is nothing to resume) loads only the model of another run.

    A damaged checkpoint (:class:`~ponente.trainer.checkpoint.CheckpointCorruptError`) is skipped for the
    previous committed one with ``trainer.checkpointer.on_corrupt: fallback`` (a warning names it and says
    why), or refused with ``error``. A ``load_checkpoint_path`` that names one checkpoint has no fallback.

    Args:
        state: the freshly initialized state (its shapes and shardings are the template).
        tcfg: the trainer config.
        checkpointer: the run's checkpointer (where its own checkpoints are).
        provenance: the current run's ``{"config", "num_devices"}`` (:attr:`RunRecord.provenance`).

    Returns:
        ``(state, resumed_from)``: the state to train from, and the checkpoint resumed from (None otherwise).

    Raises:
        FileNotFoundError: if ``trainer.load_checkpoint`` is true and there is no checkpoint, or
            ``trainer.load_checkpoint_path`` is not a committed checkpoint.
        CheckpointCorruptError: if the checkpoint to resume from is damaged and ``on_corrupt`` is ``error``, or
            every committed checkpoint is damaged.
        ValueError: if the resume changes a key that must stay fixed and ``trainer.allow_config_change`` is false.
    """
    import equinox as eqx

    from ponente.trainer.checkpoint import CheckpointCorruptError, load_checkpoint

    candidates: list[str] = []
    if tcfg.load_checkpoint is not False:
        where = tcfg.load_checkpoint_path if tcfg.load_checkpoint_path is not None else checkpointer.run_path
        candidates = _resume_candidates(where)
        if not candidates and tcfg.load_checkpoint_path is not None:
            candidates = [tcfg.load_checkpoint_path]  # not a checkpoint: reported below, by name
        if not candidates and tcfg.load_checkpoint:
            raise FileNotFoundError(
                f"trainer.load_checkpoint is true but {checkpointer.run_path} has no committed checkpoint"
            )
    skipped: list[str] = []
    for source in candidates:
        try:
            step = _check_resume(source, tcfg, provenance)
            loaded = load_checkpoint(state, source)
        except CheckpointCorruptError as exc:
            if tcfg.checkpointer.on_corrupt == "error" or (len(candidates) == 1 and not skipped):
                how = "trainer.checkpointer.on_corrupt is error" if len(candidates) > 1 else "no other checkpoint"
                raise CheckpointCorruptError(f"{exc} (not resuming: {how})") from exc
            logger.warning("skipping damaged checkpoint %s: %s", source, exc)
            skipped.append(source)
            continue
        if skipped:
            logger.warning(
                "resuming from %s, the newest readable checkpoint; skipped %d damaged: %s",
                source,
                len(skipped),
                ", ".join(skipped),
            )
        else:
            logger.info("resuming from %s", source)
        if tcfg.load_checkpoint_path is None:
            checkpointer.loaded(step)  # a newer damaged checkpoint is overwritten when training reaches its step
        return loaded, source
    if skipped:
        raise CheckpointCorruptError(f"every committed checkpoint is damaged: {', '.join(skipped)}; not resuming")
    if tcfg.initialize_from is not None:
        logger.info("initializing the model from %s", tcfg.initialize_from)
        model = load_checkpoint(state.model, tcfg.initialize_from, subpath="model")
        return eqx.tree_at(lambda s: s.model, state, model), None
    return state, None


def _resume_candidates(path: str) -> list[str]:
    """The checkpoints a resume from ``path`` may use, newest first: ``path`` alone if it is a checkpoint itself
    (damaged or not), else the committed checkpoints below it."""
    from ponente.trainer.checkpoint import CheckpointCorruptError, discover_checkpoints, read_metadata
    from ponente.trainer.checkpoint._location import normalize

    try:
        if read_metadata(path) is not None:
            return [normalize(path)]
    except CheckpointCorruptError:
        return [normalize(path)]
    return [c.path for c in reversed(discover_checkpoints(path)) if c.committed]


def _check_resume(source: str, tcfg: TrainerConfig, provenance: Mapping[str, Any]) -> int:
    """Compare the configuration recorded in checkpoint ``source`` with this run's; returns its step.

    Raises:
        FileNotFoundError: if ``source`` is not a committed checkpoint.
        CheckpointCorruptError: if its ``metadata.json`` is damaged.
        ValueError: if a key that must stay fixed changed and ``trainer.allow_config_change`` is false.
    """
    from ponente.trainer.checkpoint import read_metadata

    metadata = read_metadata(source)
    if metadata is None:
        raise FileNotFoundError(f"trainer.load_checkpoint_path: {source} is not a committed checkpoint")
    recorded = metadata.get("metadata")
    recorded = recorded if isinstance(recorded, dict) else {}
    saved = {k: recorded.get(k) for k in ("config", "num_devices")}
    fixed, other = config_differences(saved, provenance)
    if fixed:
        message = (
            f"resuming from {source} with a configuration that changes {', '.join(fixed)}: the continuation "
            "will not be bitwise identical to an uninterrupted run"
        )
        if not tcfg.allow_config_change:
            raise ValueError(message + " (set trainer.allow_config_change=true to resume anyway)")
        logger.warning("%s (allowed by trainer.allow_config_change)", message)
    if other:
        logger.info("resuming with changed config keys: %s", ", ".join(other))
    step = metadata.get("step")
    return step if isinstance(step, int) else 0


class ModelSource(Protocol):
    """The keys of a tool that reads a model (``eval_lm``, ``viz_logprobs``): exactly one of the two checkpoints."""

    @property
    def data(self) -> Any: ...  # LMDatasetConfig | LMMixtureDatasetConfig (``data_vocab_size`` of it)
    @property
    def model(self) -> LmConfig: ...
    @property
    def checkpoint_path(self) -> str | None: ...
    @property
    def hf_checkpoint(self) -> str | None: ...


def load_model_of(config: ModelSource) -> Any:
    """The model of ``config.hf_checkpoint`` (a Hugging Face folder), else of the training checkpoint
    ``config.checkpoint_path`` read as ``config.model`` with ``config.data``'s vocabulary size
    (:func:`load_model_from_checkpoint`).

    Raises:
        FileNotFoundError: if there is no committed checkpoint at ``checkpoint_path``.
        ConfigError: if ``model`` does not describe the checkpoint (names the parameter and both shapes).
    """
    if config.hf_checkpoint is not None:
        from ponente.models.hf import load_pretrained

        return load_pretrained(config.hf_checkpoint)
    if config.checkpoint_path is None:
        raise ValueError("checkpoint_path / hf_checkpoint: set exactly one of them")
    from ponente.trainer.data import data_vocab_size

    return load_model_from_checkpoint(config.model, data_vocab_size(config.data), config.checkpoint_path)


def load_model_from_checkpoint(model_config: LmConfig, vocab_size: int | None, checkpoint_path: str) -> Any:
    """Read only the model of a training checkpoint.

    The configured model is compared with the checkpoint's parameters before anything is read, so a model
    section that does not describe the checkpoint is one line naming the parameter and both shapes. Parameters
    are loaded in the dtype the checkpoint stores them in (e.g. ``bfloat16`` after ``trainer.mp: p=bf16``).

    Args:
        model_config: the model config the checkpoint was trained with.
        vocab_size: the size of its vocabulary (None: the checkpoint's ``vocab`` axis); a checkpoint whose
            vocabulary is larger (a pretrained model's, which the run kept) keeps its own size.
        checkpoint_path: a checkpoint directory or a run directory (latest checkpoint).

    Returns:
        The model.

    Raises:
        FileNotFoundError: if there is no committed checkpoint at ``checkpoint_path``.
        ConfigError: if the configured model's parameters differ from the checkpoint's (names or shapes).
    """
    import equinox as eqx
    import jax

    import ponente.namedtensor as hax
    from ponente.trainer.checkpoint import load_checkpoint, read_metadata

    where = find_checkpoint(checkpoint_path)
    stored = _model_leaves((read_metadata(where) or {}).get("leaves", {}))
    saved_vocab = max(
        (e["shape"][e["axes"].index("vocab")] for e in stored.values() if "vocab" in e["axes"]), default=0
    )
    Vocab = hax.Axis("vocab", vocab_size if vocab_size is not None else saved_vocab)
    if model_config.padded_vocab(Vocab).size < saved_vocab:
        Vocab = hax.Axis("vocab", saved_vocab)
    template = eqx.filter_eval_shape(lambda: model_config.build(Vocab, key=jax.random.PRNGKey(0)))
    return load_checkpoint(_as_stored(template, stored, where), where, subpath="model")


def find_checkpoint(path: str, key: str | None = None) -> str:
    """The committed checkpoint at ``path`` (a step folder) or the latest one below it (a run folder).

    Args:
        path: a checkpoint directory, a run directory or a checkpoint base path (local or remote).
        key: the configuration key ``path`` comes from, named in the error (None: none).

    Returns:
        The checkpoint directory.

    Raises:
        FileNotFoundError: ``no checkpoint at <path>`` if nothing is there, or ``no committed checkpoint at
            <path>`` naming the incomplete step folders if only those are.
    """
    from ponente.trainer.checkpoint import discover_checkpoints, latest_checkpoint_path

    try:
        latest = latest_checkpoint_path(path)
        found = discover_checkpoints(path) if latest is None else []
    except ValueError:  # the storage refuses to list it: a plain file, not a folder
        latest, found = None, []
    if latest is not None:
        return latest
    where = f" ({key})" if key else ""
    if found:
        incomplete = ", ".join(os.path.basename(c.path) for c in found[-3:])
        verb = "is" if len(found) == 1 else "are"
        raise FileNotFoundError(
            f"no committed checkpoint at {path}{where}: {incomplete} {verb} incomplete (no metadata.json; the run "
            "may have been stopped while writing)"
        )
    raise FileNotFoundError(f"no checkpoint at {path}{where}")


def _model_leaves(leaves: dict[str, Any]) -> dict[str, dict[str, Any]]:
    # the checkpoint's array entries under ``model.``, by their path inside the model
    return {
        name.removeprefix("model."): {**e, "shape": list(e.get("shape") or []), "axes": list(e.get("axes") or [])}
        for name, e in leaves.items()
        if name.startswith("model.") and e.get("kind") == "array"
    }


def _as_stored(template: Any, stored: dict[str, dict[str, Any]], where: str) -> Any:
    """``template`` with each array in the checkpoint's dtype, after checking that every array is stored there
    with the same shape (a :class:`ConfigError` naming the first parameter that differs)."""
    import jax
    import numpy as np

    from ponente.namedtensor import NamedArray
    from ponente.trainer.config import ConfigError

    missing: list[str] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def adopt(path: Any, leaf: Any) -> Any:
        inner = leaf.array if isinstance(leaf, NamedArray) else leaf
        if not isinstance(inner, jax.ShapeDtypeStruct):
            return leaf
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        entry = stored.get(name)
        if entry is None:
            missing.append(name)
            return leaf
        if tuple(entry["shape"]) != tuple(inner.shape):
            mismatched.append((name, tuple(entry["shape"]), tuple(inner.shape)))
            return leaf
        dtype = np.dtype(entry["dtype"]) if "dtype" in entry else inner.dtype
        adopted = jax.ShapeDtypeStruct(inner.shape, dtype, sharding=getattr(inner, "sharding", None))
        return NamedArray(adopted, leaf.axes) if isinstance(leaf, NamedArray) else adopted

    adopted = jax.tree_util.tree_map_with_path(adopt, template, is_leaf=lambda x: isinstance(x, NamedArray))
    if mismatched:
        name, found, expected = mismatched[0]
        more = f" ({len(mismatched) - 1} more parameters differ)" if len(mismatched) > 1 else ""
        raise ConfigError(
            f"model: checkpoint parameter {name} has shape {found}, the configured model expects {expected}{more}"
        )
    if missing:
        known = ", ".join(sorted(stored)[:3]) or "none"
        raise ConfigError(
            f"model: the configured model has a parameter {missing[0]} that checkpoint {where} does not store "
            f"({len(missing)} such; the checkpoint's model has {known}, ...): check model.type"
        )
    return adopted
