"""Which configuration keys differ between a checkpoint's run and the current one, and which of them matter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FIXED_ON_RESUME", "config_differences"]

FIXED_ON_RESUME = (
    "data",
    "data_seed",
    "model",
    "trainer.seed",
    "trainer.train_batch_size",
    "trainer.per_device_parallelism",
    "trainer.model_axis_size",
    "trainer.replica_axis_size",
    "trainer.replica_dcn_axis_size",
    "trainer.tensor_parallel_axes",
    "trainer.mp",
    "num_devices",
)
"""Dotted keys (and key prefixes) that must not change when a run resumes, or the continuation is no longer
bitwise identical to an uninterrupted run."""


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Compare the provenance of a checkpoint with the current run.

    Args:
        saved: the ``config`` recorded in the checkpoint (plus ``num_devices``).
        current: the same for the current run.

    Returns:
        ``(fixed, other)``: dotted keys that differ, split into those that must stay fixed for a bitwise
        resume (data, tokenizer, seq len, batch size, mesh, seed, ...; see :data:`FIXED_ON_RESUME`) and the
        rest. ``trainer.id`` is never reported.

    Example:
        >>> config_differences(
        ...     {"config": {"trainer": {"seed": 0, "num_train_steps": 10}}, "num_devices": 8},
        ...     {"config": {"trainer": {"seed": 1, "num_train_steps": 20}}, "num_devices": 8},
        ... )
        (['trainer.seed'], ['trainer.num_train_steps'])
    """
    # keys are reported without the ``config.`` prefix: ``data.tokenizer``, ``num_devices``
    a = _flat(saved.get("config") or {}) | {k: v for k, v in saved.items() if k != "config"}
    b = _flat(current.get("config") or {}) | {k: v for k, v in current.items() if k != "config"}
    differing = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not k.startswith("trainer.id"))
    fixed = [k for k in differing if any(k == f or k.startswith(f + ".") for f in FIXED_ON_RESUME)]
    return fixed, [k for k in differing if k not in fixed]
