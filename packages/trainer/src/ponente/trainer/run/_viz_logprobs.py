"""The log-prob page during training: the first validation rows drawn at each evaluation (and logged to W&B)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ponente.trainer.callbacks import Hook, StepInfo
    from ponente.trainer.tracker import Tracker

__all__ = ["VizLogprobsConfig", "logprob_pages"]

logger = logging.getLogger("ponente.trainer.run")

WANDB_KEY = "viz/logprobs"
"""The W&B history key of the page."""


@dataclasses.dataclass(frozen=True)
class VizLogprobsConfig:
    """The ``viz_logprobs:`` section of a training config: a log-prob page of some validation rows, over time.

    Every ``every`` steps (and once more at the end of training) the first ``num_docs`` rows of each validation
    set are run through the model and drawn as a self-contained HTML page
    (:func:`ponente.trainer.viz_logprobs.render_page`), written to ``path`` and, when a ``wandb`` tracker is
    on, logged to it as ``wandb.Html`` under ``viz/logprobs``.

    Attributes:
        every: write the page every this many steps (None: at each evaluation, ``trainer.steps_per_eval``).
        num_docs: rows of each validation set to draw.
        top_k: alternatives shown per token.
        path: where to write the page; ``{run_id}`` and ``{step}`` are filled in (None:
            ``<trainer.run_dir>/logprobs/step-{step}.html``, or ``logprobs/{run_id}/step-{step}.html`` without a
            run folder). A local path or an fsspec URL.
    """

    every: int | None = None
    num_docs: int = 4
    top_k: int = 5
    path: str | None = None

    def __post_init__(self) -> None:
        for key in ("every", "num_docs", "top_k"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"viz_logprobs.{key}: must be >= 1, got {value}")

    def page_path(self, *, run_id: str, run_dir: str | None, step: int) -> str:
        """Where the page of ``step`` goes (see :attr:`path`).

        Raises:
            ValueError: if :attr:`path` has a placeholder other than ``{run_id}`` and ``{step}``.
        """
        if self.path is not None:
            template = self.path
        elif run_dir is not None:
            template = run_dir.rstrip("/") + "/logprobs/step-{step}.html"
        else:
            template = "logprobs/{run_id}/step-{step}.html"
        try:
            return template.format(run_id=run_id, step=step)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"viz_logprobs.path: only {{run_id}} and {{step}} can be filled in ({exc})") from exc


def logprob_pages(
    config: VizLogprobsConfig,
    *,
    datasets: Mapping[str, Any],
    tokenizer: Any,
    tracker: Tracker,
    run_id: str,
    run_dir: str | None,
    steps_per_eval: int,
    mesh: Any = None,
    eval_model: Callable[[Any], Any] | None = None,
) -> Hook:
    """The training hook that writes the log-prob page of :class:`VizLogprobsConfig`.

    The rows are read on the first call (the validation caches may still be building when training starts)
    and stay the same for the whole run, so that successive pages show the same text. Every process runs the
    model (its arrays may be sharded across processes); process 0 writes the page and logs it.

    Args:
        config: the ``viz_logprobs`` section.
        datasets: the validation sets by name (rows with ``input_ids``, ``segment_ids``, ...).
        tokenizer: the ``tokenizers.Tokenizer`` of the data.
        tracker: the run's tracker; the page goes to each ``wandb`` tracker in it.
        run_id: the run id (for :meth:`VizLogprobsConfig.page_path`).
        run_dir: the run folder (``trainer.run_dir`` filled in; None: none).
        steps_per_eval: the period when ``config.every`` is None.
        mesh: the device mesh the model lives on (None: the default device).
        eval_model: ``eval_model(model) -> model`` to evaluate (e.g. cast to the compute dtype; None: as it is).

    Returns:
        The hook (append it to ``Trainer.hooks``).

    Raises:
        ValueError: if there is no validation set to draw from.
    """
    from ponente.trainer.callbacks import Hook

    if not datasets:
        raise ValueError("viz_logprobs: there is no validation set to draw (set data.validation_urls or data.id)")
    rows: list[Any] = []
    names: list[str] = []

    def write(info: StepInfo) -> None:
        import contextlib

        import jax

        from ponente.trainer.viz_logprobs import document_logprobs, render_page, validation_rows, write_page

        if not rows:
            found_rows, found_names = validation_rows(datasets, config.num_docs)
            rows.extend(found_rows)
            names.extend(found_names)
        model = info.state.model if eval_model is None else eval_model(info.state.model)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            documents = document_logprobs(model, rows, names=names, top_k=config.top_k)
        if jax.process_index() != 0:
            return
        page = render_page(documents, tokenizer, title=f"Token log-probabilities of run {run_id} at step {info.step}")
        path = write_page(page, config.page_path(run_id=run_id, run_dir=run_dir, step=info.step))
        logger.info("step %d: log-prob page %s", info.step, path)
        _log_to_wandb(tracker, page, info.step)

    return Hook(write, every=config.every or steps_per_eval, name="viz_logprobs")


def _log_to_wandb(tracker: Tracker, page: str, step: int) -> None:
    """Log ``page`` as ``wandb.Html`` to every ``wandb`` tracker in ``tracker`` (the others cannot show HTML)."""
    from ponente.trainer.tracker import CompositeTracker, WandbTracker

    trackers = tracker.trackers if isinstance(tracker, CompositeTracker) else (tracker,)
    for each in trackers:
        if isinstance(each, WandbTracker):
            import wandb

            # inject=False: W&B would otherwise add a stylesheet link from its servers to the page
            each.log({WANDB_KEY: wandb.Html(page, inject=False, data_is_not_path=True)}, step=step)
