"""Multi-host setup: :class:`DistributedConfig` starts ``jax.distributed``, :class:`RayConfig` joins a Ray cluster.

A multi-host run starts one Python process per host (or per GPU); each calls :meth:`DistributedConfig.initialize`
before touching a device. The processes then see one global set of devices, and the trainer's mesh spans all
of them. On a cluster manager JAX knows (SLURM, Open MPI, TPU pods) the coordinator address, the number of
processes and the process id are detected from the environment; elsewhere they are given explicitly.

A process that dies must not leave the others hanging in a collective: the coordination service's heartbeat
(``heartbeat_timeout_seconds``) ends the survivors with an error naming the missing process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DistributedConfig", "RayConfig", "barrier", "is_process_zero"]

logger = logging.getLogger(__name__)

_SLURM_ENV = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")
_MULTI_PROCESS_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")

_initialized_with: dict[str, Any] | None = None


def _env_says_multi_process(env: Mapping[str, str]) -> str | None:
    """The name of the cluster environment that asks for several processes, or None."""
    if all(k in env for k in _SLURM_ENV) and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "SLURM"
    for key in _MULTI_PROCESS_ENV:
        if key in env:
            if key.endswith("_SIZE") and int(env.get(key, "1")) <= 1:
                continue
            return key
    return None


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process JAX run (``trainer.distributed``; Levanter's keys).

    Leave every field None on one host: :meth:`initialize` then does nothing unless the environment says
    the job has several processes (SLURM with more than one task, Open MPI, a TPU pod), in which case JAX
    detects the coordinator, the number of processes and this process's id itself.

    Attributes:
        coordinator_address: ``host:port`` of process 0's coordination service (None: detect).
        num_processes: the number of processes of the job (None: detect).
        process_id: this process's index, ``0 .. num_processes - 1`` (None: detect).
        local_device_ids: the local devices this process uses (None: all visible ones).
        initialization_timeout: seconds to wait for all processes to connect.
        heartbeat_timeout_seconds: a process that misses heartbeats this long counts as dead, and the others
            stop with an error naming it instead of hanging in a collective.
        shutdown_timeout_seconds: seconds the processes wait for each other at a clean shutdown.
        cluster_detection_method: force a JAX cluster detection method (e.g. ``"slurm"``, ``"mpi4py"``);
            None: JAX tries them all.
        auto: initialize when the environment says the job is multi-process even if no field is set; False
            never initializes from the environment alone.

    Example:
        ```python
        from ponente.trainer.distributed import DistributedConfig

        cfg = DistributedConfig()  # one host: initialize() is a no-op
        assert not cfg.is_multi_process(env={})
        two = DistributedConfig(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=0)
        assert two.is_multi_process(env={})
        ```
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: int | list[int] | None = None
    initialization_timeout: int = 300
    heartbeat_timeout_seconds: int = 30
    shutdown_timeout_seconds: int = 60
    cluster_detection_method: str | None = None
    auto: bool = True

    def __post_init__(self) -> None:
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"trainer.distributed.num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None:
            if self.process_id < 0:
                raise ValueError(f"trainer.distributed.process_id must be >= 0, got {self.process_id}")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ValueError(
                    f"trainer.distributed.process_id={self.process_id} is not below "
                    f"trainer.distributed.num_processes={self.num_processes}"
                )
        for name in ("initialization_timeout", "heartbeat_timeout_seconds", "shutdown_timeout_seconds"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.distributed.{name} must be >= 1, got {getattr(self, name)}")

    def is_multi_process(self, env: Mapping[str, str] | None = None) -> bool:
        """Whether this config (or, with ``auto``, the environment) asks for a multi-process run.

        Args:
            env: the environment to inspect (default: ``os.environ``).

        Returns:
            True if :meth:`initialize` will call ``jax.distributed.initialize``.
        """
        if self.coordinator_address is not None or (self.num_processes or 1) > 1:
            return True
        if self.num_processes == 1:
            return False
        return self.auto and _env_says_multi_process(os.environ if env is None else env) is not None

    def initialize(self) -> bool:
        """Call ``jax.distributed.initialize`` once per process, if this is a multi-process run.

        Must run before anything touches a device. A second call with the same settings does nothing; with
        other settings it raises.

        Returns:
            True if this process is part of a multi-process run (now or from an earlier call).

        Raises:
            ValueError: if some but not all of ``coordinator_address``, ``num_processes`` and ``process_id``
                are set and the environment cannot supply the rest, or if called again with other settings.
            RuntimeError: if JAX's backends were already initialized (a device was used first).
        """
        global _initialized_with
        settings = dataclasses.asdict(self)
        if _initialized_with is not None:
            if _initialized_with != settings:
                raise ValueError(
                    f"jax.distributed was already initialized with {_initialized_with}; cannot initialize again "
                    f"with {settings}"
                )
            return True
        if not self.is_multi_process():
            return False
        explicit = {
            "coordinator_address": self.coordinator_address,
            "num_processes": self.num_processes,
            "process_id": self.process_id,
        }
        missing = [k for k, v in explicit.items() if v is None]
        detected = _env_says_multi_process(os.environ)
        if missing and len(missing) < 3 and detected is None and self.cluster_detection_method is None:
            raise ValueError(
                f"trainer.distributed: {', '.join(f'{k}={v}' for k, v in explicit.items() if v is not None)} are set "
                f"but {', '.join(missing)} are not, and no cluster environment (SLURM, Open MPI, TPU) was found "
                "to detect them; set all three"
            )
        import jax

        logger.info(
            "initializing jax.distributed (%s)",
            ", ".join(f"{k}={v}" for k, v in explicit.items()) if not missing else f"detected from {detected}",
        )
        local_ids: Sequence[int] | int | None = self.local_device_ids
        jax.distributed.initialize(
            coordinator_address=self.coordinator_address,
            num_processes=self.num_processes,
            process_id=self.process_id,
            local_device_ids=local_ids,
            cluster_detection_method=self.cluster_detection_method,
            initialization_timeout=self.initialization_timeout,
            heartbeat_timeout_seconds=self.heartbeat_timeout_seconds,
            shutdown_timeout_seconds=self.shutdown_timeout_seconds,
        )
        _initialized_with = settings
        _install_fail_fast()
        logger.info(
            "process %d of %d: %d local devices, %d in all",
            jax.process_index(),
            jax.process_count(),
            jax.local_device_count(),
            jax.device_count(),
        )
        return True


def _install_fail_fast() -> None:
    """Make an uncaught exception end this process at once, with its traceback, and exit status 1.

    Python's normal exit would wait in ``jax.distributed``'s shutdown barrier for the other processes, which
    may be blocked in a collective with this one: the whole job would hang until the heartbeat timeout. Exiting
    at once closes this process's connections, so the peers' collectives fail within seconds instead.
    """
    import sys
    import traceback

    previous = sys.excepthook

    def fail_fast(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        import jax

        previous(kind, value, tb)
        message = "".join(traceback.format_exception_only(kind, value)).strip()
        logger.critical(
            "process %d of %d failed (%s); exiting now so that the other processes stop instead of waiting",
            jax.process_index(),
            jax.process_count(),
            message,
        )
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)

    sys.excepthook = fail_fast


def is_process_zero() -> bool:
    """Whether this is process 0 (the one that writes shared metadata and logs to trackers)."""
    import jax

    return jax.process_index() == 0


def barrier(name: str, *, timeout_seconds: float = 24 * 3600) -> None:
    """Wait until every process of the run reaches the barrier ``name`` (no-op with one process).

    Unlike a device collective, this waits on the coordination service, so it may wait for hours (e.g. for
    process 0 to finish building a data cache). A process that dies meanwhile ends the wait through the
    coordination service's heartbeat.

    Args:
        name: the barrier's name; every process must use the same names in the same order.
        timeout_seconds: give up after this long.

    Raises:
        RuntimeError: if the barrier times out or another process failed (the message names the barrier).
    """
    import jax

    if jax.process_count() == 1:
        return
    from jax._src import distributed as _jax_distributed  # the coordination client: no public accessor

    client = _jax_distributed.global_state.client
    if client is None:
        raise RuntimeError(f"barrier {name!r}: {jax.process_count()} processes but jax.distributed has no client")
    try:
        client.wait_at_barrier(name, int(timeout_seconds * 1000))
    except Exception as e:
        raise RuntimeError(f"process {jax.process_index()}: barrier {name!r} failed: {e}") from e


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """A Ray cluster shared by the training hosts, used to build data caches (``trainer.ray``).

    With ``data.backend: ray`` the cache builder runs on Ray. Every training process can connect to the
    same cluster: ``address`` (or ``RAY_ADDRESS``) joins an existing one; otherwise process 0 starts a local
    head when ``auto_start_cluster`` is set (the others then join it at ``<process 0 host>:<port>`` when
    ``start_workers`` is set).

    Attributes:
        address: the Ray cluster to join (``host:port`` or ``"auto"``); None: ``RAY_ADDRESS`` if set, else
            start a local cluster per ``auto_start_cluster``.
        start_workers: on processes other than 0, start a Ray worker node joining process 0's head, so that
            cache building uses every host's CPUs.
        auto_start_cluster: start a Ray head on process 0 when there is no cluster to join.
        head_port: the port of a head that process 0 starts.

    Example:
        ```python
        from ponente.trainer.distributed import RayConfig

        cfg = RayConfig(address="10.0.0.1:6379")
        assert cfg.resolved_address(env={}) == "10.0.0.1:6379"
        assert RayConfig().resolved_address(env={"RAY_ADDRESS": "auto"}) == "auto"
        ```
    """

    address: str | None = None
    start_workers: bool = True
    auto_start_cluster: bool = True
    head_port: int = 6379

    def resolved_address(self, env: Mapping[str, str] | None = None) -> str | None:
        """The cluster address to join: ``address``, else ``RAY_ADDRESS``, else None (start one)."""
        environment = os.environ if env is None else env
        return self.address or environment.get("RAY_ADDRESS") or None

    def initialize(self, *, process_index: int = 0, num_processes: int = 1, head_host: str | None = None) -> None:
        """Connect this process to the Ray cluster that builds caches (needs the ``ray`` extra).

        Process 0 joins ``address`` or starts a head (``ray start --head`` when other processes will join it,
        else an in-process local cluster). Other processes join process 0's head as worker nodes when
        ``start_workers`` is set (they lend CPUs; only process 0 submits cache builds).

        Args:
            process_index: this process's index in the JAX run.
            num_processes: the number of processes of the run.
            head_host: the host of process 0, for workers joining a head that process 0 started.

        Raises:
            ImportError: if Ray is not installed (the message names the extra).
            ValueError: if there is no cluster to join and ``auto_start_cluster`` is false, or a worker should
                join process 0's head but ``head_host`` is unknown.
            subprocess.CalledProcessError: if ``ray start`` fails.
        """
        try:
            import ray
        except ImportError as e:
            raise ImportError("trainer.ray needs Ray: pip install 'ponente-datacache[ray]'") from e
        address = self.resolved_address()
        if process_index != 0:
            if address is None and self.start_workers and num_processes > 1:
                if head_host is None:
                    raise ValueError("trainer.ray: cannot join process 0's Ray head: its host is unknown")
                _ray_start(["--address", f"{head_host}:{self.head_port}"])
            return
        if ray.is_initialized():
            return
        if address is not None:
            logger.info("joining the Ray cluster at %s", address)
            ray.init(address=address)
            return
        if not self.auto_start_cluster:
            raise ValueError("trainer.ray: no trainer.ray.address or RAY_ADDRESS, and auto_start_cluster is false")
        if num_processes > 1 and self.start_workers:
            _ray_start(["--head", f"--port={self.head_port}"])
            ray.init(address=f"127.0.0.1:{self.head_port}")
        else:
            logger.info("starting a local Ray cluster for cache building")
            ray.init(include_dashboard=False)


def _ray_start(args: list[str]) -> None:
    import subprocess
    import sys

    command = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", *args]
    logger.info("running %s", " ".join(command))
    subprocess.run(command, check=True)
