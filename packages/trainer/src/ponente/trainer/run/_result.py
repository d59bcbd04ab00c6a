"""What a training run produced, and how an entry point reports it."""

from __future__ import annotations

import dataclasses
import sys

from ._signals import NONFINITE_STOP, stop_exit_code

__all__ = ["TrainResult", "print_result"]


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
