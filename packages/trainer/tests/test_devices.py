"""The `multidevice` session really provides 8 devices, and a computation sharded over them is correct."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

pytestmark = pytest.mark.multidevice


def test_eight_simulated_devices_shard_a_batch():
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (nox -s multidevice)"
    devices = np.array(jax.devices()).reshape(4, 2)
    mesh = Mesh(devices, ("data", "model"))
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", "model")))
    # Each device holds a (2, 3) block: the sharding follows the mesh, not a replica of the whole array.
    assert {shard.data.shape for shard in sharded.addressable_shards} == {(2, 3)}
    total = jax.jit(lambda a: (a * a).sum(axis=0))(sharded)
    np.testing.assert_allclose(np.asarray(total), (x * x).sum(axis=0))
