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
        "expert": 1,
        "context": 1,
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


# --- hybrid (multi-slice) mesh -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What ``create_hybrid_device_mesh`` reads of a device: its slice, process, kind and platform."""

    id: int
    slice_index: int
    process_index: int = 0
    platform: str = "cpu"
    device_kind: str = "fake"


@pytest.mark.parametrize(("replica", "model"), [(1, 2), (2, 1), (2, 2), (1, 1)])
def test_hybrid_mesh_puts_each_slice_on_contiguous_replica_rows(replica, model):
    from ponente.trainer.trainer._mesh import hybrid_device_grid

    dcn = 2
    # slices interleaved in the device list: the layout must group them, not follow the list order
    devices = [FakeDevice(id=i, slice_index=(i % 2)) for i in (5, 0, 3, 6, 1, 4, 7, 2)]
    config = TrainerConfig(replica_axis_size=replica, model_axis_size=model, replica_dcn_axis_size=dcn)
    grid = hybrid_device_grid(config, devices)

    data = len(devices) // (dcn * replica * model)
    assert grid.shape == (dcn * replica, data, 1, 1, model)  # the expert and context axes have size 1
    for k in range(dcn):
        in_slice = [d for d in devices if d.slice_index == k]  # in their list order within the slice
        block = grid[k * replica : (k + 1) * replica]
        assert {d.slice_index for d in block.flat} == {k}
        np.testing.assert_array_equal(
            np.vectorize(lambda d: d.id)(block), np.array([d.id for d in in_slice]).reshape(replica, data, 1, 1, model)
        )


def test_hybrid_mesh_groups_processes_when_devices_have_no_slices():
    from ponente.trainer.trainer._mesh import hybrid_device_grid

    @dataclasses.dataclass(frozen=True)
    class ProcessDevice:
        id: int
        process_index: int
        platform: str = "cpu"
        device_kind: str = "fake"

    devices = [ProcessDevice(id=i, process_index=i // 4) for i in range(8)]
    grid = hybrid_device_grid(TrainerConfig(replica_dcn_axis_size=2, model_axis_size=2), devices)
    # process 0's devices form replica row 0, process 1's row 1
    assert np.vectorize(lambda d: d.id)(grid)[:, :, 0, 0].tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(ValueError, match="replica_dcn_axis_size=4"):
        hybrid_device_grid(TrainerConfig(replica_dcn_axis_size=4, model_axis_size=2), devices)


# --- evaluation batches --------------------------------------------------------------------------


def test_eval_batch_size_follows_per_device_eval_parallelism():
    def size(**kw):
        config = TrainerConfig(train_batch_size=BATCH, compilation_cache_dir=None, **kw)
        return Trainer(config, optax.sgd(0.1), lm_loss).eval_batch_size

    assert size() == BATCH
    assert size(per_device_parallelism=1) == 8  # as for training: the microbatch
    assert size(per_device_eval_parallelism=3) == 24
    assert size(per_device_eval_parallelism=1, replica_axis_size=2, model_axis_size=2) == 4


def test_eval_over_per_process_rows_counts_every_example_once():
    from ponente.datacache import InMemoryTokenStore, TokenSeqDataset
    from ponente.trainer.run import eval_batches
    from ponente.trainer.tasks.lm import lm_batch, lm_loss_fn

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, Vocab.size, n).tolist() for n in (30, 17, 45, 9, 60)]
    dataset = TokenSeqDataset(InMemoryTokenStore.from_documents(docs), seq_len=MODEL.seq_len)
    length = len(dataset)
    size = 8
    assert length % size != 0, "the test needs a partial last batch"

    whole = list(eval_batches(dataset, size, None, make_batch=lm_batch))
    assert len(whole) == -(-length // size)
    # "processes" loading their own rows see as many batches, and together exactly the whole batches
    halves = [
        list(eval_batches(dataset, size, None, rows=slice(i * 4, i * 4 + 4), make_batch=lm_batch)) for i in range(2)
    ]
    assert [len(h) for h in halves] == [len(whole)] * 2
    for step, batch in enumerate(whole):
        for key in ("input_ids", "loss_mask"):
            joined = np.concatenate([np.asarray(h[step][key].array) for h in halves])
            np.testing.assert_array_equal(joined, np.asarray(batch[key].array))
        for position in range(size):
            index = step * size + position
            mask = np.asarray(batch["loss_mask"].array)[position]
            if index < length:
                row = dataset[index]
                np.testing.assert_array_equal(np.asarray(batch["input_ids"].array)[position], row["input_ids"])
                seg = row["segment_ids"]
                np.testing.assert_array_equal(mask[:-1], (seg[1:] == seg[:-1]).astype(np.float32))
            else:
                assert not mask.any(), f"padding row {index} of a dataset of {length} must not count"
    assert len(list(eval_batches(dataset, size, 2, make_batch=lm_batch))) == 2

    # the eval loss over padded batches equals a per-example loop over the dataset's rows
    loss_fn = lm_loss_fn()
    config = TrainerConfig(
        train_batch_size=BATCH, per_device_eval_parallelism=1, compilation_cache_dir=None, progress_bar=False
    )
    trainer = Trainer(config, optax.sgd(0.1), loss_fn)
    assert trainer.eval_batch_size == size
    state = trainer.initial_state(lambda key: MODEL.build(Vocab, key=key))
    got = trainer.eval_loss(
        state, eval_batches(dataset, size, None, trainer.process_batch_rows(size), make_batch=lm_batch)
    )
    total = tokens = 0.0
    for index in range(length):
        one = lm_batch({k: v[None] for k, v in dataset[index].items()})
        n = float(np.asarray(one["loss_mask"].array).sum())
        total += float(loss_fn(state.model, one, key=None)) * n
        tokens += n
    assert got == pytest.approx(total / tokens, rel=1e-5)


@pytest.mark.parametrize("name", ["data_parallel", "fsdp_replica", "fsdp_tp"])
def test_fused_loss_splits_the_batch_into_one_group_per_data_shard(name, reference, monkeypatch):
    """The fused cross-entropy (forced on for this tiny vocabulary) under the Trainer's layouts: the same training as
    the plain loss on one device, with one group per shard of the batch (the replica and data axes together), so the
    head's gradient is reduced across devices once per step (see the models' multidevice test of the loop)."""
    import ponente.models.loss.fused as fused_kernel
    import ponente.models.loss.next_token as next_token

    monkeypatch.setattr(next_token, "FUSED_LOSS_MIN_VOCAB", 8)
    # 16 (padded) vocab x 2 tokens: several chunks
    monkeypatch.setattr(fused_kernel, "FUSED_LOSS_CHUNK_ELEMENTS", 2 * 16)
    chosen = []
    real = fused_kernel._fused_groups

    def spy(*args, **kwargs):
        chosen.append(real(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(fused_kernel, "_fused_groups", spy)
    trainer, state, losses = train(jax.devices(), **LAYOUTS[name])
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for got, want in zip(named_leaves(state.model), ref_params, strict=True):
        np.testing.assert_allclose(np.asarray(got.array), want, atol=1e-5)
    shards = trainer.mesh.shape["replica"] * trainer.mesh.shape["data"]
    assert chosen, "the fused loss was not used"
    assert {(axis.name if axis is not None else None, groups) for axis, groups in chosen} == {("batch", shards)}
