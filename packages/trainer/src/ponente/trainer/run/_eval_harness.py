"""lm-eval tasks during training: the ``eval_harness:`` section's scores logged every N steps."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ponente.trainer.callbacks import Hook, StepInfo
    from ponente.trainer.eval_harness import EvalHarnessConfig
    from ponente.trainer.tracker import Tracker

__all__ = ["eval_harness_hook"]

logger = logging.getLogger("ponente.trainer.run")


def eval_harness_hook(
    config: EvalHarnessConfig,
    *,
    tokenizer: Any,
    tracker: Tracker,
    vocab_size: int | None = None,
    mesh: Any = None,
    axis_mapping: Any = None,
    parameter_axis_mapping: Any = None,
    eval_model: Callable[[Any], Any] | None = None,
) -> Hook:
    """The training hook that runs the configured lm-eval tasks and logs ``lm_eval/<task>/<metric>``.

    It runs every ``config.every`` steps and once more when training ends. Every process evaluates (the model's
    arrays may be sharded across processes); the trackers keep process 0's scores.

    Args:
        config: the ``eval_harness`` section.
        tokenizer: the data's ``tokenizers.Tokenizer``.
        tracker: where the scores go.
        vocab_size: the tokenizer's vocabulary size (ids of a padded vocabulary axis beyond it are never predicted).
        mesh: the device mesh the model lives on (None: the default device).
        axis_mapping: logical -> mesh axes while computing (the trainer's ``compute_axis_mapping``).
        parameter_axis_mapping: how the parameters are stored (the trainer's ``parameter_axis_mapping``).
        eval_model: ``eval_model(model) -> model`` to evaluate (e.g. cast to the compute dtype; None: as it is).

    Returns:
        The hook (append it to ``Trainer.hooks``).

    Raises:
        ImportError: if ``lm_eval`` is not installed (at once, not after the first steps).
    """
    from ponente.trainer.callbacks import Hook
    from ponente.trainer.eval_harness import MISSING_EXTRA

    if importlib.util.find_spec("lm_eval") is None:
        raise ImportError(MISSING_EXTRA)

    def evaluate(info: StepInfo) -> None:
        from ponente.trainer.eval_harness import harness_metrics, run_harness
        from ponente.trainer.eval_harness.adapter import PonenteLM

        model = info.state.model if eval_model is None else eval_model(info.state.model)
        lm = PonenteLM(
            model,
            tokenizer,
            batch_size=config.batch_size,
            max_length=config.max_length,
            max_gen_toks=config.max_gen_toks,
            vocab_size=vocab_size,
            mesh=mesh,
            axis_mapping=axis_mapping,
            parameter_axis_mapping=parameter_axis_mapping,
        )
        metrics = harness_metrics(run_harness(lm, config))
        logger.info("step %d: %s", info.step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
        tracker.log(metrics, step=info.step)

    return Hook(evaluate, every=config.every, name="eval_harness")
