"""Devices: start JAX (and ``jax.distributed``) for a run, and fit the vocabulary to the mesh that shards it."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from ponente.models import LmConfig
    from ponente.trainer.distributed import DistributedConfig
    from ponente.trainer.trainer import TrainerConfig

__all__ = ["pad_vocab_for_partitioning", "resolve_train_batch_size", "start_distributed"]

logger = logging.getLogger("ponente.trainer.run")

M = TypeVar("M", bound="LmConfig")


def start_distributed(distributed: DistributedConfig) -> None:
    """Prepare JAX for a run; call it before anything touches a device.

    Turns on partitionable threefry, so random bits do not depend on how arrays are sharded (a run resumed on
    another mesh draws the same dropout masks and the same initialization), then joins the multi-process run
    described by ``distributed`` (nothing on one host).
    """
    import jax

    jax.config.update("jax_threefry_partitionable", True)
    distributed.initialize()


def pad_vocab_for_partitioning(model_config: M, tcfg: TrainerConfig, num_devices: int) -> M:
    """Round the vocabulary up (``vocab_padding_multiple``) so that it splits evenly where it is sharded.

    Args:
        model_config: the model config.
        tcfg: the trainer config: its mesh sizes and the axes ``vocab`` is mapped to (parameters and compute).
        num_devices: the number of devices of the mesh.

    Returns:
        ``model_config``, or a copy whose ``vocab_padding_multiple`` is a multiple of the number of shards.
    """
    sizes = _mesh_sizes(tcfg, num_devices)
    shards = 1
    for mapping in (tcfg.parameter_axis_mapping, tcfg.compute_axis_mapping):
        physical = mapping.get("vocab")
        names = [physical] if isinstance(physical, str) else list(physical or ())
        shards = math.lcm(shards, math.prod(sizes.get(n, 1) for n in names))
    multiple = math.lcm(model_config.vocab_padding_multiple, shards)
    if multiple == model_config.vocab_padding_multiple:
        return model_config
    logger.info(
        "vocab_padding_multiple %d -> %d: the vocab axis is split %d ways",
        model_config.vocab_padding_multiple,
        multiple,
        shards,
    )
    return dataclasses.replace(model_config, vocab_padding_multiple=multiple)


def resolve_train_batch_size(tcfg: TrainerConfig, num_devices: int) -> TrainerConfig:
    """``tcfg`` with ``train_batch_size: -1`` (Levanter's convention) made concrete: one microbatch per step.

    Args:
        tcfg: the trainer config.
        num_devices: the number of devices of the mesh.

    Returns:
        ``tcfg``, or a copy whose ``train_batch_size`` is ``per_device_parallelism`` x the size of the batch's mesh
        axes (``replica`` x ``data``).
    """
    if tcfg.train_batch_size != -1:
        return tcfg
    sizes = _mesh_sizes(tcfg, num_devices)
    batch = tcfg.per_device_parallelism * sizes["replica"] * sizes["data"]
    logger.info("trainer.train_batch_size -1 -> %d (per_device_parallelism x data-parallel devices)", batch)
    return dataclasses.replace(tcfg, train_batch_size=batch)


def _mesh_sizes(tcfg: TrainerConfig, num_devices: int) -> dict[str, int]:
    """The sizes of the ``model``, ``replica`` and ``data`` mesh axes of ``tcfg`` over ``num_devices`` devices."""
    model = tcfg.model_axis_size
    replica = tcfg.replica_axis_size * tcfg.replica_dcn_axis_size
    return {"model": model, "replica": replica, "data": max(num_devices // (model * replica), 1)}
