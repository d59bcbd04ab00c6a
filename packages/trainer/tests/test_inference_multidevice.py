"""Generation sharded like training (8 simulated devices) equals generation on one device, token for token.

Run in the multidevice session: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m multidevice``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import ponente.models.moe as moe
import ponente.namedtensor as hax
from ponente.models import LlamaConfig, Qwen3MoeConfig
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


# a Qwen3-MoE mixing dense and MoE blocks (two stacks scanned run by run)
MOE = Qwen3MoeConfig(
    seq_len=64,
    hidden_dim=32,
    intermediate_dim=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_dim=16,
    mlp_only_layers=(1,),
)


def test_engine_over_an_expert_mesh_equals_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mesh and mappings the trainer builds for ``expert_axis_size: 4`` (expert 4 x data 2): the experts are split
    over ``expert``, tokens reach them by all-to-all (``moe_dispatch: auto``), and greedy decoding is unchanged."""
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    model = MOE.build(hax.Axis("vocab", 97), key=jax.random.PRNGKey(1))
    tcfg = TrainerConfig(expert_axis_size=4)
    mesh = make_mesh({"replica": 1, "data": -1, "expert": 4, "model": 1})
    sharded = Engine(
        model,
        max_batch_size=8,
        mesh=mesh,
        axis_mapping=tcfg.compute_axis_mapping,
        parameter_axis_mapping=tcfg.parameter_axis_mapping,
    )
    weight = sharded.model.transformer.layers.stacked.block_sparse_moe.gate_proj.array
    assert weight.sharding.shard_shape(weight.shape)[1] == MOE.num_experts // 4  # experts split 4 ways
    generation = GenerationConfig(max_new_tokens=10, logprobs=True)
    expected = Engine(model, max_batch_size=8).generate(PROMPTS, generation)
    traced = []  # the sharded engine's programs dispatch by all-to-all (traced once per program)
    dispatch = moe.expert_parallel_dispatch
    monkeypatch.setattr(moe, "expert_parallel_dispatch", lambda *a, **k: traced.append(1) or dispatch(*a, **k))
    got = sharded.generate(PROMPTS, generation)
    assert traced
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)  # type: ignore[arg-type]
