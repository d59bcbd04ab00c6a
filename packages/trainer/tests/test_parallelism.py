"""Parallelism is a config change: DP, FSDP, tensor parallel and both on 8 devices train like 1 device.

Run in the multidevice session (8 simulated CPU devices). The reference is the same tiny Llama trained on one
device; the parameter layout is checked against the mapping the config states.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

import ponente.namedtensor as hax
from ponente.models import LlamaConfig, LmExample, compute_next_token_loss
from ponente.trainer.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.multidevice

BATCH = 16
STEPS = 3
MODEL = LlamaConfig(
    seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_padding_multiple=4
)
Vocab = hax.Axis("vocab", 13)  # padded to 16 by the model: splits over a model axis of 2 or 4

LAYOUTS = {
    "data_parallel": {"fsdp_axis": None},
    "fsdp": {"fsdp_axis": "embed"},
    "fsdp_replica": {"fsdp_axis": "embed", "replica_axis_size": 2},
    "tensor_parallel": {"fsdp_axis": None, "model_axis_size": 2, "tensor_parallel_axes": ["mlp", "heads", "kv_heads"]},
    "fsdp_tp": {"fsdp_axis": ["embed"], "model_axis_size": 2, "tensor_parallel_axes": ["mlp", "kv_heads", "vocab"]},
    "fsdp_tp4": {"fsdp_axis": "embed", "model_axis_size": 4, "tensor_parallel_axes": ["mlp", "heads"]},
}


def lm_loss(model, example, *, key):
    return compute_next_token_loss(model, example, key=key)


def batches():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        ids = hax.named(
            jnp.asarray(rng.integers(0, Vocab.size, (BATCH, MODEL.seq_len)), jnp.int32), ("batch", "position")
        )
        mask = hax.named(jnp.asarray(rng.random((BATCH, MODEL.seq_len)) < 0.7, jnp.float32), ("batch", "position"))
        out.append(LmExample.causal(ids, loss_mask=mask))
    return out


def train(devices, **layout):
    config = TrainerConfig(
        train_batch_size=BATCH, num_train_steps=STEPS, compilation_cache_dir=None, progress_bar=False, **layout
    )
    trainer = Trainer(config, optax.adam(1e-2), lm_loss, devices=devices)
    state = trainer.initial_state(lambda key: MODEL.build(Vocab, key=key))
    losses = []
    for batch in batches():
        state, metrics = trainer.train_step(state, trainer.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


def named_leaves(tree):
    return [
        x
        for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, hax.NamedArray))
        if isinstance(x, hax.NamedArray)
    ]


@pytest.fixture(scope="module")
def reference():
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    _, state, losses = train(jax.devices()[:1])
    return losses, [np.asarray(x.array) for x in named_leaves(state.model)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_device_and_stores_parameters_by_the_mapping(name, reference):
    layout = LAYOUTS[name]
    trainer, state, losses = train(jax.devices(), **layout)
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    params = named_leaves(state.model)
    for got, want in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(np.asarray(got.array), want, atol=1e-5)

    # the mapping the config states, written out independently of TrainerConfig.parameter_axis_mapping
    fsdp = layout.get("fsdp_axis")
    fsdp_axes = [fsdp] if isinstance(fsdp, str) else list(fsdp or [])
    expected = dict.fromkeys(fsdp_axes, "data") | dict.fromkeys(layout.get("tensor_parallel_axes", []), "model")
    assert trainer.mesh.shape == {
        "replica": layout.get("replica_axis_size", 1),
        "data": 8 // layout.get("model_axis_size", 1) // layout.get("replica_axis_size", 1),
        "model": layout.get("model_axis_size", 1),
    }
    adam_state = named_leaves(state.opt_state)
    assert adam_state, "the optimizer state should hold named moments"
    checked = set()
    for x in params + adam_state:
        spec = tuple(x.array.sharding.spec) + (None,) * (x.ndim - len(x.array.sharding.spec))
        for axis, part in zip(x.axes, spec):
            assert part == expected.get(axis.name), f"{name}: axis {axis.name} of {x.axes} is split over {part}"
            checked.add(axis.name)
    # every mesh axis the config uses really splits some parameter ("heads" alone names activations only)
    for mesh_axis in set(expected.values()):
        assert any(expected[a] == mesh_axis for a in checked if a in expected), (
            f"{name}: nothing split over {mesh_axis}"
        )


def test_batch_is_split_over_replica_and_data():
    trainer = Trainer(
        TrainerConfig(train_batch_size=BATCH, replica_axis_size=2, model_axis_size=2, compilation_cache_dir=None),
        optax.sgd(0.1),
        lm_loss,
    )
    placed = trainer.shard_batch(batches()[0])
    assert placed.tokens.array.sharding.spec[0] == ("replica", "data")
    assert trainer.process_batch_rows() == slice(0, BATCH)  # one process loads every row
    # each device holds BATCH / (replica * data) = 4 examples, the same on both devices of a model group
    shard_sizes = {s.data.shape[0] for s in placed.tokens.array.addressable_shards}
    assert shard_sizes == {BATCH // 4}


def test_clear_errors_for_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="train_batch_size=12 is not divisible by the data axis size 8"):
        Trainer(TrainerConfig(train_batch_size=12, compilation_cache_dir=None), optax.sgd(0.1), lm_loss)
    with pytest.raises(ValueError, match=r"model_axis_size=2 x replica_axis_size=3 .* does not divide the 8 devices"):
        Trainer(
            TrainerConfig(model_axis_size=2, replica_axis_size=3, compilation_cache_dir=None), optax.sgd(0.1), lm_loss
        )
    with pytest.raises(ValueError, match="per_device_parallelism=3 x data axis size 8"):
        Trainer(
            TrainerConfig(train_batch_size=16, per_device_parallelism=3, compilation_cache_dir=None),
            optax.sgd(0.1),
            lm_loss,
        )


def test_hybrid_mesh_over_process_groups_needs_several_processes():
    # one process cannot form two DCN groups: the error says what was asked
    with pytest.raises(ValueError, match="replica_dcn_axis_size=2"):
        Trainer(TrainerConfig(replica_dcn_axis_size=2, compilation_cache_dir=None), optax.sgd(0.1), lm_loss)


def test_tensor_parallel_config_is_a_dataclass_change_only():
    base = TrainerConfig(fsdp_axis="embed")
    tp = dataclasses.replace(base, model_axis_size=2, tensor_parallel_axes=["mlp", "heads"])
    assert tp.parameter_axis_mapping == {"embed": "data", "mlp": "model", "heads": "model"}
    assert tp.compute_axis_mapping == {"batch": ("replica", "data"), "mlp": "model", "heads": "model"}
    assert PartitionSpec(("replica", "data")) == PartitionSpec(tp.compute_axis_mapping["batch"])
