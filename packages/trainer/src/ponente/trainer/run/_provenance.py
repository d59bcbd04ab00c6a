"""The identity and record of a run: its id, its resolved configuration, what is saved with its checkpoints, and
which configuration keys differ between a checkpoint's run and the current one (and which of them matter)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from ponente.trainer.run_id import new_run_id

if TYPE_CHECKING:
    from ponente.trainer.tracker import Tracker
    from ponente.trainer.trainer import TrainerConfig

__all__ = ["FIXED_ON_RESUME", "RunConfig", "RunRecord", "config_differences", "new_run_id", "with_run_id"]


class RunConfig(Protocol):
    """A run's root configuration: a frozen dataclass with a ``trainer`` section (e.g. ``TrainLmConfig``)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def trainer(self) -> TrainerConfig: ...


C = TypeVar("C", bound=RunConfig)


def with_run_id(config: C) -> C:
    """``config`` with ``trainer.id`` set: kept when given (a resumed run), else a :func:`new_run_id`."""
    trainer = config.trainer
    return dataclasses.replace(config, trainer=dataclasses.replace(trainer, id=trainer.id or new_run_id()))


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What identifies a run: its id, resolved configuration and number of devices.

    Attributes:
        run_id: the run id (``trainer.id``).
        config: the resolved configuration as nested plain data (``config_to_dict``).
        num_devices: the number of JAX devices of all processes.
        run_dir: where the run record files go (``trainer.run_dir`` with ``{run_id}`` filled in; None: none).
    """

    run_id: str
    config: dict[str, Any]
    num_devices: int
    run_dir: str | None = None

    @classmethod
    def of(cls, config: RunConfig) -> RunRecord:
        """The record of ``config``, whose ``trainer.id`` must be set (see :func:`with_run_id`).

        Raises:
            ValueError: if ``config.trainer.id`` is None.
        """
        import jax

        from ponente.trainer.config import config_to_dict

        tcfg = config.trainer
        if tcfg.id is None:
            raise ValueError("trainer.id: a run record needs a run id; call with_run_id(config) first")
        run_dir = tcfg.run_dir.format(run_id=tcfg.id) if tcfg.run_dir else None
        return cls(run_id=tcfg.id, config=config_to_dict(config), num_devices=jax.device_count(), run_dir=run_dir)

    @property
    def provenance(self) -> dict[str, Any]:
        """``{"config": ..., "num_devices": ...}``: the metadata saved with every checkpoint of the run, which a
        resumed run compares with its own (:func:`config_differences`)."""
        return {"config": dict(self.config), "num_devices": self.num_devices}

    def write(self, tracker: Tracker) -> dict[str, Any]:
        """Log the configuration, git commit, versions and ``pip freeze`` to ``tracker`` (and to :attr:`run_dir`).

        Returns:
            What was recorded (see :func:`ponente.trainer.tracker.log_run_info`).
        """
        from ponente.trainer.tracker import log_run_info

        return log_run_info(tracker, self.config, run_dir=self.run_dir)


FIXED_ON_RESUME = (
    "data",
    "data_seed",
    "model",
    "trainer.seed",
    "trainer.train_batch_size",
    "trainer.per_device_parallelism",
    "trainer.model_axis_size",
    "trainer.expert_axis_size",
    "trainer.replica_axis_size",
    "trainer.replica_dcn_axis_size",
    "trainer.tensor_parallel_axes",
    "trainer.mp",
    "trainer.quantization",
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
