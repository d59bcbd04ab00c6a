"""ponente.trainer checkpoints: save/restore throughput vs raw TensorStore, and time blocked by async saves."""

from __future__ import annotations

import datetime
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Recorder, time_fn

_REPEAT = 5


def _state() -> dict[str, Any]:
    """~300 MB of float32 parameters in 30 large and 60 small arrays, like a small model's weights."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 30)
    big = [jax.random.normal(k, (1024, 2560), dtype=jnp.float32) for k in keys]
    small = [jnp.full((2560,), i, dtype=jnp.float32) for i in range(60)]
    tree = {"layers": [{"w": w, "norm": small[2 * i], "bias": small[2 * i + 1]} for i, w in enumerate(big)]}
    jax.block_until_ready(tree)
    return tree


def _raw_write(arrays: list[np.ndarray], root: Path) -> None:
    """The reference: one zarr3 array per leaf on the plain file driver, same chunks and codecs, in parallel."""
    import tensorstore as ts

    opened = [
        ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": f"{root}/{i}/"},
                "metadata": {
                    "shape": list(a.shape),
                    "data_type": a.dtype.name,
                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(a.shape)}},
                    "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                },
            },
            create=True,
            delete_existing=True,
        )
        for i, a in enumerate(arrays)
    ]
    writes = [f.result().write(a) for f, a in zip(opened, arrays, strict=True)]
    for w in writes:
        w.result()


def _raw_read(count: int, root: Path) -> list[np.ndarray]:
    import tensorstore as ts

    specs = [{"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{root}/{i}/"}} for i in range(count)]
    opened = [ts.open(spec) for spec in specs]
    reads = [f.result().read() for f in opened]
    return [r.result() for r in reads]


def _interleaved_saves(tree: Any, host: list[np.ndarray], root: Path) -> tuple[float, float]:
    """Median seconds of a raw write and of ``save_checkpoint``, each into a fresh directory.

    Training writes every checkpoint to a new ``step-<N>`` directory, so neither side pays for deleting
    an old one; the two alternate so that load from other users of a shared machine hits both alike.
    """
    from ponente.trainer.checkpoint import save_checkpoint

    raw_times, ours_times = [], []
    for i in range(1 + _REPEAT):  # the first round warms up
        start = time.perf_counter()
        _raw_write(host, root / f"raw-{i}")
        middle = time.perf_counter()
        save_checkpoint(tree, root / f"step-{i}", step=i)
        end = time.perf_counter()
        if i:
            raw_times.append(middle - start)
            ours_times.append(end - middle)
        shutil.rmtree(root / f"raw-{i}")
        shutil.rmtree(root / f"step-{i}")
    return float(np.median(raw_times)), float(np.median(ours_times))


def run(rec: Recorder) -> None:
    """Save and restore MB/s against a raw TensorStore write/read of the same arrays on the same disk
    (``ratio_vs_raw`` >= 0.8 is the target), and the fraction of an asynchronous save's duration during
    which the caller is blocked (target < 5%)."""
    import jax
    import jax.numpy as jnp

    from ponente.trainer.checkpoint import Checkpointer, load_checkpoint, save_checkpoint

    tree = _state()
    leaves = jax.tree.leaves(tree)
    host = [np.asarray(x) for x in leaves]
    mb = sum(a.nbytes for a in host) / 1e6
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        root = Path(tmp)
        raw_save, ours_save = _interleaved_saves(tree, host, root)
        _raw_write(host, root / "raw")  # what the restores read
        save_checkpoint(tree, root / "ckpt", step=1)
        rec.record("save", "MB_per_s", mb / ours_save, "MB/s", state_mb=mb, leaves=len(leaves))
        rec.record("save", "raw_tensorstore_MB_per_s", mb / raw_save, "MB/s", state_mb=mb)
        rec.record("save", "ratio_vs_raw", raw_save / ours_save, "x", target=">= 0.8")

        def restore() -> None:
            jax.block_until_ready(load_checkpoint(template, root / "ckpt"))

        def raw_restore() -> None:
            jax.block_until_ready([jnp.asarray(a) for a in _raw_read(len(host), root / "raw")])

        ours_load = time_fn(restore, warmup=1, repeat=_REPEAT)
        raw_load = time_fn(raw_restore, warmup=1, repeat=_REPEAT)
        rec.record("restore", "MB_per_s", mb / ours_load, "MB/s", state_mb=mb)
        rec.record("restore", "raw_tensorstore_MB_per_s", mb / raw_load, "MB/s", state_mb=mb)
        rec.record("restore", "ratio_vs_raw", raw_load / ours_load, "x", target=">= 0.8")

        fractions = []
        ckpt = Checkpointer(root / "run", save_interval=datetime.timedelta(hours=1), keep=[])
        for step in range(1, 1 + _REPEAT):
            start = time.perf_counter()
            ckpt.save(tree, step)
            blocked = time.perf_counter() - start
            ckpt.wait_until_finished()
            fractions.append(blocked / (time.perf_counter() - start))
        ckpt.close()
        rec.record("async_save", "blocked_fraction", float(np.median(fractions)), "fraction", target="< 0.05")
        shutil.rmtree(root, ignore_errors=True)
