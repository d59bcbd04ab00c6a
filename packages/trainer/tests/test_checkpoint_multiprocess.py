"""Checkpoints written by several JAX processes at once, loaded by one process on one device.

Two local processes (``jax.distributed`` over 127.0.0.1, 4 simulated CPU devices each, gloo collectives)
save one globally sharded tree; each process writes only its own OCDBT store (``process-<i>/``) and its
piece list. A fresh process then loads the checkpoint onto a single device and must find every value.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ponente.trainer.checkpoint import load_checkpoint, read_metadata

_WORKER = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, process_id, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4

    from ponente.trainer.checkpoint import save_checkpoint

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

    def global_array(values, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])

    w = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    b = -np.arange(16, dtype=np.float32)
    r = np.array([1.5, 2.5, 3.5], dtype=np.float32)
    key = jax.random.key_data(jax.random.key(7))
    tree = {
        "w": global_array(w, P("data", "model")),   # every process holds different blocks
        "b": global_array(b, P("data")),            # split over data, replicated over model
        "r": global_array(r, P()),                  # replicated everywhere: written once
        "host": np.arange(5, dtype=np.int32),       # a NumPy leaf: process 0 writes it
        "key": jax.random.wrap_key_data(global_array(np.asarray(key), P())),
        "step": 11,
    }
    save_checkpoint(tree, path, step=11, metadata={"writer": "two processes"})
    print(f"process {process_id} saved", flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.integration
def test_two_processes_save_one_sharded_tree_and_one_process_loads_it(tmp_path: Path) -> None:
    path = tmp_path / "step-11"
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(port), str(i), str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for worker in workers:
        try:
            out, err = worker.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for w in workers:
                w.kill()
            pytest.fail("the two-process save did not finish")
        outputs.append((worker.returncode, out, err))
    for i, (rc, out, err) in enumerate(outputs):
        assert rc == 0, f"process {i} failed:\n{err[-3000:]}"
        assert f"process {i} saved" in out

    # each process wrote its own store and piece list; process 0 committed
    assert {p.name for p in path.iterdir()} >= {"process-0", "process-1", "process-0.json", "process-1.json"}
    meta = read_metadata(path)
    assert meta is not None
    assert meta["num_processes"] == 2
    assert meta["metadata"] == {"writer": "two processes"}

    template = {
        "w": jnp.zeros((8, 6), jnp.float32),
        "b": jnp.zeros(16, jnp.float32),
        "r": jnp.zeros(3, jnp.float32),
        "host": np.zeros(5, np.int32),
        "key": jax.random.key(0),
        "step": 0,
    }
    loaded = load_checkpoint(template, path)
    np.testing.assert_array_equal(np.asarray(loaded["w"]), np.arange(48, dtype=np.float32).reshape(8, 6))
    np.testing.assert_array_equal(np.asarray(loaded["b"]), -np.arange(16, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(loaded["r"]), np.array([1.5, 2.5, 3.5], dtype=np.float32))
    np.testing.assert_array_equal(loaded["host"], np.arange(5, dtype=np.int32))
    np.testing.assert_array_equal(jax.random.key_data(loaded["key"]), jax.random.key_data(jax.random.key(7)))
    assert loaded["step"] == 11
    # a block that spans both processes' stores, read into one device
    assert loaded["w"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


_ASYNC_WORKER = textwrap.dedent(
    """
    import datetime, sys
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, process_id, run, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

    from ponente.trainer.checkpoint import Checkpointer, CheckpointInterval, CheckpointWriteError, load_checkpoint
    from ponente.trainer.checkpoint import _location

    if mode == "fail" and process_id == 1:
        # process 1 cannot write its piece list of step 2; process 0 writes everything
        real = _location.write_bytes

        def failing(where, name, data):
            if where.endswith("step-2") and name == "process-1.json":
                raise OSError("disk full (injected by the test)")
            return real(where, name, data)

        _location.write_bytes = failing

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

    def expected(step):
        return {
            "w": np.arange(48, dtype=np.float32).reshape(8, 6) * step,
            "b": -np.arange(16, dtype=np.float32) - step,
            "r": np.array([step, 2.0 * step], dtype=np.float32),
        }

    specs = {"w": P("data", "model"), "b": P("data"), "r": P()}

    def state_of(step):
        values = expected(step)
        tree = {
            k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
            for k, v in values.items()
        }
        return {**tree, "step": step}

    # a computation with cross-process collectives, run on the main thread while saves are in flight
    total = jax.jit(lambda t: jnp.sum(t["w"]) + jnp.sum(t["b"] * 2.0), out_shardings=NamedSharding(mesh, P()))
    scale = jax.jit(lambda t: {k: v * 0.0 - 1.0 for k, v in t.items() if k != "step"}, donate_argnums=0)

    ckpt = Checkpointer(run, save_interval=datetime.timedelta(hours=1), keep=[CheckpointInterval(every=1)])
    errors = []
    try:
        for step in range(1, 5):
            state = state_of(step)
            assert ckpt.on_step(state, step)
            for _ in range(5):
                got = float(total(state).addressable_data(0))
                want = float(expected(step)["w"].sum() + 2.0 * expected(step)["b"].sum())
                assert got == want, (step, got, want)
            scale({k: v for k, v in state.items() if k != "step"})  # the caller donates the saved arrays
        ckpt.close()
    except CheckpointWriteError as e:
        errors.append(str(e))
    print(f"process {process_id} errors: {errors}", flush=True)
    if mode == "ok":
        # both processes read every step back onto the global mesh
        for step in range(1, 5):
            template = {**state_of(0), "step": 0}
            loaded = load_checkpoint(template, f"{run}/step-{step}")
            for k, v in expected(step).items():
                for shard in loaded[k].addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), v[shard.index])
            assert loaded["step"] == step
        print(f"process {process_id} restored", flush=True)
    """
)


def _run_two(script: str, *args: str, timeout: float = 300) -> list[tuple[int, str, str]]:
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        # keep every save in flight for a while, so that it overlaps the training-like collectives
        "PONENTE_TEST_SLOW_CHECKPOINT": "0.3",
    }
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(port), str(i), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for worker in workers:
        try:
            out, err = worker.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for w in workers:
                w.kill()
            pytest.fail("the two processes did not finish (a hang)")
        outputs.append((worker.returncode, out, err))
    return outputs


@pytest.mark.integration
def test_two_processes_save_in_the_background_while_computing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for i, (rc, out, err) in enumerate(_run_two(_ASYNC_WORKER, str(run), "ok")):
        assert rc == 0, f"process {i} failed:\n{err[-3000:]}"
        assert f"process {i} errors: []" in out
        assert f"process {i} restored" in out

    # a fresh single process on one device finds exactly the values each step saved
    for step in range(1, 5):
        path = run / f"step-{step}"
        assert {p.name for p in path.iterdir()} >= {"process-0", "process-1", "process-0.json", "process-1.json"}
        meta = read_metadata(path)
        assert meta is not None
        assert (meta["step"], meta["num_processes"]) == (step, 2)
        template = {
            "w": jnp.zeros((8, 6), jnp.float32),
            "b": jnp.zeros(16, jnp.float32),
            "r": jnp.zeros(2, jnp.float32),
            "step": 0,
        }
        loaded = load_checkpoint(template, path)
        np.testing.assert_array_equal(np.asarray(loaded["w"]), np.arange(48, dtype=np.float32).reshape(8, 6) * step)
        np.testing.assert_array_equal(np.asarray(loaded["b"]), -np.arange(16, dtype=np.float32) - step)
        np.testing.assert_array_equal(np.asarray(loaded["r"]), np.array([step, 2.0 * step], dtype=np.float32))
        assert loaded["step"] == step


@pytest.mark.integration
def test_a_background_save_failing_on_one_process_fails_on_both_without_commit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    outputs = _run_two(_ASYNC_WORKER, str(run), "fail")
    for i, (rc, out, err) in enumerate(outputs):
        assert rc == 0, f"process {i} failed:\n{err[-3000:]}"
        line = next(x for x in out.splitlines() if x.startswith(f"process {i} errors:"))
        assert "process 1 failed: OSError: disk full (injected by the test)" in line, line
    assert read_metadata(run / "step-1") is not None
    assert read_metadata(run / "step-2") is None, "a step that one process failed to write must not be committed"
    assert not (run / "step-3").exists()
