"""Where the step runs: the ``(replica, data, expert, context, model)`` device mesh and how programs are compiled
for it."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

from ponente.namedtensor.partitioning import make_mesh

from ._config import TrainerConfig

logger = logging.getLogger(__name__)


def build_mesh(config: TrainerConfig, devices: list[Any]) -> jax.sharding.Mesh:
    """The ``(replica, data, expert, context, model)`` mesh over ``devices``; hybrid (ICI x DCN) when
    ``replica_dcn_axis_size > 1``."""
    model, replica, dcn = config.model_axis_size, config.replica_axis_size, config.replica_dcn_axis_size
    expert, context = config.expert_axis_size, config.context_axis_size
    per_group = model * expert * context * replica * dcn
    if len(devices) % per_group != 0:
        sizes = {
            "model_axis_size": model,
            "expert_axis_size": expert,
            "context_axis_size": context,
            "replica_axis_size": replica,
            "replica_dcn_axis_size": dcn,
        }
        named = [f"{k}={v}" for k, v in sizes.items() if v != 1 or k == "model_axis_size"]
        raise ValueError(
            f"trainer.{' x '.join(named)} = {per_group} does not divide the {len(devices)} devices"
            if len(named) > 1
            else f"trainer.{named[0]} does not divide the {len(devices)} devices"
        )
    if dcn == 1:
        shape = {"replica": replica, "data": -1, "expert": expert, "context": context, "model": model}
        return make_mesh(shape, devices=devices)
    grid = hybrid_device_grid(config, devices)
    return jax.sharding.Mesh(
        grid, ("replica", "data", "expert", "context", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 5
    )


def hybrid_device_grid(config: TrainerConfig, devices: list[Any]) -> np.ndarray:
    """The devices of a hybrid mesh as a ``(replica_dcn * replica, data, expert, context, model)`` array.

    The granules of the data-center network are the slices (``device.slice_index``, TPU multi-slice) when
    the devices come from ``replica_dcn_axis_size`` different slices, else the processes (GPUs, CPUs).
    Granule ``k`` (in increasing slice / process index) fills rows ``k * replica .. (k + 1) * replica - 1``
    of the ``replica`` axis, so only the ``replica`` axis crosses the slower network.
    """
    from jax.experimental import mesh_utils

    model, replica, dcn = config.model_axis_size, config.replica_axis_size, config.replica_dcn_axis_size
    expert, context = config.expert_axis_size, config.context_axis_size
    data = len(devices) // (model * expert * context * replica * dcn)
    slices = {getattr(d, "slice_index", None) for d in devices}
    by_process = None in slices or len(slices) != dcn
    logger.info("hybrid mesh: %d %s along the replica axis", dcn, "process groups" if by_process else "slices")
    try:
        grid: np.ndarray = mesh_utils.create_hybrid_device_mesh(
            (replica, data, expert, context, model), (dcn, 1, 1, 1, 1), devices, process_is_granule=by_process
        )
    except (ValueError, AssertionError) as e:
        raise ValueError(
            f"trainer.replica_dcn_axis_size={dcn}: cannot lay out a hybrid mesh of {dcn} slices/process groups x "
            f"(replica={replica}, data={data}, expert={expert}, context={context}, model={model}) over "
            f"{len(devices)} devices: {e}"
        ) from e
    return grid


def enable_compilation_cache(path: str) -> None:
    """Point JAX's persistent compilation cache at ``path`` unless the user configured one already."""
    if getattr(jax.config, "jax_compilation_cache_dir", None):
        return
    resolved = os.path.expanduser(path)
    os.makedirs(resolved, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", resolved)
    # cache every compilation that takes noticeable time, so a warm start skips all of them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    logger.info("JAX persistent compilation cache: %s", resolved)


def init_compiler_options(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """XLA options of the program that builds the initial state.

    That program runs once and only draws random numbers and zeros. On CPU, LLVM's optimization of its
    threefry kernels costs seconds of compilation for milliseconds of run time (about 5 s against 1 s for
    the hello world), so it is compiled unoptimized there. The options are part of the compilation (and
    persistent cache) key, so every run of a configuration still gets the same initial bits.
    """
    if mesh.devices.flat[0].platform == "cpu":
        return {"xla_backend_optimization_level": 0}
    return {}
