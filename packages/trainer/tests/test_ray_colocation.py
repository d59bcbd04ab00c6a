"""RayConfig: the ``ray start`` command lines, its error paths, and real clusters (one host, two simulated hosts).

The unit tests replace ``ray start`` by a fake executable or record the arguments it would get, so they start no
Ray process. The integration tests start real Ray nodes (about 1 GB of memory each) and check that a cache built
on them equals one built locally, and that every process they started is gone afterwards.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from ponente.datacache import build_cache
from ponente.trainer import distributed
from ponente.trainer.distributed import RayConfig

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "sleeps", "déjà", "vu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (children, their children, ...), from ``/proc``."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    parent_of[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parent_of.items() if parent in frontier} - found
        found |= frontier
    return found


def wait_gone(pids: set[int], timeout: float = 120.0) -> set[int]:
    """Wait until none of ``pids`` runs; returns those still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture
def fresh_ray_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[distributed._RayState]:
    """A clean record of started nodes for one test (no atexit hook registered); stops what the test started."""
    state = distributed._RayState(exit_hook=True)
    monkeypatch.setattr(distributed, "_ray_state", state)
    yield state
    while state.nodes:
        state.nodes.pop().stop()


@pytest.fixture(autouse=True)
def restore_tempdir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)


# --- unit tests: command lines and error paths, without Ray processes ---------------------------------------------


class FakeNode:
    def stop(self, *, timeout: float = 60.0) -> None:
        del timeout


class Recorder:
    """Stands in for ``_start_node`` and ``ray.init``: records their arguments."""

    def __init__(self) -> None:
        self.started: list[list[str]] = []
        self.inits: list[dict[str, Any]] = []

    def start_node(self, args: list[str], *, timeout: float) -> Any:
        self.started.append(list(args))
        return FakeNode()

    def init(self, **kwargs: Any) -> None:
        self.inits.append(kwargs)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch, fresh_ray_state: distributed._RayState) -> Recorder:
    import ray

    rec = Recorder()
    monkeypatch.setattr(distributed, "_start_node", rec.start_node)
    monkeypatch.setattr(distributed, "_wait_until_reachable", lambda host, port, *, timeout: None)
    monkeypatch.setattr(ray, "init", rec.init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fresh_ray_state.connected = False
    return rec


def test_process_zero_of_several_starts_a_head_without_dashboard_and_connects_to_it(recorder: Recorder) -> None:
    RayConfig(head_port=7000, num_cpus=3).initialize(process_index=0, num_processes=2, head_host="10.0.0.5")
    assert recorder.started == [["--head", "--port=7000", "--include-dashboard=false", "--num-cpus=3"]]
    assert recorder.inits == [{"address": "127.0.0.1:7000"}]
    assert distributed._ray_state.connected
    assert len(distributed._ray_state.nodes) == 1


def test_other_processes_join_the_head_as_workers(recorder: Recorder) -> None:
    RayConfig(head_port=7001).initialize(process_index=3, num_processes=4, head_host="10.0.0.5")
    assert recorder.started == [["--address=10.0.0.5:7001"]]  # num_cpus None: Ray's default, no flag
    assert recorder.inits == []  # workers lend CPUs; they do not connect a driver
    RayConfig(head_port=7001).initialize(process_index=3, num_processes=4, head_host="10.0.0.5")
    assert len(recorder.started) == 1  # a second call does nothing


def test_one_process_starts_an_in_process_cluster(recorder: Recorder) -> None:
    RayConfig(num_cpus=2).initialize()
    assert recorder.started == []
    assert recorder.inits == [{"address": "local", "include_dashboard": False, "num_cpus": 2}]


@pytest.mark.parametrize("source", ["config", "environment"])
def test_a_given_address_is_joined_and_nothing_is_started(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    if source == "environment":
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
        cfg = RayConfig()
    else:
        cfg = RayConfig(address="10.0.0.9:6379")
    cfg.initialize(process_index=0, num_processes=2, head_host="10.0.0.5")
    cfg.initialize(process_index=1, num_processes=2, head_host="10.0.0.5")
    assert recorder.started == []
    assert recorder.inits == [{"address": "10.0.0.9:6379"}]


def test_workers_are_not_started_when_start_workers_is_false(recorder: Recorder) -> None:
    cfg = RayConfig(start_workers=False)
    cfg.initialize(process_index=1, num_processes=2, head_host="10.0.0.5")
    cfg.initialize(process_index=0, num_processes=2, head_host="10.0.0.5")
    assert recorder.started == []  # process 0 runs an in-process cluster that nobody joins
    assert recorder.inits == [{"address": "local", "include_dashboard": False, "num_cpus": None}]


def test_a_worker_without_head_host_names_the_problem(recorder: Recorder) -> None:
    with pytest.raises(ValueError, match=r"process 2 cannot join process 0's Ray head: its host is unknown"):
        RayConfig().initialize(process_index=2, num_processes=4, head_host=None)
    assert recorder.started == []


def test_no_address_and_no_auto_start_is_an_error(recorder: Recorder) -> None:
    with pytest.raises(ValueError, match=r"no cluster to join.*auto_start_cluster is false"):
        RayConfig(auto_start_cluster=False).initialize(process_index=0, num_processes=2, head_host="h")
    assert recorder.started == []
    assert recorder.inits == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("head_port", 0), ("head_port", 70000), ("num_cpus", -1), ("join_timeout_seconds", 0)],
)
def test_invalid_fields_name_the_key(field: str, value: int) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=rf"trainer\.ray\.{field}"):
        RayConfig(**kwargs)


def test_ray_keys_parse_from_the_command_line() -> None:
    from ponente.trainer.config import load_config
    from ponente.trainer.main.train_lm import TrainLmConfig

    overrides = ["trainer.ray.num_cpus=4", "trainer.ray.join_timeout_seconds=10", "trainer.ray.start_workers=false"]
    cfg = load_config(TrainLmConfig, overrides=overrides)
    assert cfg.trainer.ray == RayConfig(num_cpus=4, join_timeout_seconds=10.0, start_workers=False)


def fake_ray(tmp_path: Path, body: str) -> str:
    """An executable standing in for ``ray``: it records its arguments and pid, then runs ``body``.

    ``ray start`` logs (kept when it fails) go under ``tmp_path`` too.
    """
    tempfile.tempdir = str(tmp_path)  # restored by the autouse fixture below
    path = tmp_path / "fake-ray"
    path.write_text(
        f"#!{sys.executable}\nimport json, os, sys, time\n"
        f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n" + textwrap.dedent(body)
    )
    path.chmod(0o755)
    return str(path)


def test_start_node_runs_ray_start_block_and_stop_ends_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executable = fake_ray(tmp_path, "print('This command will now block forever.', flush=True)\ntime.sleep(600)\n")
    monkeypatch.setattr(distributed, "_ray_executable", lambda: executable)
    node = distributed._start_node(["--head", "--port=7002"], timeout=60)
    try:
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert argv == ["start", "--head", "--port=7002", "--block", "--disable-usage-stats", "--log-color=false"]
        assert node.process.poll() is None
        assert int((tmp_path / "pid").read_text()) == node.process.pid  # the launcher exec'd ray start
    finally:
        node.stop(timeout=30)
    assert node.process.returncode == -signal.SIGTERM
    assert not os.path.exists(node.log_path)


def test_a_failing_ray_start_names_the_command_and_its_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executable = fake_ray(tmp_path, "sys.stderr.write('ConnectionError: port 7003 is taken\\n')\nsys.exit(3)\n")
    monkeypatch.setattr(distributed, "_ray_executable", lambda: executable)
    with pytest.raises(RuntimeError) as info:
        distributed._start_node(["--head", "--port=7003"], timeout=60)
    command = f"{executable} start --head --port=7003 --block --disable-usage-stats --log-color=false"
    assert f"`{command}` failed with exit status 3" in str(info.value)
    assert "ConnectionError: port 7003 is taken" in str(info.value)


def test_a_ray_start_that_never_comes_up_is_stopped_after_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executable = fake_ray(tmp_path, "print('connecting...', flush=True)\ntime.sleep(600)\n")
    monkeypatch.setattr(distributed, "_ray_executable", lambda: executable)
    with pytest.raises(RuntimeError, match=r"did not bring its node up within 1 s(?s:.*)connecting\.\.\."):
        distributed._start_node(["--address=10.0.0.1:1"], timeout=1)
    assert not wait_gone({int((tmp_path / "pid").read_text())}, timeout=30)


def test_a_node_stops_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    executable = fake_ray(tmp_path, "print('This command will now block forever.', flush=True)\ntime.sleep(600)\n")
    script = f"""
import sys, time
from ponente.trainer import distributed
distributed._ray_executable = lambda: {executable!r}
node = distributed._start_node(["--head"], timeout=60)
print(node.process.pid, flush=True)
time.sleep(600)
"""
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ | {"TMPDIR": str(tmp_path)}
    )
    try:
        assert parent.stdout is not None
        node_pid = int(parent.stdout.readline())
        assert alive(node_pid)
    finally:
        parent.kill()  # SIGKILL: no atexit hook runs; the kernel's parent-death signal must stop the node
        parent.wait()
    assert not wait_gone({node_pid}, timeout=30)


def test_joining_where_nothing_listens_fails_naming_the_address(fresh_ray_state: distributed._RayState) -> None:
    port = free_port()
    cfg = RayConfig(head_port=port, join_timeout_seconds=2)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"no Ray head reachable at 127\.0\.0\.1:{port} after 2 s"):
        cfg.initialize(process_index=1, num_processes=2, head_host="127.0.0.1")
    assert time.monotonic() - start < 60  # gave up at the deadline rather than hanging
    assert fresh_ray_state.nodes == []


def test_waiting_for_the_head_retries_until_it_listens() -> None:
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(1.5)
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        distributed._wait_until_reachable("127.0.0.1", port, timeout=120)
    finally:
        thread.join()
        server.close()


# --- integration: real Ray clusters ---------------------------------------------------------------------------


def make_documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path, list[list[str]]]:
    """Three jsonl shards, a tiny byte-level BPE trained on other text, and the documents of each shard."""
    root = tmp_path_factory.mktemp("ray_corpus")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(make_documents(200, seed=1), trainer)
    tokenizer_path = root / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    paths, shards = [], []
    for i in range(3):
        docs = make_documents(40, seed=10 + i)
        path = root / f"shard_{i}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        paths.append(str(path))
        shards.append(docs)
    return paths, tokenizer_path, shards


def rows(cache: Any) -> list[list[int]]:
    return [cache[i]["input_ids"].tolist() for i in range(len(cache))]


def assert_ray_build_equals_local(corpus: tuple[list[str], Path, list[list[str]]], out: Path) -> None:
    paths, tokenizer_path, shards = corpus
    local = rows(build_cache(paths, out / "local", tokenizer=tokenizer_path, workers=0, progress=False))
    on_ray = rows(
        build_cache(
            paths, out / "ray", tokenizer=tokenizer_path, backend="ray", workers=2, batch_rows=7, progress=False
        )
    )
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    expected = [e.ids for docs in shards for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
    assert local == expected
    assert on_ray == local


@pytest.fixture
def ray_env(monkeypatch: pytest.MonkeyPatch, fresh_ray_state: distributed._RayState) -> distributed._RayState:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return fresh_ray_state


@pytest.mark.integration
def test_one_process_starts_a_local_cluster_that_builds_like_local(
    ray_env: distributed._RayState, corpus: tuple, tmp_path: Path
) -> None:
    import ray

    cfg = RayConfig(num_cpus=2)
    try:
        cfg.initialize()
        assert ray.is_initialized()
        assert ray.cluster_resources()["CPU"] == 2
        assert_ray_build_equals_local(corpus, tmp_path)
        assert ray.is_initialized()  # the builder used the cluster and left it running for the trainer
    finally:
        cfg.shutdown()
    assert not ray.is_initialized()


WORKER = """
import logging, sys
from ponente.trainer.distributed import RayConfig, _ray_state

logging.basicConfig(level="INFO")
cfg = RayConfig(head_port=int(sys.argv[1]), num_cpus=1, join_timeout_seconds=300)
cfg.initialize(process_index=1, num_processes=2, head_host="127.0.0.1")
print("JOINED", _ray_state.nodes[0].process.pid, flush=True)
sys.stdin.read()  # until the test closes stdin; then the exit hook stops the worker node
"""


@pytest.mark.integration
def test_two_simulated_hosts_form_one_cluster_that_builds_like_local(
    ray_env: distributed._RayState, corpus: tuple, tmp_path: Path
) -> None:
    import ray

    port = free_port()
    log = open(tmp_path / "worker.log", "w+")  # noqa: SIM115 (closed below)
    # Process 1 starts first: it must wait for process 0's head instead of failing.
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(port)], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT
    )
    cfg = RayConfig(head_port=port, num_cpus=1)
    started: set[int] = set()
    try:
        time.sleep(1.0)
        cfg.initialize(process_index=0, num_processes=2, head_host="127.0.0.1")
        head = ray_env.nodes[0].process
        deadline = time.monotonic() + 300
        while "JOINED" not in (tmp_path / "worker.log").read_text() or len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert worker.poll() is None, f"process 1 exited:\n{(tmp_path / 'worker.log').read_text()}"
            assert time.monotonic() < deadline, f"no second node:\n{(tmp_path / 'worker.log').read_text()}"
            time.sleep(1.0)
        assert ray.cluster_resources()["CPU"] == 2  # one CPU from each "host"
        worker_node = int((tmp_path / "worker.log").read_text().split("JOINED ")[1].split()[0])
        started = {head.pid, worker_node} | descendants(head.pid) | descendants(worker_node)
        assert len(started) > 2  # each ray start runs a raylet and friends
        assert_ray_build_equals_local(corpus, tmp_path)
    finally:
        if worker.stdin is not None:
            worker.stdin.close()
        try:
            worker.wait(timeout=180)
        except subprocess.TimeoutExpired:
            worker.kill()  # its node still stops: the kernel signals it when process 1 dies
            worker.wait()
        cfg.shutdown()
        log.close()
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()
    assert not ray.is_initialized()
    assert ray_env.nodes == []
    assert not wait_gone(started), "Ray processes left behind"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
