"""The ``json`` tracker: one JSON object per ``log`` call, appended to a JSON-lines file, floats exact.

Files, for ``path: logs/{run_id}/metrics.jsonl``:

- ``metrics.jsonl``: one line per :meth:`JsonTracker.log` call, ``{"step": 3, "train/loss": 2.25, ...}``.
- ``metrics.hparams.json``: the hyperparameters, one JSON object (merged over calls).
- ``metrics.summary.json``: the summary values, one JSON object (merged over calls).
- ``metrics.artifacts.jsonl``: one line per artifact, ``{"path": ..., "name": ..., "type": ...}``.

Floats are written with ``repr`` (Python's ``json`` does), so ``json.loads`` gives back the identical
float; NumPy/JAX ``float32`` scalars are widened exactly to Python floats first. Non-finite values
are written as the tokens ``NaN``, ``Infinity`` and ``-Infinity``, which Python's ``json`` (and pandas)
read back; strict JSON parsers reject them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import jax
import numpy as np

from ponente.trainer.tracker.tracker import (
    NoopTracker,
    Tracker,
    TrackerConfig,
    _flatten_metrics,
    _format_run_path,
    _python_value,
    write_text_atomic,
)

__all__ = ["JsonTracker", "JsonTrackerConfig"]

logger = logging.getLogger(__name__)


class JsonTracker(Tracker):
    """Appends one JSON object per :meth:`log` call to a JSON-lines file (see the module docs for all files).

    Args:
        path: the metrics file (local path); parent folders are created, an existing file is appended to.

    Example:
        >>> import json, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> tracker = JsonTracker(path)
        >>> tracker.log({"loss": 0.1 + 0.2}, step=7)
        >>> tracker.finish()
        >>> json.loads(open(path).read())
        {'step': 7, 'loss': 0.30000000000000004}
    """

    name: ClassVar[str] = "json"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stem = self.path.name.removesuffix(".jsonl").removesuffix(".json")
        self.hparams_path = self.path.with_name(f"{stem}.hparams.json")
        self.summary_path = self.path.with_name(f"{stem}.summary.json")
        self.artifacts_path = self.path.with_name(f"{stem}.artifacts.jsonl")
        self._hparams: dict[str, Any] = _read_object(self.hparams_path)
        self._summary: dict[str, Any] = _read_object(self.summary_path)
        self._file = self.path.open("a", encoding="utf-8")
        logger.info("json tracker: logging metrics to %s", self.path)

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        """Merge ``params`` into ``<stem>.hparams.json``."""
        self._hparams.update(params)
        _write_object(self.hparams_path, self._hparams)

    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        """Append ``{"step": step, **flattened metrics}`` as one line (``commit`` is ignored).

        Raises:
            ValueError: if a metric is named ``step``.
            TypeError: if a value is not a number, string, bool, None, or NumPy/JAX array.
        """
        flat = _flatten_metrics(metrics)
        if "step" in flat:
            raise ValueError("json tracker: a metric may not be named 'step' (the key holds the step number)")
        record = {"step": _python_value(step), **flat}
        try:
            line = _dumps(record)
        except TypeError:
            for key, value in flat.items():
                try:
                    _dumps(value)
                except TypeError as exc:
                    raise TypeError(f"json tracker: metric {key!r} at step {step}: {exc}") from None
            raise
        self._file.write(line + "\n")
        self._file.flush()

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        """Merge the flattened ``metrics`` into ``<stem>.summary.json``."""
        self._summary.update(_flatten_metrics(metrics))
        _write_object(self.summary_path, self._summary)

    def log_artifact(self, path: str | os.PathLike[str], *, name: str | None = None, type: str | None = None) -> None:
        """Append ``{"path": absolute path, "name": ..., "type": ...}`` to ``<stem>.artifacts.jsonl``."""
        record = {"path": os.path.abspath(path), "name": name or os.path.basename(path), "type": type}
        with self.artifacts_path.open("a", encoding="utf-8") as f:
            f.write(_dumps(record) + "\n")

    def resume_from(self, step: int) -> None:
        """Drop the records of steps after ``step`` (left by a run killed after its last checkpoint).

        Records without a step are kept. The file is rewritten atomically (temporary file + rename).

        Args:
            step: the step the run resumes from.
        """
        self._file.close()
        kept = []
        dropped = 0
        for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True):
            if not line.strip():
                continue
            try:
                logged = json.loads(line).get("step")
            except json.JSONDecodeError:
                # a torn last line of a killed run: drop it
                dropped += 1
                continue
            if logged is not None and logged > step:
                dropped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
        if dropped:
            logger.info("json tracker: resuming at step %d, dropped %d records of later steps", step, dropped)
        write_text_atomic(self.path, "".join(kept))
        self._file = self.path.open("a", encoding="utf-8")

    def finish(self) -> None:
        """Close the metrics file."""
        self._file.close()


@TrackerConfig.register_subclass("json")
@dataclasses.dataclass(frozen=True)
class JsonTrackerConfig(TrackerConfig):
    """Config of :class:`JsonTracker` (``type: json``).

    Only process 0 writes; other processes of a multi-host run get a :class:`NoopTracker`.
    """

    path: str = "logs/{run_id}/metrics.jsonl"
    """The metrics file; ``{run_id}`` is replaced by the run id (a timestamp when there is none)."""

    def init(self, run_id: str | None) -> Tracker:
        """Create the tracker, writing to ``path`` with ``{run_id}`` substituted."""
        if jax.process_index() != 0:
            return NoopTracker()
        return JsonTracker(_format_run_path(self.path, run_id))


def _json_default(value: Any) -> Any:
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        converted = _python_value(value)
        return converted.tolist() if isinstance(converted, np.ndarray) else converted
    raise TypeError(f"json tracker cannot write a value of type {type(value).__name__}: {value!r}")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=_json_default, allow_nan=True)


def _read_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (an empty dict if there is no such file), so a resumed run merges."""
    if not path.exists():
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"json tracker: {path} is not valid JSON ({exc}); delete or repair it") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"json tracker: {path} should hold a JSON object, found {type(loaded).__name__}")
    return loaded


def _write_object(path: Path, obj: Mapping[str, Any]) -> None:
    """Write atomically (temporary file + rename), so a reader never sees half a file."""
    write_text_atomic(path, json.dumps(obj, default=_json_default, allow_nan=True, indent=2) + "\n")
