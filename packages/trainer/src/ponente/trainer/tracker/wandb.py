"""The ``wandb`` tracker: Weights & Biases runs (online, ``offline`` with no network, or ``disabled``).

``wandb`` is the extra ``pip install 'ponente-trainer[wandb]'``; it is imported only when a
:class:`WandbConfig` creates its tracker. The config keys are Levanter's ``trainer.tracker`` keys.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import numpy as np

from ponente.trainer.tracker.tracker import Tracker, TrackerConfig, _flatten_metrics, _python_value

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["WandbConfig", "WandbTracker"]

logger = logging.getLogger(__name__)

_MODES = ("online", "offline", "disabled", "shared")


class WandbTracker(Tracker):
    """Forwards to a ``wandb`` run: metrics to its history, hyperparameters to its config.

    Args:
        run: the ``wandb.Run`` (from ``wandb.init``).
        xla_dump_dir: a folder of XLA dumps to upload as an artifact when the run finishes, or None.
    """

    name: ClassVar[str] = "wandb"

    def __init__(self, run: Any, *, xla_dump_dir: str | None = None) -> None:
        self.run = run
        self.xla_dump_dir = xla_dump_dir

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        """Update the run's config with ``params``."""
        self.run.config.update(_loggable(params), allow_val_change=True)

    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        """Log the flattened ``metrics`` to the run's history (``step`` and ``commit`` have W&B semantics)."""
        self.run.log(_loggable(_flatten_metrics(metrics)), step=step, commit=commit)

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        """Update the run's summary."""
        self.run.summary.update(_loggable(_flatten_metrics(metrics)))

    def log_artifact(self, path: str | os.PathLike[str], *, name: str | None = None, type: str | None = None) -> None:
        """Log a file or folder as a W&B artifact (``type`` defaults to ``"file"``)."""
        name = name or os.path.basename(path)
        self.run.log_artifact(os.fspath(path), name=_artifact_name(name), type=type or "file")

    def finish(self) -> None:
        """Upload the XLA dumps (if configured) and finish the run."""
        if self.xla_dump_dir is not None:
            if os.path.isdir(self.xla_dump_dir):
                self.log_artifact(self.xla_dump_dir, name="xla_dumps", type="xla_dumps")
            else:
                logger.warning("wandb: no XLA dump folder %s to upload (save_xla_dumps)", self.xla_dump_dir)
        self.run.finish()


@TrackerConfig.register_subclass("wandb")
@dataclasses.dataclass(frozen=True)
class WandbConfig(TrackerConfig):
    """Config of :class:`WandbTracker` (``type: wandb``), with Levanter's keys.

    ``mode: offline`` needs no network: the run is written under ``<dir>/wandb/offline-run-*`` and
    can be uploaded later with ``wandb sync``. Processes other than 0 run in ``disabled`` mode.
    """

    entity: str | None = None
    """The user or team that owns the run."""
    project: str | None = None
    """The project the run belongs to."""
    name: str | None = None
    """The run's display name."""
    tags: tuple[str, ...] = ()
    """Tags shown in the W&B UI."""
    id: str | None = None
    """The run id (for resuming); defaults to the trainer's run id."""
    group: str | None = None
    """Groups runs into a larger experiment."""
    mode: str | None = None
    """``online``, ``offline`` or ``disabled`` (None: what W&B decides, e.g. from ``WANDB_MODE``)."""
    dir: str | None = None
    """The folder where W&B writes its ``wandb/`` run folders (None: the working directory)."""
    save_code: bool = True
    """Let W&B save the code of the main script and the git state."""
    resume: str | None = None
    """W&B resume behaviour: ``allow``, ``must``, ``never``, ``auto`` or None."""
    save_xla_dumps: bool = False
    """Upload the XLA dump folder (``--xla_dump_to`` in ``XLA_FLAGS``) as an artifact when the run finishes."""

    def init(self, run_id: str | None) -> Tracker:
        """Start (or resume) the W&B run.

        Raises:
            ImportError: if wandb is not installed; the message names the extra.
            ValueError: if ``mode`` is not a W&B mode, or ``save_xla_dumps`` is set without ``--xla_dump_to``.
        """
        if self.mode is not None and self.mode not in _MODES:
            raise ValueError(f"trainer.tracker.mode: expected one of {list(_MODES)} or null, got {self.mode!r}")
        xla_dump_dir = _xla_dump_dir() if self.save_xla_dumps else None
        if self.save_xla_dumps and xla_dump_dir is None:
            raise ValueError(
                "trainer.tracker.save_xla_dumps is true but XLA_FLAGS has no --xla_dump_to=<folder>; "
                "set it (e.g. XLA_FLAGS=--xla_dump_to=/tmp/xla_dumps) or turn save_xla_dumps off"
            )
        wandb = _import_wandb()
        run_id_to_use = self.id if self.id is not None else run_id
        if run_id is not None and self.id is not None and run_id != self.id:
            warnings.warn(
                f"trainer run id {run_id!r} differs from trainer.tracker.id {self.id!r}; W&B uses {self.id!r}",
                stacklevel=2,
            )
        mode = self.mode if jax.process_index() == 0 else "disabled"
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        run = wandb.init(
            entity=self.entity,
            project=self.project,
            name=self.name,
            tags=list(self.tags),
            id=run_id_to_use,
            group=self.group,
            mode=mode,
            dir=self.dir,
            resume=self.resume,
            save_code=self.save_code,
        )
        if run is None:
            raise RuntimeError("wandb.init returned no run")
        run.summary.update(
            {"num_devices": jax.device_count(), "num_hosts": jax.process_count(), "backend": jax.default_backend()}
        )
        return WandbTracker(run, xla_dump_dir=xla_dump_dir)


def _import_wandb() -> ModuleType:
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("the wandb tracker needs wandb: pip install 'ponente-trainer[wandb]'") from exc
    return wandb


def _xla_dump_dir() -> str | None:
    match = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return match.group(1) if match else None


def _artifact_name(name: str) -> str:
    # W&B artifact names allow only alphanumerics, dashes, underscores and dots
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _loggable(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out[key] = _loggable(value)
        elif isinstance(value, (jax.Array, np.ndarray, np.generic)):
            out[key] = _python_value(value)
        else:
            out[key] = value
    return out
