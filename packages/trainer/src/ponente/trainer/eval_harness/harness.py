"""Run ``lm-eval`` tasks on a :class:`~ponente.trainer.eval_harness.adapter.PonenteLM` and read the scores."""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from .config import MISSING_EXTRA, EvalHarnessConfig

__all__ = ["harness_metrics", "run_harness", "task_manager", "write_results"]


def task_manager(include_path: str | None, tasks: list[str], *, key: str = "eval_harness.tasks") -> Any:
    """An ``lm_eval`` ``TaskManager`` that knows ``tasks``.

    With ``include_path``, the local folder alone is indexed when it defines every task named (indexing
    lm-eval's thousands of packaged task files takes seconds); otherwise the packaged tasks are indexed too.

    Args:
        include_path: a folder of task YAML files (None: only lm-eval's tasks).
        tasks: the task or group names to find.
        key: the config key that named ``tasks``, for the error message.

    Returns:
        The task manager.

    Raises:
        ImportError: if ``lm_eval`` is not installed.
        ValueError: if a name is neither a task, a group nor a tag of lm-eval or of ``include_path``; one line
            naming ``key`` and the closest known names.
    """
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ImportError(MISSING_EXTRA) from e

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= _task_names(local):
            return local
    manager = TaskManager(include_path=include_path)
    known = _task_names(manager)
    unknown = [name for name in tasks if name not in known]
    if unknown:
        raise ValueError(_unknown_tasks_message(unknown, known, key, include_path))
    return manager


def _task_names(manager: Any) -> set[str]:
    return set(manager.all_tasks) | set(manager.all_groups) | set(manager.all_tags)


def _unknown_tasks_message(unknown: list[str], known: set[str], key: str, include_path: str | None) -> str:
    """One line: the unknown names, each with the known names closest to it."""
    where = "lm-eval's tasks, groups and tags" + (f" or those of include_path {include_path}" if include_path else "")
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
        parts.append(f"{name!r} (close names: {', '.join(close)})" if close else f"{name!r} (no close name)")
    plural = "s" if len(unknown) > 1 else ""
    return f"{key}: unknown task{plural} {'; '.join(parts)}: not among {where} ({len(known)} names)"


def run_harness(
    lm: Any, config: EvalHarnessConfig, *, log_samples: bool = False, manager: Any = None
) -> dict[str, Any]:
    """Evaluate ``lm`` on the configured tasks with ``lm_eval.simple_evaluate``.

    Args:
        lm: an ``lm_eval`` model, e.g. a :class:`~ponente.trainer.eval_harness.adapter.PonenteLM`.
        config: the tasks, ``limit``, ``num_fewshot``, ``include_path``, seed.
        log_samples: keep every request and answer under ``"samples"`` in the results.
        manager: the :func:`task_manager` of the configured tasks (None: made here).

    Returns:
        lm-eval's results dictionary (``"results"``: metrics per task, ``"configs"``, ``"versions"``, ...).

    Raises:
        ImportError: if ``lm_eval`` is not installed.
        ValueError: for an unknown task (see :func:`task_manager`), or if lm-eval returns nothing.
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
        task_manager=manager if manager is not None else task_manager(config.include_path, list(config.tasks)),
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
