"""Data of a run: token caches built once across processes, and an optional record of the rows each step read."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig, build_caches

if TYPE_CHECKING:
    from ponente.trainer.trainer import TrainerConfig

__all__ = ["RECORD_ROWS_ENV", "build_caches_once", "check_training_data", "rows_recorder"]

logger = logging.getLogger("ponente.trainer.run")

RECORD_ROWS_ENV = "PONENTE_RECORD_ROWS"
"""Environment variable: if set, :func:`rows_recorder` appends the rows of each step to ``$VALUE.<process index>``."""


def check_training_data(data: Any, hint: str) -> None:
    """Fail early when a single-source data config names no training data.

    Args:
        data: the data config (``LMDatasetConfig``, ``LMMixtureDatasetConfig``, ``AsrDatasetConfig``, ...).
        hint: what to pass instead, for the message (e.g. ``"--config_path gpt2_nano"``).

    Raises:
        ValueError: if ``data.train_urls`` is empty and ``data.id`` is not set.
    """
    if not hasattr(data, "configs") and not getattr(data, "train_urls", None) and getattr(data, "id", None) is None:
        raise ValueError(f"data.train_urls is empty and data.id is not set: nothing to train on (for example, {hint})")


def build_caches_once(data: LMDatasetConfig | LMMixtureDatasetConfig, tcfg: TrainerConfig) -> None:
    """In a multi-process run, process 0 builds the caches (on Ray with ``data.backend: ray``); the others follow.

    Process 0 starts the background build of every split that has data (of every component of a mixture)
    and returns once each has committed its first rows; its ``train_set``/``validation_sets`` then reuse the
    running builds. After a barrier the other processes switch to follower mode (`follow_cache_builds`):
    they read the caches while process 0 commits rows and never write them, so no two processes ever write
    the same cache and training starts before the corpus is fully tokenized. With one process it only joins
    Ray when the data asks for it.

    Args:
        data: the data config.
        tcfg: the trainer config (its ``ray`` and ``distributed`` sections).
    """
    import jax

    if getattr(data, "backend", "local") == "ray" or any(
        getattr(c, "backend", "local") == "ray" for c in getattr(data, "configs", {}).values()
    ):
        head = (tcfg.distributed.coordinator_address or "").rpartition(":")[0] or None
        tcfg.ray.initialize(process_index=jax.process_index(), num_processes=jax.process_count(), head_host=head)
    if jax.process_count() == 1:
        return
    from ponente.trainer.data import follow_cache_builds
    from ponente.trainer.distributed import barrier

    if jax.process_index() == 0:
        logger.info("process 0 builds the data caches in the background; the other processes follow them")
        for split in ("train", "validation"):
            if isinstance(data, LMMixtureDatasetConfig) or data.has_split(split):
                build_caches(data, split, background=True, progress=False)  # returns once the first rows commit
    barrier("ponente.train_lm: data caches started")
    if jax.process_index() != 0:
        follow_cache_builds(True)


def rows_recorder(rows: slice, batch_size: int) -> Callable[[int, Any], Any]:
    """``record(step, batch) -> batch``, for tests of multi-process data loading.

    With ``$PONENTE_RECORD_ROWS`` set, ``record`` appends one JSON line per step to
    ``$PONENTE_RECORD_ROWS.<process index>``: the global example indices of the step and the number of rows this
    process loaded. Otherwise it only returns the batch.

    Args:
        rows: the positions of each global batch that this process loads.
        batch_size: the global batch size.
    """
    where = os.environ.get(RECORD_ROWS_ENV)

    def record(step: int, batch: Any) -> Any:
        if where:
            import jax

            from ponente.trainer.data.loader import step_indices

            line = {
                "step": step,
                "indices": step_indices(step, batch_size, rows).tolist(),
                "loaded": len(batch["input_ids"]),
            }
            with open(f"{where}.{jax.process_index()}", "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        return batch

    return record
