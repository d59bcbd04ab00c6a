"""Start-up: JAX (and ``jax.distributed``) started for a run, the vocabulary fitted to the mesh that shards it, the
batch size resolved, and how long each phase between the process start and the first training step took."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ponente.models import LmConfig
    from ponente.trainer.distributed import DistributedConfig
    from ponente.trainer.trainer import TrainerConfig

__all__ = [
    "Startup",
    "check_context_parallel",
    "check_expert_parallel",
    "pad_vocab_for_partitioning",
    "process_age",
    "resolve_train_batch_size",
    "start_distributed",
]


def process_age() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


class Startup:
    """Wall-clock times of the phases between the process start and the first step, for the logs.

    Phases on the main thread end with :meth:`mark` (each lasts since the previous mark); work started in a
    background thread with :meth:`background` reports its own duration. Each phase is logged at DEBUG as it
    ends; :meth:`first_step` logs them all at INFO once.

    Example:
        >>> startup = Startup.since_process_start()
        >>> startup.mark("config")
        >>> list(startup.phases)[-1]
        'config'
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.last = start
        self.phases: dict[str, float] = {}
        self._lock = threading.Lock()
        self._reported = False

    @classmethod
    def since_process_start(cls) -> Startup:
        """Timing that starts when the process started; the first phase is ``interpreter start and imports``.

        Where the process's age is unknown (not Linux), timing starts now and there is no such phase.
        """
        age = process_age()
        startup = cls(time.perf_counter() - (age or 0.0))
        if age is not None:
            startup.mark("interpreter start and imports")
        return startup

    def _record(self, name: str, seconds: float) -> None:
        with self._lock:
            self.phases[name] = seconds
        logger.debug("startup: %s took %.2f s (%.2f s after start)", name, seconds, time.perf_counter() - self.start)

    def mark(self, name: str) -> None:
        """End the phase ``name`` on the calling thread: it lasted since the previous mark."""
        now = time.perf_counter()
        self._record(name, now - self.last)
        self.last = now

    def background(self, pool: ThreadPoolExecutor, name: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` in ``pool``; its duration is recorded as the phase ``name`` (``[bg]`` in the log)."""
        begun = time.perf_counter()

        def task() -> Any:
            try:
                return fn(*args)
            finally:
                self._record(f"[bg] {name}", time.perf_counter() - begun)

        return pool.submit(task)

    def first_step(self) -> None:
        """Log every phase at INFO, the first time it is called (call it after each step)."""
        if self._reported:
            return
        self._reported = True
        with self._lock:
            detail = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())
        logger.info("first step done %.1f s after start (%s)", time.perf_counter() - self.start, detail)


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


def check_expert_parallel(model_config: Any, tcfg: TrainerConfig) -> None:
    """Check that ``trainer.expert_axis_size`` fits the model: it splits the experts evenly; a dense model has none.

    Raises:
        ValueError: naming ``trainer.expert_axis_size`` when it is > 1 for a model without experts or does not divide
            ``model.num_experts``.
    """
    size = tcfg.expert_axis_size
    experts = getattr(model_config, "num_experts", None)
    if size > 1 and experts is None:
        raise ValueError(
            f"trainer.expert_axis_size={size}: model type {type(model_config).__name__} has no experts (expert "
            "parallelism needs a mixture of experts, e.g. mixtral or qwen3_moe); set it to 1"
        )
    if experts is not None and experts % size:
        raise ValueError(f"trainer.expert_axis_size={size} does not divide model.num_experts={experts}")


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
        axes (``replica`` x ``data`` x ``expert``).
    """
    if tcfg.train_batch_size != -1:
        return tcfg
    sizes = _mesh_sizes(tcfg, num_devices)
    batch = tcfg.per_device_parallelism * sizes["replica"] * sizes["data"] * sizes["expert"]
    logger.info("trainer.train_batch_size -1 -> %d (per_device_parallelism x data-parallel devices)", batch)
    return dataclasses.replace(tcfg, train_batch_size=batch)


def _mesh_sizes(tcfg: TrainerConfig, num_devices: int) -> dict[str, int]:
    """The sizes of the ``model``, ``expert``, ``context``, ``replica`` and ``data`` mesh axes of ``tcfg`` over
    ``num_devices`` devices."""
    model, expert, context = tcfg.model_axis_size, tcfg.expert_axis_size, tcfg.context_axis_size
    replica = tcfg.replica_axis_size * tcfg.replica_dcn_axis_size
    data = max(num_devices // (model * expert * context * replica), 1)
    return {"model": model, "expert": expert, "context": context, "replica": replica, "data": data}


def check_context_parallel(model_config: Any, tcfg: TrainerConfig, seq_len: int) -> None:
    """Check that ``trainer.context_axis_size`` fits the model: it has a ``position`` axis to split, and the sequence
    length divides into ``2 * context_axis_size`` zig-zag chunks.

    Raises:
        ValueError: naming ``trainer.context_axis_size``.
    """
    size = tcfg.context_axis_size
    if size == 1:
        return
    if getattr(model_config, "Pos", None) is None or getattr(model_config.Pos, "name", None) != "position":
        raise ValueError(
            f"trainer.context_axis_size={size}: model type {type(model_config).__name__} has no 'position' axis to "
            "split (context parallelism needs a decoder language model); set it to 1"
        )
    from ponente.models.context_parallel import check_context_split

    check_context_split(seq_len, size)
