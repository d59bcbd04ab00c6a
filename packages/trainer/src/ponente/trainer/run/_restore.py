"""Resume or initialize a run's state from checkpoints, reporting what changed in the configuration."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._differences import config_differences

if TYPE_CHECKING:
    from ponente.models import LmConfig
    from ponente.trainer.checkpoint import Checkpointer
    from ponente.trainer.trainer import TrainerConfig

__all__ = ["load_model_from_checkpoint", "restore"]

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
        ValueError: if the resume changes a key that must stay fixed and ``trainer.allow_config_change`` is false.
    """
    import equinox as eqx

    from ponente.trainer.checkpoint import latest_checkpoint_path, load_checkpoint, read_metadata

    source: str | None = None
    if tcfg.load_checkpoint is not False:
        if tcfg.load_checkpoint_path is not None:
            source = latest_checkpoint_path(tcfg.load_checkpoint_path) or tcfg.load_checkpoint_path
        else:
            source = checkpointer.latest_checkpoint_path()
        if source is None and tcfg.load_checkpoint:
            raise FileNotFoundError(
                f"trainer.load_checkpoint is true but {checkpointer.run_path} has no committed checkpoint"
            )
    if source is not None:
        metadata = read_metadata(source)
        if metadata is None:
            raise FileNotFoundError(f"trainer.load_checkpoint_path: {source} is not a committed checkpoint")
        saved = {k: metadata.get("metadata", {}).get(k) for k in ("config", "num_devices")}
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
        logger.info("resuming from %s", source)
        return load_checkpoint(state, source), source
    if tcfg.initialize_from is not None:
        logger.info("initializing the model from %s", tcfg.initialize_from)
        model = load_checkpoint(state.model, tcfg.initialize_from, subpath="model")
        return eqx.tree_at(lambda s: s.model, state, model), None
    return state, None


def load_model_from_checkpoint(model_config: LmConfig, vocab_size: int, checkpoint_path: str) -> Any:
    """Read only the model of a training checkpoint.

    Args:
        model_config: the model config the checkpoint was trained with.
        vocab_size: the size of its vocabulary axis.
        checkpoint_path: a checkpoint directory or a run directory (latest checkpoint).

    Returns:
        The model.
    """
    import equinox as eqx
    import jax

    import ponente.namedtensor as hax
    from ponente.trainer.checkpoint import load_checkpoint

    Vocab = hax.Axis("vocab", vocab_size)
    template = eqx.filter_eval_shape(lambda: model_config.build(Vocab, key=jax.random.PRNGKey(0)))
    return load_checkpoint(template, checkpoint_path, subpath="model")
