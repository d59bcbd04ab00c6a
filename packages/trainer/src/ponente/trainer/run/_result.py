"""The end of a run and what it produced: the final checkpoint, the trackers' summary, where everything went, the
:class:`TrainResult` and its exit status (:func:`stop_exit_code`: after a SIGTERM or Ctrl-C, handled by
:func:`ponente.trainer.trainer.stop_on_signals`, the run checkpoints and exits with ``trainer.preemption_exit_code``,
0 by default; after a non-finite loss with 1)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._provenance import RunRecord

__all__ = [
    "NONFINITE_STOP",
    "PREEMPTED_EXIT_CODE",
    "TrainResult",
    "final_checkpoint",
    "finish_trackers",
    "output_locations",
    "print_result",
    "resolve_path",
    "stop_exit_code",
]


@dataclasses.dataclass
class TrainResult:
    """What a run produced.

    Attributes:
        run_id: the run id.
        steps: the number of completed steps.
        final_loss: the last training loss (None if no step ran).
        eval_loss: the last evaluation loss per validation set.
        checkpoint: the latest committed checkpoint (None if none was written).
        resumed_from: the checkpoint the run resumed from (None for a fresh start).
        hf_path: the Hugging Face export folder (None if not exported).
        sample: the sampled text (None if not sampled).
        stopped: the reason the run stopped early (None when all steps ran).
        outputs: named locations the run wrote (logs, checkpoints, ...).
        exit_code: the process exit status the run asks for (None: from ``stopped``, see
            :func:`~ponente.trainer.run.stop_exit_code`; runs set it from ``trainer.preemption_exit_code``).
    """

    run_id: str
    steps: int
    final_loss: float | None
    eval_loss: dict[str, float]
    checkpoint: str | None
    resumed_from: str | None
    hf_path: str | None
    sample: str | None
    stopped: str | None
    outputs: dict[str, str]
    exit_code: int | None = None


def print_result(result: TrainResult) -> int:
    """Print what the run produced (stdout; an early stop on stderr) and return the process exit code.

    Returns:
        ``result.exit_code`` if set, else 0 when every step ran, the preemption exit code (0) when the run stopped
        early (SIGTERM, Ctrl-C) after saving its checkpoint (running it again resumes), 1 when it stopped on a
        non-finite loss (printed as ``error: <reason>``).
    """
    print(f"run {result.run_id}: {result.steps} steps, final train loss {result.final_loss}")
    for name, loss in result.eval_loss.items():
        print(f"  eval {name}: {loss:.4f}")
    if result.checkpoint:
        print(f"  checkpoint: {result.checkpoint}")
    for name, where in result.outputs.items():
        print(f"  {name}: {where}")
    if result.sample is not None:
        print("  sample:")
        for line in result.sample.splitlines():
            print(f"    {line}")
    code = result.exit_code if result.exit_code is not None else stop_exit_code(result.stopped)
    if result.stopped is not None:
        sys.stdout.flush()
        if result.stopped.startswith(NONFINITE_STOP):
            saved = f"; the last good state is saved in {result.checkpoint}" if result.checkpoint else ""
            print(f"error: stopped: {result.stopped}{saved}", file=sys.stderr)
        else:
            print(f"stopped early: {result.stopped}", file=sys.stderr)
    return code


PREEMPTED_EXIT_CODE = 0
"""The default exit code of a run stopped by SIGTERM or Ctrl-C after saving its checkpoint
(``trainer.preemption_exit_code``)."""

NONFINITE_STOP = "non-finite loss"
"""How the stop reason of a run ended by a NaN/Inf loss (``trainer.on_nonfinite_loss: stop``) begins."""


def stop_exit_code(stopped: str | None, preemption_exit_code: int = PREEMPTED_EXIT_CODE) -> int:
    """The exit status of a run that ended for ``stopped`` (None: every step ran).

    Args:
        stopped: the run's stop reason (``TrainResult.stopped``): ``"SIGTERM"``, ``"SIGINT"``, or one starting
            with :data:`NONFINITE_STOP`.
        preemption_exit_code: ``trainer.preemption_exit_code``.

    Returns:
        0 when every step ran, ``preemption_exit_code`` after a SIGTERM or Ctrl-C (the checkpoint is saved:
        running again resumes), 1 after a non-finite loss (an error: the checkpoint holds the last good state).

    Example:
        >>> stop_exit_code(None), stop_exit_code("SIGTERM"), stop_exit_code("SIGTERM", 75)
        (0, 0, 75)
        >>> stop_exit_code("non-finite loss: step 7: non-finite loss=nan")
        1
    """
    if stopped is None:
        return 0
    if stopped.startswith(NONFINITE_STOP):
        return 1
    return preemption_exit_code


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
