"""Where a run writes: checkpoints, run record, tracker logs (printed at the end of a run)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._provenance import RunRecord

__all__ = ["output_locations", "resolve_path"]


def resolve_path(path: str) -> str:
    """``path`` made absolute, unless it is a URL (``gs://...``, ``memory://...``), which stays as it is."""
    return path if "://" in path else str(Path(path).resolve())


def output_locations(record: RunRecord, *, checkpoints: str, trackers: Any | Sequence[Any]) -> dict[str, str]:
    """The named locations a run writes to.

    Args:
        record: the run record (its id and run folder).
        checkpoints: the run's checkpoint folder (``Checkpointer.run_path``).
        trackers: ``trainer.tracker``: one tracker config or a tuple of them.

    Returns:
        ``{"checkpoints": ..., "run record": ..., "<tracker type> logs": ...}`` with absolute paths (or URLs);
        the run record only when the run has a run folder, a tracker only when it writes to a path.
    """
    outputs = {"checkpoints": resolve_path(checkpoints)}
    if record.run_dir is not None:
        outputs["run record"] = resolve_path(record.run_dir)
    for tracker_config in trackers if isinstance(trackers, tuple) else (trackers,):
        for attr in ("logdir", "path"):
            where = getattr(tracker_config, attr, None)
            if isinstance(where, str):
                outputs[f"{tracker_config.choice_name} logs"] = resolve_path(where.format(run_id=record.run_id))
    return outputs
