"""Generation sharded like training (8 simulated devices) equals generation on one device, token for token.

Run in the multidevice session: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m multidevice``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.models import LlamaConfig
from ponente.namedtensor.partitioning import make_mesh
from ponente.trainer.inference import Engine, GenerationConfig
from ponente.trainer.trainer import TrainerConfig

pytestmark = pytest.mark.multidevice

PROMPTS = [[5, 17, 3, 44], [9], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [12, 12], [1, 2, 3]]
LAYOUTS = {
    "fsdp": {"fsdp_axis": "embed"},
    "fsdp_tp": {"fsdp_axis": "embed", "model_axis_size": 2, "tensor_parallel_axes": ["mlp", "heads", "kv_heads"]},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_generation_equals_one_device(layout: str) -> None:
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    config = LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = config.build(hax.Axis("vocab", 97), key=jax.random.PRNGKey(0))
    tcfg = TrainerConfig(**LAYOUTS[layout])  # type: ignore[arg-type]
    mesh = make_mesh({"replica": 1, "data": -1, "model": tcfg.model_axis_size})
    sharded = Engine(
        model,
        max_batch_size=4,
        mesh=mesh,
        axis_mapping=tcfg.compute_axis_mapping,
        parameter_axis_mapping=tcfg.parameter_axis_mapping,
    )
    single = Engine(model, max_batch_size=4)
    weight = sharded.model.transformer.layers.stacked.mlp.up_proj.weight.array
    assert len(weight.sharding.device_set) == 8  # the parameters really live on the mesh
    for generation in (
        GenerationConfig(max_new_tokens=12, logprobs=True),
        GenerationConfig(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=11, logprobs=True),
    ):
        expected = single.generate(PROMPTS, generation)
        got = sharded.generate(PROMPTS, generation)
        assert [c.tokens for c in got] == [c.tokens for c in expected]
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)  # type: ignore[arg-type]


def test_data_parallel_engine_splits_the_batch_and_equals_one_device() -> None:
    """``Engine.data_parallel`` (``ponente-sample-lm`` with several devices) shards the batch over all 8 devices."""
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    config = LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = config.build(hax.Axis("vocab", 97), key=jax.random.PRNGKey(0))
    parallel = Engine.data_parallel(model, max_batch_size=8)
    assert parallel.mesh is not None
    assert parallel.mesh.devices.size == 8
    generation = GenerationConfig(max_new_tokens=8, temperature=1.0, seed=3)
    expected = Engine(model, max_batch_size=8).generate(PROMPTS, generation)
    assert [c.tokens for c in parallel.generate(PROMPTS, generation)] == [c.tokens for c in expected]
