"""The ``tensorboard`` tracker: TensorBoard event files written with tensorboardX.

What goes where:

- numeric scalars (Python, NumPy or JAX; bools as 0/1) -> scalar summaries at the logged step;
  TensorBoard stores scalars as float32, so use the ``json`` tracker where exact values matter;
- numeric arrays -> histograms; strings -> text summaries;
- hyperparameters -> one text summary ``hparams`` (a Markdown table of name and value);
- summary values -> scalars (or text) under ``summary/<name>`` at the last logged step;
- artifacts -> a text summary ``artifacts/<name>`` holding the path (TensorBoard stores no files).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import numpy as np

from ponente.trainer.tracker.tracker import NoopTracker, Tracker, TrackerConfig, _flatten_metrics, _format_run_path

if TYPE_CHECKING:
    from tensorboardX import SummaryWriter

__all__ = ["TensorboardConfig", "TensorboardTracker"]

logger = logging.getLogger(__name__)


class TensorboardTracker(Tracker):
    """Writes metrics to TensorBoard event files through a ``tensorboardX.SummaryWriter``.

    Args:
        writer: the writer; :meth:`TensorboardConfig.init` creates one at its ``logdir``.

    Example:
        >>> import tempfile
        >>> from tensorboardX import SummaryWriter
        >>> tracker = TensorboardTracker(SummaryWriter(tempfile.mkdtemp()))
        >>> tracker.log({"train/loss": 2.5}, step=1)
        >>> tracker.finish()
    """

    name: ClassVar[str] = "tensorboard"

    def __init__(self, writer: SummaryWriter) -> None:
        self.writer = writer
        self._last_step: int | None = None

    def log_hyperparameters(self, params: Mapping[str, Any]) -> None:
        """Write ``params`` as a Markdown table in the text summary ``hparams``."""
        rows = ["| name | value |", "|---|---|"]
        rows += [f"| {k} | {_escape_cell(v)} |" for k, v in _flatten_metrics(params).items()]
        self.writer.add_text("hparams", "\n".join(rows), global_step=0)

    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        """Write each metric at ``step`` (None: the last step logged, or 0); ``commit`` is ignored.

        Raises:
            TypeError: if a value is neither a number, a string, nor a numeric array.
        """
        if step is None:
            step = 0 if self._last_step is None else self._last_step
        step = int(step)
        self._last_step = step
        for key, value in _flatten_metrics(metrics).items():
            self._write(key, value, step)

    def log_summary(self, metrics: Mapping[str, Any]) -> None:
        """Write each value under ``summary/<name>`` at the last logged step."""
        step = 0 if self._last_step is None else self._last_step
        for key, value in _flatten_metrics(metrics).items():
            self._write(f"summary/{key}", value, step)

    def log_artifact(self, path: str | os.PathLike[str], *, name: str | None = None, type: str | None = None) -> None:
        """Record the artifact's path as the text summary ``artifacts/<name>``."""
        name = name or os.path.basename(path)
        kind = f" ({type})" if type else ""
        self.writer.add_text(f"artifacts/{name}", f"{os.path.abspath(path)}{kind}", global_step=0)

    def finish(self) -> None:
        """Flush and close the event file."""
        self.writer.flush()
        self.writer.close()

    def _write(self, key: str, value: Any, step: int) -> None:
        if isinstance(value, (bool, int, float)):
            self.writer.add_scalar(key, float(value), global_step=step)
        elif isinstance(value, str):
            self.writer.add_text(key, value, global_step=step)
        elif isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.number):
            self.writer.add_histogram(key, value.astype(np.float64), global_step=step)
        else:
            raise TypeError(
                f"tensorboard tracker cannot write metric {key!r} of type {type(value).__name__}; "
                "expected a number, a string or a numeric array"
            )


@TrackerConfig.register_subclass("tensorboard")
@dataclasses.dataclass(frozen=True)
class TensorboardConfig(TrackerConfig):
    """Config of :class:`TensorboardTracker` (``type: tensorboard``); fields follow ``SummaryWriter``.

    Only process 0 writes; other processes of a multi-host run get a :class:`NoopTracker`.
    """

    logdir: str = "tb_logs/{run_id}"
    """The event file folder; ``{run_id}`` is replaced by the run id (a timestamp when there is none)."""
    comment: str = ""
    """Appended to the default folder name (tensorboardX semantics)."""
    purge_step: int | None = None
    """When resuming, drop events at or after this step that a crashed run left behind."""
    max_queue: int = 10
    """Events queued in memory before a write."""
    flush_secs: int = 120
    """Seconds between flushes to disk."""
    filename_suffix: str = ""
    """Suffix of the event file name."""

    def init(self, run_id: str | None) -> Tracker:
        """Create a ``SummaryWriter`` at ``logdir`` (``{run_id}`` substituted) and wrap it.

        Raises:
            ImportError: if tensorboardX is not installed; the message says how to install it.
        """
        if jax.process_index() != 0:
            return NoopTracker()
        try:
            SummaryWriter = _summary_writer_class()
        except ImportError as exc:
            raise ImportError(
                "the tensorboard tracker needs tensorboardX: pip install 'ponente-trainer[tensorboard]' "
                "(or pip install tensorboardX)"
            ) from exc
        logdir = _format_run_path(self.logdir, run_id)
        logger.info("tensorboard tracker: writing event files to %s", logdir)
        writer = SummaryWriter(
            logdir,
            comment=self.comment,
            purge_step=self.purge_step,
            max_queue=self.max_queue,
            flush_secs=self.flush_secs,
            filename_suffix=self.filename_suffix,
        )
        return TensorboardTracker(writer)


def _summary_writer_class() -> type[SummaryWriter]:
    """``tensorboardX.SummaryWriter``, imported without importing PyTorch.

    tensorboardX imports ``torch`` when it is installed (seconds of start-up time), only to accept torch
    tensors, which this tracker never passes. Unless torch is already imported, it is hidden for the
    duration of the import. Call this on the main thread before other threads start importing: a thread
    that imported torch (or looked for it) at the same moment would be told that it is missing.
    """
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` raise ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _escape_cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")
