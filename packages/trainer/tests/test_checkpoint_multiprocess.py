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
