"""Checkpoints: bitwise round trips of real training state, commit protocol, policies, errors, resharding."""

from __future__ import annotations

import datetime
import functools
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ponente.namedtensor as hax
from ponente.models import LlamaConfig
from ponente.namedtensor import NamedArray
from ponente.trainer.checkpoint import (
    METADATA_FILE,
    Checkpointer,
    CheckpointerConfig,
    CheckpointError,
    CheckpointInterval,
    cleanup_uncommitted,
    discover_checkpoints,
    latest_checkpoint_path,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)

_LLAMA = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
_VOCAB = hax.Axis("vocab", 11)


@functools.cache
def _model() -> Any:
    return _LLAMA.build(_VOCAB, key=jax.random.key(0))


@functools.cache
def _train_state() -> dict[str, Any]:
    """A tiny Llama, an adamw state after one update (non-zero moments), a typed key and a step."""
    model = _model()
    params = eqx.filter(model, eqx.is_inexact_array)
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    _, opt_state = jax.jit(opt.update)(grads, opt_state, params)
    return {"model": model, "opt_state": opt_state, "key": jax.random.key(1), "step": 3}


def _zeros_like(tree: Any) -> Any:
    """A template with the structure of ``tree`` and other values (zeros, another key, other scalars)."""

    def other(x: Any) -> Any:
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key(99)
        if isinstance(x, (jax.Array, np.ndarray)):
            return jnp.zeros_like(x)
        return type(x)() if isinstance(x, (int, float, str)) else x

    return jax.tree.map(other, tree)


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """(path, leaf) with NamedArrays as leaves: an independent walk to compare trees leaf by leaf."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, NamedArray))[0]
    return [(jax.tree_util.keystr(p), leaf) for p, leaf in flat]


def _host(x: Any) -> Any:
    if isinstance(x, NamedArray):
        return tuple(x.axes), _host(x.array)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x))
    if isinstance(x, (jax.Array, np.ndarray)):
        return np.asarray(x)
    return x


def _assert_bitwise_equal(expected: Any, actual: Any) -> None:
    exp, act = _named_leaves(expected), _named_leaves(actual)
    assert [p for p, _ in exp] == [p for p, _ in act]
    for (path, e), (_, a) in zip(exp, act, strict=True):
        he, ha = _host(e), _host(a)
        assert type(e) is type(a) or isinstance(a, jax.Array), path
        if isinstance(he, tuple):
            assert he[0] == ha[0], path
            he, ha = he[1], ha[1]
        if isinstance(he, np.ndarray):
            assert (he.dtype, he.shape) == (ha.dtype, ha.shape), path
            # compare bytes, so NaNs and -0.0 count too
            assert he.tobytes() == ha.tobytes(), path
        else:
            assert (he, type(he)) == (ha, type(ha)), path


def _file_count(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def test_round_trip_of_llama_adamw_key_and_step_is_bitwise(tmp_path: Path) -> None:
    state = _train_state()
    save_checkpoint(state, tmp_path / "step-3", step=3, metadata={"config": {"lr": 0.01}})
    loaded = load_checkpoint(_zeros_like(state), tmp_path / "step-3")
    _assert_bitwise_equal(state, loaded)
    meta = read_metadata(tmp_path / "step-3")
    assert meta is not None
    assert meta["step"] == 3
    assert meta["metadata"] == {"config": {"lr": 0.01}}
    assert "ponente-trainer" in meta["versions"]
    assert "jax" in meta["versions"]


def test_a_checkpoint_is_a_handful_of_files_not_one_per_leaf(tmp_path: Path) -> None:
    tree = {f"layer{i}": {"w": jnp.full((4, 3), i, jnp.float32), "b": jnp.arange(3) + i} for i in range(50)}
    save_checkpoint(tree, tmp_path / "step-1", step=1)
    assert len(jax.tree.leaves(tree)) == 100
    assert _file_count(tmp_path) <= 10
    loaded = load_checkpoint(jax.tree.map(jnp.zeros_like, tree), tmp_path / "step-1")
    _assert_bitwise_equal(tree, loaded)


def test_load_into_an_abstract_template(tmp_path: Path) -> None:
    state = _train_state()
    save_checkpoint(state, tmp_path / "ckpt", step=3)
    abstract = eqx.filter_eval_shape(lambda: _zeros_like(state))
    assert isinstance(jax.tree.leaves(abstract["model"])[0], jax.ShapeDtypeStruct)
    loaded = load_checkpoint(abstract, tmp_path / "ckpt")
    _assert_bitwise_equal(state, loaded)


def test_subpath_loads_only_the_model(tmp_path: Path) -> None:
    state = _train_state()
    save_checkpoint(state, tmp_path / "ckpt", step=3)
    template = eqx.filter_eval_shape(_LLAMA.build, _VOCAB, key=jax.random.key(9))
    model = load_checkpoint(template, tmp_path / "ckpt", subpath="model")
    _assert_bitwise_equal(state["model"], model)
    # the loaded model runs
    logits = model(hax.zeros({"position": 8}, dtype=int), None, key=None)
    assert logits.axis_size("vocab") == 11


def test_numpy_leaves_python_scalars_and_bfloat16(tmp_path: Path) -> None:
    tree = {
        "np": np.arange(5, dtype=np.int64),
        "bf16": jnp.asarray([1.5, -0.0, np.nan], dtype=jnp.bfloat16),
        "flag": True,
        "lr": 0.1 + 0.2,
        "name": "run",
        "split_keys": jax.random.split(jax.random.key(4, impl="rbg"), 3),
        "fn": jax.nn.relu,
    }
    save_checkpoint(tree, tmp_path / "c", step=0)
    template = {**tree, "np": np.zeros(5, np.int64), "flag": False, "lr": 0.0, "name": ""}
    loaded = load_checkpoint(template, tmp_path / "c")
    _assert_bitwise_equal(tree, loaded)
    assert isinstance(loaded["np"], np.ndarray)
    assert loaded["fn"] is jax.nn.relu


def test_numpy_scalar_leaves_round_trip(tmp_path: Path) -> None:
    # np.array(np.int64(3), copy=False) raises under NumPy 2: scalars need a copy-free path of their own
    tree = {"count": np.int64(3), "scale": np.float32(0.25)}
    save_checkpoint(tree, tmp_path / "c", step=0)
    loaded = load_checkpoint({"count": np.int64(0), "scale": np.float32(0)}, tmp_path / "c")
    assert int(loaded["count"]) == 3
    assert float(loaded["scale"]) == 0.25


def test_memory_location_round_trip_and_discovery() -> None:
    run = f"memory://ckpt-test-{uuid.uuid4().hex}/run"
    state = _train_state()
    save_checkpoint(state, f"{run}/step-2", step=2)
    save_checkpoint({"only": jnp.ones(2)}, f"{run}/step-9", step=9)
    assert latest_checkpoint_path(run) == f"{run}/step-9"
    _assert_bitwise_equal(state, load_checkpoint(_zeros_like(state), f"{run}/step-2"))


def test_uncommitted_checkpoints_are_ignored_and_older_ones_cleaned(tmp_path: Path) -> None:
    for step in (1, 2, 4):
        save_checkpoint({"w": jnp.full(3, step)}, tmp_path / f"step-{step}", step=step)
    # step-2 and step-4 lose their commit marker: a crash before the commit looks exactly like this
    for step in (2, 4):
        (tmp_path / f"step-{step}" / METADATA_FILE).unlink()
    assert latest_checkpoint_path(tmp_path) == str(tmp_path / "step-1")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "step-4")):
        load_checkpoint({"w": jnp.zeros(3, jnp.int32)}, tmp_path / "step-4")
    loaded = load_checkpoint({"w": jnp.zeros(3, jnp.int32)}, tmp_path)  # a run dir: its latest committed one
    np.testing.assert_array_equal(loaded["w"], [1, 1, 1])
    save_checkpoint({"w": jnp.full(3, 3)}, tmp_path / "step-3", step=3)
    deleted = cleanup_uncommitted(tmp_path)
    # only incomplete checkpoints older than the latest commit go; step-4 may still be in progress
    assert deleted == [str(tmp_path / "step-2")]
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-3", "step-4"]
    assert [(c.step, c.committed) for c in discover_checkpoints(tmp_path)] == [(1, True), (3, True), (4, False)]


def test_saving_over_a_committed_checkpoint_replaces_it(tmp_path: Path) -> None:
    save_checkpoint({"w": jnp.arange(4)}, tmp_path / "c", step=1)
    save_checkpoint({"w": jnp.arange(4) * 10}, tmp_path / "c", step=1)
    np.testing.assert_array_equal(
        load_checkpoint({"w": jnp.zeros(4, jnp.int32)}, tmp_path / "c")["w"], [0, 10, 20, 30]
    )


def test_error_messages_name_the_leaf_and_what_differs(tmp_path: Path) -> None:
    model = _model()
    save_checkpoint({"model": model, "step": 1}, tmp_path / "c", step=1)
    with pytest.raises(
        CheckpointError, match=r"'model\.transformer\.embed_tokens\.weight'.*expected \(12, 16\).*found \(11, 16\)"
    ):
        load_checkpoint(
            {"model": eqx.filter_eval_shape(_LLAMA.build, hax.Axis("vocab", 12), key=jax.random.key(0))},
            tmp_path / "c",
        )
    with pytest.raises(CheckpointError, match=r"'extra' is missing from checkpoint"):
        load_checkpoint({"model": model, "extra": jnp.zeros(2)}, tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"'step'.*expected a Python float, found int"):
        load_checkpoint({"step": 1.0}, tmp_path / "c")
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    with pytest.raises(CheckpointError, match=r"dtype mismatch.*expected bfloat16.*found float32"):
        load_checkpoint(bf16, tmp_path / "c", subpath="model")
    renamed = hax.zeros({"vocab": 11, "hidden": 16})
    with pytest.raises(CheckpointError, match=r"'model\.lm_head\.weight'.*expected axes \['vocab', 'hidden'\]"):
        load_checkpoint({"lm_head": {"weight": renamed}}, tmp_path / "c", subpath="model")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nothing")):
        load_checkpoint({"step": 0}, tmp_path / "nothing")
    with pytest.raises(ValueError, match="unsupported checkpoint location 'ftp://x'"):
        save_checkpoint({"step": 0}, "ftp://x", step=0)


def test_async_save_keeps_the_values_of_the_moment_it_was_called(tmp_path: Path) -> None:
    host = np.arange(1 << 16, dtype=np.float32)
    device = jnp.arange(1 << 16, dtype=jnp.float32)
    expected = {"host": host.copy(), "device": np.asarray(device).copy()}
    with Checkpointer(tmp_path, save_interval=datetime.timedelta(hours=1), keep=[]) as ckpt:
        ckpt.save({"host": host, "device": device}, step=1)
        host += 1  # in-place mutation right after save() returned
        bump = jax.jit(lambda x: x + 1, donate_argnums=0)
        device = bump(device)  # donation: the saved buffer may be reused
        ckpt.wait_until_finished()
    loaded = load_checkpoint({"host": np.zeros_like(host), "device": jnp.zeros_like(device)}, tmp_path)
    np.testing.assert_array_equal(loaded["host"], expected["host"])
    np.testing.assert_array_equal(loaded["device"], expected["device"])


def test_background_errors_surface_on_the_next_call(tmp_path: Path) -> None:
    # provenance that JSON cannot hold fails while committing, on the background thread
    ckpt = Checkpointer(tmp_path, save_interval=datetime.timedelta(hours=1), keep=[], metadata={"bad": object()})
    ckpt.save({"w": jnp.ones(2)}, step=1)  # returns: the failure happens in the background
    with pytest.raises(TypeError, match="not JSON serializable"):
        ckpt.wait_until_finished()
    ckpt.save({"w": jnp.ones(2)}, step=2)
    ckpt._future.exception()  # type: ignore[union-attr]  # let the background save fail
    with pytest.raises(TypeError, match="not JSON serializable"):
        ckpt.on_step({"w": jnp.ones(2)}, 3)
    ckpt.close()
    assert latest_checkpoint_path(tmp_path) is None


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps_on_disk(path: Path) -> list[int]:
    return sorted(int(name.removeprefix("step-")) for name in os.listdir(path))


def test_retention_policies_keep_and_delete_exactly_what_they_should(tmp_path: Path) -> None:
    clock = _FakeClock()
    cfg = CheckpointerConfig(
        base_path=str(tmp_path),
        save_interval=datetime.timedelta(seconds=60),
        keep=[CheckpointInterval(every=5, until=10), CheckpointInterval(every=10)],
    )
    ckpt = cfg.create("run1", time_fn=clock, metadata={"config": {"x": 1}})
    run = tmp_path / "run1"
    saved = []
    on_disk = {}
    for step in range(30):
        clock.now = 25.0 * step  # 25 s per step: a temporary save every third step without another save
        if ckpt.on_step({"w": jnp.full(2, step)}, step):
            saved.append(step)
        ckpt.wait_until_finished()
        on_disk[step] = _steps_on_disk(run) if run.exists() else []
    # worked by hand: permanent at 5, 10 (every 5 up to 10), then 20 (every 10); temporary when 60 s passed
    assert saved == [3, 5, 8, 10, 13, 16, 19, 20, 23, 26, 29]
    assert on_disk[3] == [3]
    assert on_disk[5] == [5]
    assert on_disk[8] == [5, 8]
    assert on_disk[13] == [5, 10, 13]
    assert on_disk[16] == [5, 10, 16]
    assert on_disk[29] == [5, 10, 20, 29]
    meta = read_metadata(run / "step-29")
    assert meta is not None
    assert meta["temporary"] is True
    assert meta["metadata"] == {"config": {"x": 1}}
    ckpt.close()

    # a restart knows step-29 is temporary from its metadata and deletes it after the next commit
    restarted = cfg.create("run1", time_fn=clock)
    assert not restarted.on_step({"w": jnp.full(2, 29)}, 29)  # the step it resumed from is not saved again
    assert restarted.on_step({"w": jnp.full(2, 31)}, 31, force=True)
    restarted.close()
    assert _steps_on_disk(run) == [5, 10, 20, 31]
    assert latest_checkpoint_path(tmp_path) == str(run / "step-31")


def test_checkpointer_config_validates_keep() -> None:
    with pytest.raises(ValueError, match=r"keep\[0\] has no `until`"):
        CheckpointerConfig(keep=[CheckpointInterval(every=5), CheckpointInterval(every=10, until=100)])
    with pytest.raises(ValueError, match="must increase"):
        CheckpointerConfig(keep=[CheckpointInterval(every=5, until=100), CheckpointInterval(every=10, until=50)])
    with pytest.raises(ValueError, match="`every` must be >= 1"):
        CheckpointInterval(every=0)


_KILL_SCRIPT = textwrap.dedent(
    """
    import datetime, os, sys, time, jax.numpy as jnp, numpy as np
    from ponente.trainer.checkpoint import Checkpointer, save_checkpoint
    run = sys.argv[1]
    save_checkpoint({"w": jnp.arange(6, dtype=jnp.float32), "step": 1}, run + "/step-1", step=1)
    big = {"w": jnp.arange(6, dtype=jnp.float32), "step": 2,
           "big": [jnp.full((1024, 1024), i, jnp.float32) for i in range(96)]}
    ckpt = Checkpointer(run, save_interval=datetime.timedelta(hours=1), keep=[])
    ckpt.save(big, step=2)
    deadline = time.monotonic() + 120
    while not os.path.exists(run + "/step-2/process-0/d"):  # the background thread is writing array data
        time.sleep(0.001)
        assert time.monotonic() < deadline, "the save never started writing"
    print("saving", flush=True)
    ckpt.wait_until_finished()
    print("finished", flush=True)
    """
)


@pytest.mark.integration
def test_kill_9_during_an_async_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "saving"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "step-2").exists()
    assert read_metadata(tmp_path / "step-2") is None
    assert latest_checkpoint_path(tmp_path) == str(tmp_path / "step-1")
    loaded = load_checkpoint({"w": jnp.zeros(6), "step": 0}, tmp_path)
    np.testing.assert_array_equal(loaded["w"], np.arange(6, dtype=np.float32))
    assert loaded["step"] == 1


@pytest.mark.multidevice
def test_save_fsdp_sharded_on_8_devices_and_load_onto_1_device_and_another_mesh(tmp_path: Path) -> None:
    assert len(jax.devices()) == 8
    model = _model()
    expected = jax.tree.map(np.asarray, model)
    mesh = hax.partitioning.make_mesh({"data": 4, "model": 2})
    sharded = hax.shard(model, {"embed": "data", "mlp": "model"}, mesh)
    w = sharded.transformer.layers.stacked.mlp.up_proj.weight.array
    assert len({str(s.index) for s in w.addressable_shards}) == 8  # really split over the devices
    save_checkpoint({"model": sharded}, tmp_path / "c", step=1)

    one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    on_one = load_checkpoint(model, tmp_path / "c", subpath="model", shardings=one)
    other = hax.partitioning.make_mesh({"data": 2, "model": 4})
    shardings = hax.partitioning.infer_resource_partitions(model, {"mlp": "model", "kv_heads": "data"}, mesh=other)
    on_other = load_checkpoint(model, tmp_path / "c", subpath="model", shardings=shardings)
    for loaded in (on_one, on_other):
        _assert_bitwise_equal(expected, jax.tree.map(np.asarray, loaded))
    assert on_one.lm_head.weight.array.sharding == one
    up = on_other.transformer.layers.stacked.mlp.up_proj.weight.array
    assert up.sharding.spec == shardings.transformer.layers.stacked.mlp.up_proj.weight.spec
    assert len({str(s.index) for s in up.addressable_shards}) == 4
