"""The identity and record of a run: its id, its resolved configuration, and what is saved with its checkpoints."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from ponente.trainer.run_id import new_run_id

if TYPE_CHECKING:
    from ponente.trainer.tracker import Tracker
    from ponente.trainer.trainer import TrainerConfig

__all__ = ["RunConfig", "RunRecord", "new_run_id", "with_run_id"]


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
