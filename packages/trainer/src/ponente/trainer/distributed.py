"""Multi-host setup: :class:`DistributedConfig` starts ``jax.distributed``, :class:`RayConfig` joins a Ray cluster.

A multi-host run starts one Python process per host (or per GPU); each calls :meth:`DistributedConfig.initialize`
before touching a device. The processes then see one global set of devices, and the trainer's mesh spans all
of them. On a cluster manager JAX knows (SLURM, Open MPI, TPU pods) the coordinator address, the number of
processes and the process id are detected from the environment; elsewhere they are given explicitly.

A process that dies must not leave the others hanging in a collective: the coordination service's heartbeat
(``heartbeat_timeout_seconds``) ends the survivors with an error naming the missing process.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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
    same cluster: ``address`` (or ``RAY_ADDRESS``) joins an existing one; otherwise process 0 starts a head
    when ``auto_start_cluster`` is set, and with ``start_workers`` the other processes join it as worker nodes
    at ``<process 0 host>:<head_port>``, so that cache building uses every host's CPUs.

    Nodes this process starts run as children of it (``ray start --block``) and stop when it exits, even when
    it is killed: only those nodes, never other Ray processes of the machine.

    Attributes:
        address: the Ray cluster to join (``host:port`` or ``"auto"``); None: ``RAY_ADDRESS`` if set, else
            start a cluster per ``auto_start_cluster``.
        start_workers: on processes other than 0, start a Ray worker node joining process 0's head, so that
            cache building uses every host's CPUs.
        auto_start_cluster: start a Ray head on process 0 when there is no cluster to join.
        head_port: the port of a head that process 0 starts (and that the other processes join).
        num_cpus: CPUs each node started here offers to Ray; None: Ray's default (all of the host's CPUs).
        join_timeout_seconds: how long a worker waits for process 0's head to become reachable before failing.
        start_timeout_seconds: how long ``ray start`` may take to bring a node up before failing.

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
    num_cpus: int | None = None
    join_timeout_seconds: float = 300.0
    start_timeout_seconds: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.head_port < 65536:
            raise ValueError(f"trainer.ray.head_port must be a TCP port (1..65535), got {self.head_port}")
        if self.num_cpus is not None and self.num_cpus < 0:
            raise ValueError(f"trainer.ray.num_cpus must be >= 0 or null, got {self.num_cpus}")
        for name in ("join_timeout_seconds", "start_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"trainer.ray.{name} must be > 0, got {getattr(self, name)}")

    def resolved_address(self, env: Mapping[str, str] | None = None) -> str | None:
        """The cluster address to join: ``address``, else ``RAY_ADDRESS``, else None (start one)."""
        environment = os.environ if env is None else env
        return self.address or environment.get("RAY_ADDRESS") or None

    def initialize(self, *, process_index: int = 0, num_processes: int = 1, head_host: str | None = None) -> None:
        """Connect this process to the Ray cluster that builds caches (needs the ``ray`` extra).

        Process 0 joins ``address`` or starts a cluster: ``ray start --head`` when other processes will join it,
        else an in-process local cluster (``ray.init``); either way it connects to it as the driver that
        submits cache builds. Other processes, when ``start_workers`` is set and there is no ``address``, wait
        until process 0's head is reachable and join it as worker nodes (they lend CPUs and submit nothing).
        Calling it again in the same process does nothing.

        Args:
            process_index: this process's index in the JAX run.
            num_processes: the number of processes of the run.
            head_host: the host of process 0, for workers joining a head that process 0 started.

        Raises:
            ImportError: if Ray is not installed (the message names the extra).
            ValueError: if there is no cluster to join and ``auto_start_cluster`` is false, or a worker should
                join process 0's head but ``head_host`` is unknown.
            ConnectionError: if process 0's head is not reachable within ``join_timeout_seconds`` (the message
                names the address).
            RuntimeError: if ``ray start`` fails or does not come up within ``start_timeout_seconds`` (the
                message names the command and shows its output).
        """
        try:
            import ray
        except ImportError as e:
            raise ImportError("trainer.ray needs Ray: pip install 'ponente-trainer[ray]'") from e
        address = self.resolved_address()
        if process_index != 0:
            if address is not None or not self.start_workers or num_processes <= 1 or _ray_state.nodes:
                return
            if head_host is None:
                raise ValueError(
                    f"trainer.ray: process {process_index} cannot join process 0's Ray head: its host is unknown "
                    "(set trainer.distributed.coordinator_address, or trainer.ray.address to join a running cluster)"
                )
            self._join_head(head_host)
            return
        if ray.is_initialized():
            return
        if address is None and not self.auto_start_cluster:
            raise ValueError(
                "trainer.ray: there is no cluster to join (trainer.ray.address and RAY_ADDRESS are unset) and "
                "trainer.ray.auto_start_cluster is false"
            )
        _register_exit_hook()
        if address is not None:
            logger.info("joining the Ray cluster at %s", address)
            ray.init(address=address)
        elif num_processes > 1 and self.start_workers:
            _ray_state.nodes.append(_start_node(self._head_args(), timeout=self.start_timeout_seconds))
            ray.init(address=f"127.0.0.1:{self.head_port}")
        else:
            logger.info("starting a local Ray cluster for cache building")
            # "local": a new cluster even if another one runs on this machine (ray.init() would join that one).
            ray.init(address="local", include_dashboard=False, num_cpus=self.num_cpus)
        _ray_state.connected = True

    def shutdown(self) -> None:
        """Disconnect from Ray and stop the Ray nodes this process started (also runs at exit).

        Only what :meth:`initialize` started in this process stops: a cluster joined through ``address`` or
        ``RAY_ADDRESS`` keeps running. Calling it when nothing was started does nothing.
        """
        _shutdown_ray()

    def _head_args(self) -> list[str]:
        """The arguments of ``ray start`` for process 0's head."""
        return ["--head", f"--port={self.head_port}", "--include-dashboard=false", *self._cpu_args()]

    def _worker_args(self, head_host: str) -> list[str]:
        """The arguments of ``ray start`` for a worker node joining process 0's head on ``head_host``."""
        return [f"--address={head_host}:{self.head_port}", *self._cpu_args()]

    def _cpu_args(self) -> list[str]:
        return [] if self.num_cpus is None else [f"--num-cpus={self.num_cpus}"]

    def _join_head(self, head_host: str) -> None:
        """Wait until process 0's head accepts connections, then start a worker node joining it."""
        address = f"{head_host}:{self.head_port}"
        logger.info("waiting for process 0's Ray head at %s", address)
        _wait_until_reachable(head_host, self.head_port, timeout=self.join_timeout_seconds)
        _register_exit_hook()
        _ray_state.nodes.append(_start_node(self._worker_args(head_host), timeout=self.start_timeout_seconds))


@dataclasses.dataclass
class _RayState:
    """What this process started: Ray nodes (``ray start`` children) and whether it called ``ray.init``."""

    nodes: list[_RayNode] = dataclasses.field(default_factory=list)
    connected: bool = False
    exit_hook: bool = False


_ray_state = _RayState()

_RAY_STARTED = "will now block forever"
"""What ``ray start --block`` prints once its node is up and recorded, before it starts waiting."""

# Runs in the child between fork and `ray start`: the kernel sends the child SIGTERM when the training process
# dies, even by SIGKILL or os._exit (the fail-fast hook), so a node never outlives the run that started it;
# `ray start --block` then stops the node's processes. (Linux delivers it when the *thread* that started the child
# exits, so nodes must be started from a long-lived thread, such as the main one.) Elsewhere only atexit applies.
_LAUNCHER = """\
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong]
    prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):
        sys.exit("the process that launched `ray start` exited before it started")
os.execv(sys.argv[2], sys.argv[2:])
"""


@dataclasses.dataclass
class _RayNode:
    """A Ray node run by a ``ray start --block`` child of this process; its output goes to ``log_path``."""

    process: subprocess.Popen[bytes]
    command: list[str]
    log_path: str
    claimed_address: str | None = None
    """The cluster address this ``ray start`` wrote to Ray's ``ray_current_cluster`` file, if it changed it."""

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, *, timeout: float = 60.0) -> None:
        """SIGTERM ``ray start --block`` (it stops its node's processes), SIGKILL it after ``timeout``."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("`%s` did not stop within %g s; killing it", shlex.join(self.command), timeout)
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            os.remove(self.log_path)
        # `ray start` records the cluster in a file that a later `ray.init()` without address connects to, and only
        # `ray stop` removes it: forget the cluster this node recorded (unless a later `ray start` replaced it).
        if self.claimed_address is not None and _read_ray_address_file() == self.claimed_address:
            with contextlib.suppress(OSError):
                os.remove(_ray_address_file())


def _ray_executable() -> str:
    """The ``ray`` command of the running interpreter's environment (else the one on ``PATH``)."""
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    found = beside if os.path.exists(beside) else shutil.which("ray")
    if found is None:
        raise FileNotFoundError(
            f"trainer.ray: the `ray` command is neither next to {sys.executable} nor on PATH; "
            "pip install 'ponente-trainer[ray]'"
        )
    return found


def _ray_address_file() -> str:
    """Where ``ray start`` records the last cluster it started or joined on this machine."""
    try:
        from ray._common.utils import get_ray_address_file  # no public accessor
    except ImportError:  # a Ray release that moved it: its long-standing default location
        return os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
    return str(get_ray_address_file(None))


def _read_ray_address_file() -> str | None:
    try:
        with open(_ray_address_file(), encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_node(args: list[str], *, timeout: float) -> _RayNode:
    """Run ``ray start <args> --block`` as a child of this process and wait until its node is up.

    Raises:
        RuntimeError: if ``ray start`` exits, or does not come up within ``timeout`` seconds (then it is
            stopped); the message names the command and shows its output.
    """
    command = [_ray_executable(), "start", *args, "--block", "--disable-usage-stats", "--log-color=false"]
    shown = shlex.join(command)
    logger.info("running %s", shown)
    recorded_before = _read_ray_address_file()
    fd, log_path = tempfile.mkstemp(prefix="ponente-ray-start-", suffix=".log")
    # No drain wait when stopped: the node runs no services that need one (Ray's default waits up to 30 s).
    env = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **os.environ}
    with os.fdopen(fd, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *command],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    node = _RayNode(process, command, log_path)
    deadline = time.monotonic() + timeout
    while _RAY_STARTED not in node.output():
        if process.poll() is not None:
            raise RuntimeError(
                f"trainer.ray: `{shown}` failed with exit status {process.returncode}; its output "
                f"(kept in {log_path}):\n{_tail(node.output())}"
            )
        if time.monotonic() > deadline:
            output = node.output()
            node.stop()
            raise RuntimeError(
                f"trainer.ray: `{shown}` did not bring its node up within {timeout:g} s "
                f"(trainer.ray.start_timeout_seconds); its output:\n{_tail(output)}"
            )
        time.sleep(0.2)
    recorded = _read_ray_address_file()
    if recorded != recorded_before:
        node.claimed_address = recorded
    logger.info("Ray node up (pid %d): %s", process.pid, shown)
    return node


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "(no output)"


def _wait_until_reachable(host: str, port: int, *, timeout: float) -> None:
    """Retry a TCP connection to ``host:port`` until it succeeds; ConnectionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, remaining))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise ConnectionError(
                f"trainer.ray: no Ray head reachable at {host}:{port} after {timeout:g} s "
                f"(trainer.ray.join_timeout_seconds); last error: {last}. Process 0 starts it with "
                f"`ray start --head --port={port}`: check that process 0 runs, that trainer.ray.head_port matches, "
                "and that the port is open between the hosts"
            )
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _register_exit_hook() -> None:
    if not _ray_state.exit_hook:
        atexit.register(_shutdown_ray)
        _ray_state.exit_hook = True


def _shutdown_ray() -> None:
    """Disconnect the driver if this process connected it, then stop the nodes it started (newest first)."""
    if _ray_state.connected:
        import ray

        ray.shutdown()
        _ray_state.connected = False
    while _ray_state.nodes:
        node = _ray_state.nodes.pop()
        logger.info("stopping the Ray node of `%s`", shlex.join(node.command))
        node.stop()
