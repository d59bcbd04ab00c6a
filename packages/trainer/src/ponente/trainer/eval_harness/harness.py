"""Run ``lm-eval`` tasks on a :class:`~ponente.trainer.eval_harness.adapter.PonenteLM` and read the scores."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from .config import MISSING_EXTRA, EvalHarnessConfig

__all__ = ["harness_metrics", "run_harness", "task_manager", "write_results"]


def task_manager(include_path: str | None, tasks: list[str]) -> Any:
    """An ``lm_eval`` ``TaskManager`` that knows ``tasks``.

    With ``include_path``, the local folder alone is indexed when it defines every task named (indexing
    lm-eval's thousands of packaged task files takes seconds); otherwise the packaged tasks are indexed too.

    Args:
        include_path: a folder of task YAML files (None: only lm-eval's tasks).
        tasks: the task or group names to find.

    Returns:
        The task manager.

    Raises:
        ImportError: if ``lm_eval`` is not installed.
    """
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ImportError(MISSING_EXTRA) from e

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks) | set(local.all_groups) | set(local.all_tags):
            return local
    return TaskManager(include_path=include_path)


def run_harness(lm: Any, config: EvalHarnessConfig, *, log_samples: bool = False) -> dict[str, Any]:
    """Evaluate ``lm`` on the configured tasks with ``lm_eval.simple_evaluate``.

    Args:
        lm: an ``lm_eval`` model, e.g. a :class:`~ponente.trainer.eval_harness.adapter.PonenteLM`.
        config: the tasks, ``limit``, ``num_fewshot``, ``include_path``, seed.
        log_samples: keep every request and answer under ``"samples"`` in the results.

    Returns:
        lm-eval's results dictionary (``"results"``: metrics per task, ``"configs"``, ``"versions"``, ...).

    Raises:
        ImportError: if ``lm_eval`` is not installed.
        ValueError: if lm-eval returns nothing (e.g. an unknown task).
    """
    try:
        import lm_eval
    except ImportError as e:
        raise ImportError(MISSING_EXTRA) from e

    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(config.tasks),
        num_fewshot=config.num_fewshot,
        limit=config.limit,
        bootstrap_iters=config.bootstrap_iters,
        log_samples=log_samples,
        task_manager=task_manager(config.include_path, list(config.tasks)),
        random_seed=config.seed,
        numpy_random_seed=config.seed,
        torch_random_seed=config.seed,
        fewshot_random_seed=config.seed,
    )
    if results is None:
        raise ValueError(f"eval_harness.tasks: lm-eval returned no results for {config.tasks}")
    return dict(results)


def harness_metrics(results: Mapping[str, Any], prefix: str = "lm_eval") -> dict[str, float]:
    """The numeric scores of lm-eval results as flat tracker metrics ``<prefix>/<task>/<metric>``.

    lm-eval names a score ``"<metric>,<filter>"``; the filter ``none`` is dropped, another one is appended
    (``exact_match_strict-match``). Standard errors that were not computed (``"N/A"``) are left out.

    Args:
        results: what :func:`run_harness` returned.
        prefix: the first part of every name.

    Returns:
        ``{name: value}``.
    """
    metrics: dict[str, float] = {}
    for task, scores in results.get("results", {}).items():
        for key, value in scores.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            metric, _, kind = key.partition(",")
            name = metric if kind in ("", "none") else f"{metric}_{kind}"
            metrics[f"{prefix}/{task}/{name}"] = float(value)
    return metrics


def write_results(results: Mapping[str, Any], path: str | os.PathLike[str]) -> str:
    """Write lm-eval results as JSON (values JSON cannot hold are written as text).

    Args:
        results: what :func:`run_harness` returned.
        path: the file (its folder is created).

    Returns:
        The path written.
    """
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=str, ensure_ascii=False)
    return os.fspath(path)
