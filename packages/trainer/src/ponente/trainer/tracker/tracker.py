"""The ``Tracker`` interface, its config family, composition, and the process-wide current tracker.

A tracker receives metrics (``log``), hyperparameters, summaries and artifacts. Training code logs
through the module-level :func:`log` (or :func:`jit_log` from inside ``jax.jit``), which forwards to
the tracker installed with :func:`set_global_tracker`.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import numpy as np

from ponente.trainer.config._registry import Registrable

__all__ = [
    "CompositeTracker",
    "NoopConfig",
    "NoopTracker",
    "Tracker",
    "TrackerConfig",
    "current_tracker",
    "init_trackers",
    "jit_log",
    "log",
    "set_global_tracker",
    "write_text_atomic",
]

logger = logging.getLogger(__name__)


class Tracker(abc.ABC):
    """Receives a run's metrics, hyperparameters, summary values and artifacts.

    Implementations: :class:`~ponente.trainer.tracker.JsonTracker`,
    :class:`~ponente.trainer.tracker.TensorboardTracker`, :class:`~ponente.trainer.tracker.WandbTracker`,
    :class:`NoopTracker`, and :class:`CompositeTracker` (fans out to several).

    Metric values may be Python numbers, strings, NumPy or JAX scalars/arrays; nested mappings are
    flattened with ``/`` (``{"train": {"loss": x}}`` is logged as ``"train/loss"``).
    """

    name: ClassVar[str] = "tracker"
    """A short name for messages."""

    @abc.abstractmethod
    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (typically the flattened, resolved config)."""

    @abc.abstractmethod
    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        """Record ``metrics`` at ``step``.

        Args:
            metrics: metric name -> value (numbers, strings, NumPy/JAX scalars or arrays, nested mappings).
            step: the training step these metrics belong to (None: the tracker's own notion, if any).
            commit: W&B semantics: ``False`` accumulates into the current step without closing it.
                Trackers that write one record per call ignore it.
        """

    @abc.abstractmethod
    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        """Record run-level summary values (final loss, number of devices, ...)."""

    @abc.abstractmethod
    def log_artifact(self, path: str | os.PathLike[str], *, name: str | None = None, type: str | None = None) -> None:
        """Record a file or directory produced by the run.

        Args:
            path: the file or directory.
            name: the artifact's name (default: the file name).
            type: a free-form kind, e.g. ``"requirements"`` or ``"config"``.
        """

    def resume_from(self, step: int) -> None:
        """Forget what was logged for steps after ``step``: the run resumes from a checkpoint of ``step``.

        A run killed after its last checkpoint logged steps that the resumed run logs again; trackers
        that can (``json``) drop those records so the log holds each step once. The default does
        nothing (TensorBoard readers and W&B keep the last value of a step anyway).

        Args:
            step: the step the run resumes from (0: a fresh start).
        """
        del step

    @abc.abstractmethod
    def finish(self) -> None:
        """Flush and close; the tracker must not be used afterwards."""


class NoopTracker(Tracker):
    """A tracker that records nothing (for benchmarks, tests, non-primary processes)."""

    name: ClassVar[str] = "noop"

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        """Ignore ``params``."""

    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        """Ignore ``metrics``."""

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        """Ignore ``metrics``."""

    def log_artifact(self, path: str | os.PathLike[str], *, name: str | None = None, type: str | None = None) -> None:
        """Ignore the artifact."""

    def finish(self) -> None:
        """Do nothing."""


class CompositeTracker(Tracker):
    """Forwards every call to each of several trackers, in order.

    Args:
        trackers: the trackers to fan out to.

    Example:
        >>> t = CompositeTracker([NoopTracker(), NoopTracker()])
        >>> t.log({"loss": 1.0}, step=0)
        >>> len(t.trackers)
        2
    """

    name: ClassVar[str] = "composite"

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers: tuple[Tracker, ...] = tuple(trackers)

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        """Forward to every tracker."""
        for tracker in self.trackers:
            tracker.log_hyperparameters(params)

    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        """Forward to every tracker."""
        for tracker in self.trackers:
            tracker.log(metrics, step=step, commit=commit)

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        """Forward to every tracker."""
        for tracker in self.trackers:
            tracker.log_summary(metrics)

    def log_artifact(self, path: str | os.PathLike[str], *, name: str | None = None, type: str | None = None) -> None:
        """Forward to every tracker."""
        for tracker in self.trackers:
            tracker.log_artifact(path, name=name, type=type)

    def resume_from(self, step: int) -> None:
        """Forward to every tracker."""
        for tracker in self.trackers:
            tracker.resume_from(step)

    def finish(self) -> None:
        """Finish every tracker; if several fail, the first error is raised after all were tried."""
        errors: list[BaseException] = []
        for tracker in self.trackers:
            try:
                tracker.finish()
            except Exception as exc:  # finish the others, then re-raise the first
                logger.exception("finishing tracker %s failed", tracker.name)
                errors.append(exc)
        if errors:
            raise errors[0]


class TrackerConfig(Registrable):
    """Base of the tracker config family, selected in YAML by ``type:``.

    The types are ``json``, ``tensorboard``, ``wandb`` and ``noop``. Without ``type`` the config is a
    ``json`` tracker, which needs no extra and no network.

    A tuple (a YAML list) of tracker configs composes: see :func:`init_trackers`.
    """

    default_choice: ClassVar[str | None] = "json"

    def init(self, run_id: str | None) -> Tracker:
        """Create the tracker this config describes for run ``run_id``.

        Raises:
            NotImplementedError: on the abstract base.
        """
        raise NotImplementedError(f"{type(self).__qualname__} must implement init(run_id)")


@TrackerConfig.register_subclass("noop")
@dataclasses.dataclass(frozen=True)
class NoopConfig(TrackerConfig):
    """Config of :class:`NoopTracker` (``type: noop``); it has no fields."""

    def init(self, run_id: str | None) -> Tracker:
        """Return a :class:`NoopTracker`."""
        return NoopTracker()


def init_trackers(config: TrackerConfig | Sequence[TrackerConfig], run_id: str | None) -> Tracker:
    """Create the tracker described by one config, or a :class:`CompositeTracker` for a sequence of them.

    Args:
        config: a tracker config or a sequence (YAML list) of them; an empty sequence gives a
            :class:`NoopTracker`.
        run_id: the run's id, substituted into ``{run_id}`` in paths and used as the W&B run id.

    Returns:
        The tracker.

    Raises:
        TypeError: if ``config`` (or an element) is not a :class:`TrackerConfig`; the message names the element.

    Example:
        >>> tracker = init_trackers((NoopConfig(), NoopConfig()), run_id="r1")
        >>> type(tracker).__name__
        'CompositeTracker'
    """
    if isinstance(config, TrackerConfig):
        return config.init(run_id)
    if isinstance(config, (str, bytes)) or not isinstance(config, Sequence):
        raise TypeError(f"tracker config must be a TrackerConfig or a list of them, got {type(config).__name__}")
    for i, element in enumerate(config):
        if not isinstance(element, TrackerConfig):
            raise TypeError(f"tracker config [{i}] must be a TrackerConfig, got {type(element).__name__}")
    if len(config) == 0:
        return NoopTracker()
    if len(config) == 1:
        return config[0].init(run_id)
    return CompositeTracker([c.init(run_id) for c in config])


def _format_run_path(template: str, run_id: str | None) -> str:
    """Substitute ``{run_id}`` in a path template (a timestamp when the run has no id)."""
    if run_id is None:
        run_id = time.strftime("run-%Y%m%d-%H%M%S")
    try:
        return template.format(run_id=run_id)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"path {template!r}: only the placeholder {{run_id}} is supported ({exc})") from exc


def _flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings with ``/`` and turn JAX/NumPy scalars into Python numbers.

    Arrays with more than zero dimensions become NumPy arrays; other values pass through.
    """
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be strings, got {key!r} ({type(key).__name__})")
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten_metrics(value, prefix=f"{name}/"))
        else:
            flat[name] = _python_value(value)
    return flat


def _python_value(value: Any) -> Any:
    """A JAX/NumPy scalar as a Python bool/int/float (exactly: float32 widens to float), an array as NumPy."""
    if isinstance(value, jax.Array):
        value = np.asarray(jax.device_get(value))
    if isinstance(value, (np.ndarray, np.generic)):
        return value.item() if value.ndim == 0 else np.asarray(value)
    return value


_global_tracker: Tracker | None = None


def current_tracker() -> Tracker:
    """The tracker installed with :func:`set_global_tracker`.

    Raises:
        RuntimeError: if none is installed.
    """
    if _global_tracker is None:
        raise RuntimeError(
            "no global tracker is set: call ponente.trainer.tracker.set_global_tracker(tracker) "
            "(or use it as a context manager) before logging"
        )
    return _global_tracker


class _GlobalTrackerScope:
    """Installed on construction; as a context manager, restores the previous tracker on exit."""

    def __init__(self, tracker: Tracker) -> None:
        global _global_tracker
        self._previous = _global_tracker
        self.tracker = tracker
        _global_tracker = tracker

    def __enter__(self) -> Tracker:
        return self.tracker

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        global _global_tracker
        _global_tracker = self._previous


def set_global_tracker(tracker: Tracker) -> _GlobalTrackerScope:
    """Install ``tracker`` as the process-wide current tracker (used by :func:`log` and :func:`jit_log`).

    It takes effect immediately; used as a context manager, the previous tracker is restored on exit.

    Args:
        tracker: the tracker to install.

    Returns:
        A context manager whose ``__enter__`` returns ``tracker``.

    Raises:
        TypeError: if ``tracker`` is not a :class:`Tracker`.

    Example:
        >>> with set_global_tracker(NoopTracker()):
        ...     log({"loss": 0.5}, step=0)
    """
    if not isinstance(tracker, Tracker):
        raise TypeError(f"set_global_tracker expects a Tracker, got {type(tracker).__name__}")
    return _GlobalTrackerScope(tracker)


def log(metrics: Mapping[str, Any], *, step: int | None = None, commit: bool | None = None) -> None:
    """Log ``metrics`` at ``step`` to the current global tracker (see :meth:`Tracker.log`).

    Raises:
        RuntimeError: if no global tracker is set.
    """
    current_tracker().log(metrics, step=step, commit=commit)


def jit_log(metrics: Mapping[str, Any], *, step: int | jax.Array | None = None) -> None:
    """Log ``metrics`` from inside ``jax.jit`` (also works outside) to the current global tracker.

    The values (and a traced ``step``) are sent to the host with an ordered ``jax.debug.callback``,
    so calls arrive in program order. The callback runs asynchronously: call
    ``jax.effects_barrier()`` before reading what a tracker wrote. The tracker is looked up when the
    callback runs, not when the function is traced.

    Args:
        metrics: a (nested) mapping of metric name -> array or number.
        step: the step, a Python int or a traced integer scalar; None lets the tracker decide.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> @jax.jit
        ... def f(x):
        ...     jit_log({"x_sum": jnp.sum(x)}, step=0)
        ...     return x * 2
        >>> with set_global_tracker(NoopTracker()):
        ...     _ = f(jnp.ones(3))
        ...     jax.effects_barrier()
    """
    jax.debug.callback(_log_from_device, dict(metrics), step, ordered=True)


def _log_from_device(metrics: dict[str, Any], step: Any) -> None:
    log(metrics, step=None if step is None else int(step))


def write_text_atomic(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never a part.

    The text goes to a temporary file of a unique name in the same folder (two writers never share one), which is
    then renamed over ``path``.
    """
    import uuid

    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
