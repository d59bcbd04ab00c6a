"""The end of a run: the final checkpoint and the trackers' summary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["final_checkpoint", "finish_trackers"]


def final_checkpoint(checkpointer: Any, state: Any) -> str | None:
    """Save ``state`` (unless no step ran), wait for every pending save, and return the latest committed checkpoint.

    Args:
        checkpointer: the run's :class:`~ponente.trainer.checkpoint.Checkpointer` (closed afterwards).
        state: the final state.

    Returns:
        The path of the latest committed checkpoint (None if the run never wrote one).
    """
    steps = int(state.step)
    if steps > 0:
        checkpointer.on_step(state, steps, force=True)
    checkpointer.close()
    return checkpointer.latest_checkpoint_path()


def finish_trackers(
    tracker: Any, *, steps: int, final_loss: float | None, eval_loss: Mapping[str, float]
) -> dict[str, Any]:
    """Log the run's summary (``steps``, ``final/train_loss``, ``final/eval/<name>/loss``) and close the trackers.

    Returns:
        The summary logged.
    """
    summary: dict[str, Any] = {"steps": steps}
    if final_loss is not None:
        summary["final/train_loss"] = final_loss
    summary |= {f"final/eval/{k}": v for k, v in eval_loss.items()}
    tracker.log_summary(summary)
    tracker.finish()
    return summary
