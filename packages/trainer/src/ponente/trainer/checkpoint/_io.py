"""Writing and reading one checkpoint: zarr3 arrays in an OCDBT key-value store, then the commit marker.

A checkpoint directory holds one OCDBT database per writing process (``process-<i>/``: a manifest, a
few B-tree files and a few large data files, not one file per parameter) containing a zarr3 array per
stored leaf, keyed by the leaf's dotted tree path, the blocks that process wrote (``process-<i>.json``),
and ``metadata.json``, written last. No two processes write one OCDBT store (it has no safe concurrent
writers without a coordinator); loading gathers each block from the stores that hold it. A directory
without ``metadata.json`` is not a checkpoint: it is never loaded, and the next save cleans it up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from ponente.trainer.versions import ponente_versions, runtime_versions

from . import _location as loc
from ._discovery import resolve_checkpoint
from ._errors import CheckpointCorruptError, CheckpointDiskFullError, CheckpointError, is_disk_full
from ._location import PathLike
from ._marker import METADATA_FILE, delete_checkpoint, read_metadata
from ._sync import CheckpointWriteError, agree, next_save_id, save_nonce
from ._tree import Kind, array_of, axis_names, flatten, key_impl_name, kind_of, map_shardings, rewrap

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
"""3: as 2, and every piece list and ``metadata.json`` carry the save's nonce (one writer per checkpoint); 2: one
OCDBT store per writing process (``process-<i>/``) plus its piece list; 1: one shared store."""

_MAX_CHUNK_BYTES = 64 << 20
# OCDBT packs values into data files of about this size: large enough for few files (~30 per GB), small
# enough that several files are written in parallel (128 MB measured ~1.5x slower on a 300 MB state).
_DATA_FILE_BYTES = 32 << 20

ShardingSpec = jax.sharding.Sharding | Callable[[Any], Any] | Any


def sync_processes(name: str) -> None:
    """Barrier across JAX processes, a no-op with a single process.

    It waits on ``jax.distributed``'s coordination service, not in a device collective, so it may run on any
    thread (a background save) without its order relative to the training step's collectives mattering.

    Args:
        name: the barrier's name; every process passes the same name, and each name is used once per run.

    Raises:
        RuntimeError: if a process died or the barrier timed out.
    """
    agree(name)


@dataclasses.dataclass
class _Piece:
    index: tuple[slice, ...]
    data: Any  # a private copy: np.ndarray, or a jax.Array nothing else references


@dataclasses.dataclass
class _StoredArray:
    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    pieces: list[_Piece]


@dataclasses.dataclass
class Snapshot:
    """A private copy of a tree's state, taken on the caller's thread, that can be written later.

    Attributes:
        step: the training step the state belongs to.
        leaves: ``metadata.json``'s description of every leaf, in tree order.
        arrays: the array data to store, one entry per array or key leaf.
        treedef: the tree structure, as text (for humans reading ``metadata.json``).
        save_id: the number of this save among the process's saves (taken when the snapshot is made, on the
            thread that starts the save, so the n-th save of every process has the same number); it names
            the save's cross-process meeting points.
    """

    step: int
    leaves: dict[str, dict[str, Any]]
    arrays: list[_StoredArray]
    treedef: str
    save_id: int = dataclasses.field(default_factory=next_save_id)


def _chunk_shape(piece_shapes: list[tuple[int, ...]], itemsize: int) -> tuple[int, ...]:
    """One chunk per written piece (so processes never share a chunk), split further if very large."""
    chunk = [max(1, max(dims)) for dims in zip(*piece_shapes, strict=True)] if piece_shapes[0] else []
    while chunk and int(np.prod(chunk)) * itemsize > _MAX_CHUNK_BYTES:
        even = [i for i, d in enumerate(chunk) if d % 2 == 0]
        if not even:
            break
        i = max(even, key=lambda j: chunk[j])
        chunk[i] //= 2
    return tuple(chunk)


def _copy_pieces(x: Any, copy: bool) -> list[_Piece]:
    """The parts of ``x`` this process must write (its shards with ``replica_id == 0``), private copies if ``copy``."""
    if isinstance(x, (np.ndarray, np.generic)):
        # host arrays are the same on every process: process 0 writes them
        if jax.process_index() != 0:
            return []
        return [_Piece(tuple(slice(None) for _ in np.shape(x)), np.array(x) if copy else np.asarray(x))]
    pieces = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        if shard.data.device.platform == "cpu" and copy:
            # an asynchronous on-device copy is a host copy here; the caller may donate ``x`` right after
            pieces.append(_Piece(shard.index, jnp.copy(shard.data)))
        else:
            pieces.append(_Piece(shard.index, shard.data))
    return pieces


def snapshot(tree: Any, step: int, *, copy: bool = True) -> Snapshot:
    """Copy what a checkpoint of ``tree`` needs, so the caller may mutate or donate ``tree`` afterwards.

    Args:
        tree: the state to checkpoint.
        step: its training step.
        copy: copy arrays that already live in host memory (CPU devices, NumPy); False references them
            instead, for a caller that blocks until the write is done (:func:`save_checkpoint`).

    Raises:
        ValueError: if two leaves have the same dotted path.
    """
    leaves, treedef = flatten(tree)
    described: dict[str, dict[str, Any]] = {}
    arrays: list[_StoredArray] = []
    for name, leaf in leaves:
        kind = kind_of(leaf)
        entry: dict[str, Any] = {"kind": kind.value}
        if kind is Kind.SCALAR:
            entry.update(type=type(leaf).__name__, value=leaf)
        elif kind is Kind.TEMPLATE:
            entry.update(type=type(leaf).__qualname__)
        else:
            x = array_of(leaf)
            if isinstance(x, jax.ShapeDtypeStruct):
                raise ValueError(f"cannot save leaf {name!r}: it is abstract ({x}); save concrete arrays")
            if kind is Kind.KEY:
                entry["impl"] = key_impl_name(x)
                x = jax.random.key_data(x)
            dtype = np.dtype(x.dtype)
            entry.update(dtype=dtype.name, shape=list(np.shape(x)), axes=axis_names(leaf))
            pieces = _copy_pieces(x, copy)
            chunk = _chunk_shape([tuple(np.shape(p.data)) for p in pieces] or [np.shape(x)], dtype.itemsize)
            arrays.append(_StoredArray(name, dtype, tuple(np.shape(x)), chunk, pieces))
        described[name] = entry
    # on accelerators, start every device-to-host transfer at once, then wait for them all
    # (``devices()`` may return a cached set: never mutate it)
    device_pieces = [
        p
        for a in arrays
        for p in a.pieces
        if isinstance(p.data, jax.Array) and any(d.platform != "cpu" for d in p.data.devices())
    ]
    for p in device_pieces:
        p.data.copy_to_host_async()
    for p in device_pieces:
        p.data = np.asarray(p.data)
    return Snapshot(step=step, leaves=described, arrays=arrays, treedef=str(treedef))


def _ocdbt_spec(path: str) -> dict[str, Any]:
    return {"driver": "ocdbt", "base": loc.kvstore_spec(path), "target_data_file_size": _DATA_FILE_BYTES}


def _array_spec(path: str, name: str) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {**_ocdbt_spec(path), "path": name + "/"}}


def _process_dir(target: str, process: int) -> str:
    """The OCDBT store that process ``process`` writes its shards to (no process shares a store)."""
    return loc.join(target, f"process-{process}")


def _pieces_file(process: int) -> str:
    """The JSON file listing which block of which array process ``process`` wrote."""
    return f"process-{process}.json"


Box = list[list[int]]  # [[start, stop], ...] per dimension


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    return [list(sl.indices(dim)[:2]) for sl, dim in zip(index, shape, strict=True)]


SLOW_CHECKPOINT_ENV = "PONENTE_TEST_SLOW_CHECKPOINT"
"""Test seam: seconds to sleep after a save wrote its arrays and before it commits (unset: no delay)."""


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, without the store spec TensorStore appends (long JSON, no news)."""
    lines = str(exc).strip().splitlines()
    line = lines[0] if lines else type(exc).__name__
    return line.split(" [tensorstore_spec=", 1)[0]


def _test_delay_before_commit(target: str) -> None:
    """Sleep ``$PONENTE_TEST_SLOW_CHECKPOINT`` seconds, so tests can kill a process during an in-flight save."""
    delay = os.environ.get(SLOW_CHECKPOINT_ENV)
    if delay:
        logger.warning("%s=%s: arrays of %s written, waiting before the commit", SLOW_CHECKPOINT_ENV, delay, target)
        time.sleep(float(delay))


def _stage(name: str, token: str, work: Callable[[], None]) -> None:
    """Run ``work``, then meet the other processes at ``name``; a failure anywhere raises everywhere."""
    if jax.process_count() == 1:
        work()
        return
    error: Exception | None = None
    try:
        work()
    except Exception as e:  # reported to every process at the meeting point, then raised
        error = e
    agree(name, token=token, error=error)


def _read_nonce(target: str, process: int) -> str | None:
    """The nonce in process ``process``'s piece list at ``target`` (None: missing, unreadable or of format 2)."""
    return _nonce_of(loc.read_bytes(target, _pieces_file(process)))


def _nonce_of(raw: bytes | None) -> str | None:
    """The nonce of a piece list's bytes (None: missing, unreadable or of format 2)."""
    try:
        listing = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return listing.get("nonce") if isinstance(listing, dict) and isinstance(listing.get("nonce"), str) else None


def write_snapshot(
    snap: Snapshot,
    path: PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    temporary: bool = False,
    guard: Callable[[], None] | None = None,
) -> str:
    """Write a snapshot as a checkpoint at ``path`` and commit it (runs on any thread).

    An existing checkpoint at ``path`` is un-committed (its marker deleted) and replaced. With several
    processes, every process calls this for the same snapshot (same step, same path, same order of saves);
    they meet three times through ``jax.distributed``'s coordination service (never a device collective, so
    a background thread may do this while the main thread trains): after process 0 cleared the target,
    after every process wrote its shards, and after process 0 wrote ``metadata.json``. A failure on any
    process is reported to all of them at the next meeting point, and nothing is committed.

    Every process writes the save's nonce (:func:`~ponente.trainer.checkpoint._sync.save_nonce`) into its piece
    list; before committing, process 0 checks that every piece list still holds it (no other writer replaced
    one) and that ``guard`` passes (the run's writer lease is still held), then writes it into ``metadata.json``.

    Args:
        snap: the snapshot.
        path: the checkpoint directory.
        metadata: JSON-serializable provenance stored in ``metadata.json``.
        temporary: mark it temporary (deleted once a newer checkpoint commits).
        guard: called by process 0 just before the commit; raises to refuse it (e.g. a lost writer lease).

    Returns:
        The normalized checkpoint path.

    Raises:
        CheckpointWriteError: if another writer replaced this save's files (its nonce is gone from a piece list);
            nothing is committed.
        CheckpointDiskFullError: if the disk filled up (ENOSPC, EDQUOT) during the write: ``disk full while
            writing checkpoint <path>``; the partial directory is not committed (and deleted if possible).
        CheckpointWriteError: (several processes) if a process failed, or the processes save different
            steps or paths; the message names the processes.
    """
    target = loc.normalize(path)
    start = time.perf_counter()
    process = jax.process_index()
    meeting = f"ponente-checkpoint/{snap.save_id}"
    token = f"step {snap.step} at {target}"
    nonce = save_nonce(meeting)

    def clear() -> None:
        if process == 0:
            delete_checkpoint(target)

    def write_own_shards() -> None:
        store_dir = _process_dir(target, process)
        ctx = loc.context()
        # one transaction: OCDBT then writes the data files in parallel and commits its B-tree and manifest
        # once, instead of once per write batch (about 1.4x faster; the data is buffered in memory until then)
        txn = ts.Transaction()
        opened = []
        for arr in snap.arrays:
            spec = _array_spec(store_dir, arr.name)
            spec["metadata"] = {
                "shape": list(arr.shape),
                "data_type": arr.dtype.name,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(arr.chunk_shape)}},
                # crc32c: a damaged byte fails the load (and a resume falls back) instead of loading silently
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            }
            # each process writes its own OCDBT store: OCDBT has no safe concurrent writers without a coordinator
            opened.append(ts.open(spec, create=True, context=ctx, transaction=txn))
        stores = [f.result() for f in opened]
        writes = [
            store[piece.index].write(np.asarray(piece.data))
            for store, arr in zip(stores, snap.arrays, strict=True)
            for piece in arr.pieces
        ]
        for w in writes:
            w.result()
        txn.commit_async().result()
        pieces = {arr.name: [_box(p.index, arr.shape) for p in arr.pieces] for arr in snap.arrays}
        loc.write_bytes(target, _pieces_file(process), json.dumps({"nonce": nonce, "pieces": pieces}).encode())
        _test_delay_before_commit(target)

    def commit() -> None:
        if process != 0:
            return
        if guard is not None:
            guard()
        foreign = [p for p in range(jax.process_count()) if _read_nonce(target, p) != nonce]
        if foreign:
            raise CheckpointWriteError(
                f"checkpoint {target}: another writer replaced the files of process(es) {foreign} during this save "
                "(two runs with one run id?); not committed"
            )
        now = datetime.datetime.now(datetime.UTC)
        marker = {
            "format_version": FORMAT_VERSION,
            "num_processes": jax.process_count(),
            "step": snap.step,
            "timestamp": now.isoformat(),
            "temporary": temporary,
            "nonce": nonce,
            "versions": {**ponente_versions(), **runtime_versions()},
            "metadata": dict(metadata or {}),
            "treedef": snap.treedef,
            "leaves": snap.leaves,
        }
        loc.write_bytes(target, METADATA_FILE, json.dumps(marker, indent=1).encode())

    try:
        _stage(f"{meeting}/cleared", token, clear)
        _stage(f"{meeting}/written", token, write_own_shards)  # process 0 commits only after every process wrote
        _stage(f"{meeting}/committed", token, commit)  # nobody runs ahead of a checkpoint that may not exist yet
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        # nothing was committed; deleting the partial files gives the space back (best effort, it may fail too)
        if process == 0 and jax.process_count() == 1:
            with contextlib.suppress(Exception):
                delete_checkpoint(target)
        raise CheckpointDiskFullError(target, _first_line(exc)) from exc
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in snap.arrays)
    logger.info(
        "saved checkpoint of step %d to %s (%.1f MB in %.2f s)",
        snap.step,
        target,
        nbytes / 1e6,
        time.perf_counter() - start,
    )
    return target


def save_checkpoint(tree: Any, path: PathLike, *, step: int, metadata: Mapping[str, Any] | None = None) -> str:
    """Save ``tree`` as a committed checkpoint at ``path``, blocking until it is written.

    Works on any pytree: Equinox modules with NamedArray leaves, optax states, typed PRNG keys, NumPy
    arrays and Python scalars. Leaves of other types (functions, arbitrary objects) are not stored;
    :func:`load_checkpoint` takes them from its template. ``metadata.json`` is written last: until it
    exists the directory is not a checkpoint. An existing checkpoint at ``path`` is replaced.

    Args:
        tree: the state to save.
        path: the checkpoint directory (local path, ``memory://...``, ``gs://...``, ``s3://...``).
        step: the training step, recorded in the commit marker.
        metadata: JSON-serializable extras (resolved config, ...), recorded under ``"metadata"``.

    Returns:
        The normalized checkpoint path.

    Raises:
        ValueError: if two leaves have the same dotted path, or the location's scheme is unsupported.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> path = save_checkpoint({"w": jnp.ones(3), "step": 7}, tempfile.mkdtemp() + "/step-7", step=7)
        >>> load_checkpoint({"w": jnp.zeros(3), "step": 0}, path)["step"]
        7
    """
    # the caller waits for the write, so host arrays need no private copy
    return write_snapshot(snapshot(tree, step, copy=False), path, metadata=metadata)


def _index_key(index: Any) -> tuple[tuple[int | None, int | None, int | None], ...]:
    return tuple((s.start, s.stop, s.step) for s in index)


def _default_sharding(x: Any) -> jax.sharding.Sharding:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _similar(name: str, available: list[str]) -> str:
    last = name.rsplit(".", 1)[-1]
    close = [a for a in available if a.rsplit(".", 1)[-1] == last][:5]
    return f"; entries with the same last component: {close}" if close else f"; it holds {len(available)} entries"


def _check_entry(name: str, entry: dict[str, Any], leaf: Any, kind: Kind, where: str) -> None:
    if entry["kind"] != kind.value:
        raise CheckpointError(
            f"leaf {name!r} of checkpoint {where}: the template has a {kind.value} leaf, the checkpoint stores a "
            f"{entry['kind']} leaf"
        )
    if kind is Kind.SCALAR:
        if entry["type"] != type(leaf).__name__:
            raise CheckpointError(
                f"leaf {name!r} of checkpoint {where}: expected a Python {type(leaf).__name__}, found {entry['type']}"
            )
        return
    x = array_of(leaf)
    # a key array's data has the key shape plus trailing implementation dimensions
    found = entry["shape"][: len(x.shape)] if kind is Kind.KEY else entry["shape"]
    if list(x.shape) != found:
        raise CheckpointError(
            f"shape mismatch for leaf {name!r} of checkpoint {where}: expected {tuple(x.shape)} (from the template), "
            f"found {tuple(entry['shape'])}"
        )
    if kind is Kind.ARRAY and np.dtype(x.dtype).name != entry["dtype"]:
        raise CheckpointError(
            f"dtype mismatch for leaf {name!r} of checkpoint {where}: expected {np.dtype(x.dtype).name} (from the "
            f"template), found {entry['dtype']}"
        )
    names = axis_names(leaf)
    if names is not None and entry["axes"] is not None and names != entry["axes"]:
        raise CheckpointError(
            f"axis mismatch for leaf {name!r} of checkpoint {where}: expected axes {names} (from the template), "
            f"found {entry['axes']}"
        )


class _PieceReader:
    """Reads any block of a stored array, gathering it from the stores of the processes that wrote it."""

    def __init__(self, where: str, meta: Mapping[str, Any], ctx: ts.Context) -> None:
        self.where = where
        self.ctx = ctx
        self.num_processes: int | None = meta.get("num_processes")
        nonce = meta.get("nonce") if int(meta.get("format_version", 1)) >= 3 else None
        self.pieces: dict[str, list[tuple[int, Box]]] = {}
        for process in range(self.num_processes or 0):
            raw = loc.read_bytes(where, _pieces_file(process))
            if raw is None:
                raise CheckpointCorruptError(
                    f"checkpoint {where} is damaged: {_pieces_file(process)} (the list of arrays process {process} "
                    "wrote) is missing"
                )
            found = _nonce_of(raw) if nonce is not None else None  # the bytes just read, not a second read
            if found != nonce:
                raise CheckpointCorruptError(
                    f"checkpoint {where} is damaged: {_pieces_file(process)} was written by another save than "
                    f"metadata.json (nonce {found!r}, expected {nonce!r}): two processes wrote this checkpoint"
                )
            try:
                listing = json.loads(raw)
                if nonce is not None:
                    listing = listing["pieces"]
                for name, boxes in listing.items():
                    self.pieces.setdefault(name, []).extend((process, [list(d) for d in b]) for b in boxes)
            except (ValueError, TypeError, AttributeError, KeyError) as exc:
                raise CheckpointCorruptError(
                    f"checkpoint {where} is damaged: {_pieces_file(process)} does not parse ({exc})"
                ) from None
        self._opening: dict[tuple[int | None, str], Any] = {}

    def open(self, name: str) -> None:
        """Start opening every store that holds a block of ``name``."""
        if self.num_processes is None:  # format 1: one shared store
            self._start(None, name)
        for process, _ in self.pieces.get(name, []):
            self._start(process, name)

    def _start(self, process: int | None, name: str) -> None:
        if (process, name) not in self._opening:
            root = self.where if process is None else _process_dir(self.where, process)
            self._opening[(process, name)] = ts.open(_array_spec(root, name), open=True, context=self.ctx)

    def _store(self, process: int | None, name: str) -> Any:
        return self._wait(self._opening[(process, name)])

    def _wait(self, future: Any) -> Any:
        """``future.result()``; TensorStore's failure (a missing, truncated or damaged file, a checksum mismatch)
        raised as :class:`CheckpointCorruptError` naming the checkpoint."""
        try:
            return future.result()
        except ValueError as exc:
            raise CheckpointCorruptError(f"checkpoint {self.where} is damaged: {_first_line(exc)}") from exc

    def read(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> Callable[[], np.ndarray]:
        """Start reading block ``index`` of array ``name``; returns a function that waits for it.

        Raises:
            CheckpointError: if the stored blocks do not cover the requested one.
        """
        if self.num_processes is None:
            future = self._store(None, name)[index].read()
            return lambda: self._wait(future)
        region = _box(index, shape)
        parts = []
        for process, box in self.pieces.get(name, []):
            inter = [[max(a0, b0), min(a1, b1)] for (a0, a1), (b0, b1) in zip(region, box, strict=True)]
            if all(lo < hi for lo, hi in inter) or not inter:
                parts.append((process, inter))
        covered = sum(int(np.prod([hi - lo for lo, hi in inter])) for _, inter in parts)
        wanted = int(np.prod([hi - lo for lo, hi in region]))
        if covered != wanted:
            raise CheckpointError(
                f"checkpoint {self.where}: the stored blocks of {name!r} cover {covered} of the {wanted} elements "
                f"of block {region}; a writing process's blocks are missing"
            )
        if len(parts) == 1:
            single = self._store(parts[0][0], name)[index].read()
            return lambda: self._wait(single)
        futures = [
            (self._store(process, name)[tuple(slice(lo, hi) for lo, hi in inter)].read(), inter)
            for process, inter in parts
        ]

        def assemble() -> np.ndarray:
            first = self._wait(futures[0][0])
            out = np.empty([hi - lo for lo, hi in region], dtype=first.dtype)
            for future, inter in futures:
                dest = tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(inter, region, strict=True))
                out[dest] = self._wait(future)
            return out

        return assemble


def load_checkpoint(
    tree_template: Any,
    path: PathLike,
    *,
    subpath: str | None = None,
    shardings: ShardingSpec | None = None,
) -> Any:
    """Load a checkpoint into the structure of ``tree_template``, each array read directly into its sharding.

    Args:
        tree_template: a tree with the structure, shapes, dtypes and named axes to load; leaves may be
            abstract (``eqx.filter_eval_shape`` / ``jax.ShapeDtypeStruct``). NumPy leaves load as NumPy
            arrays, others as jax arrays; leaves that are not stored (functions, ...) are kept as is.
        path: a committed checkpoint directory, or a run directory / base path, whose latest committed
            checkpoint is then loaded.
        subpath: load only the sub-tree saved under this dotted path (e.g. ``"model"``); the template is
            then that sub-tree.
        shardings: where to place arrays: a single ``Sharding`` for all, a pytree of shardings with the
            template's structure (NamedArray positions hold a sharding, None means the default), or a
            function from a template leaf to a sharding (or None). The default is the template leaf's own
            sharding if it has one, else the first device. The sharding need not match the one saved.

    Returns:
        A tree with the template's structure holding the checkpoint's values.

    Raises:
        FileNotFoundError: if ``path`` holds no committed checkpoint.
        CheckpointError: if a template leaf is missing from the checkpoint, or its kind, shape, dtype or axes
            differ; the message names the leaf path, what was expected and what was found.
        CheckpointCorruptError: (a :class:`CheckpointError`) if the checkpoint is damaged: ``metadata.json`` or
            a piece list does not parse, or an array file is missing, truncated or fails its checksum; the
            message names the checkpoint directory.
    """
    where = resolve_checkpoint(path)
    meta = read_metadata(where)
    if meta is None:  # deleted since it was found
        raise FileNotFoundError(f"checkpoint {where} was deleted while it was being loaded")
    try:
        return _load(tree_template, where, meta, subpath, shardings)
    except CheckpointError:
        raise
    except (KeyError, TypeError) as exc:  # metadata.json's leaf table lacks an entry's fields or has wrong types
        raise CheckpointCorruptError(f"checkpoint {where} is damaged: metadata.json: {exc!r}") from exc


def _load(
    tree_template: Any, where: str, meta: dict[str, Any], subpath: str | None, shardings: ShardingSpec | None
) -> Any:
    stored: dict[str, dict[str, Any]] = meta["leaves"]
    leaves, treedef = flatten(tree_template)
    targets = map_shardings(shardings, treedef, leaves)
    prefix = f"{subpath}." if subpath else ""
    ctx = loc.context()

    stores = _PieceReader(where, meta, ctx)
    plan: list[tuple[Any, Kind, Any, str, Any]] = []  # leaf, kind, entry, full name, sharding
    for (name, leaf), sharding in zip(leaves, targets, strict=True):
        kind = kind_of(leaf)
        full = subpath if (name == "<root>" and subpath) else prefix + name
        if kind is Kind.TEMPLATE:
            plan.append((leaf, kind, None, full, None))
            continue
        entry = stored.get(full)
        if entry is None:
            raise CheckpointError(f"leaf {full!r} is missing from checkpoint {where}" + _similar(full, sorted(stored)))
        _check_entry(full, entry, leaf, kind, where)
        if kind is not Kind.SCALAR:
            stores.open(full)
        plan.append((leaf, kind, entry, full, sharding))

    # issue every read before waiting for any of them
    reads: list[Any] = []
    for leaf, kind, entry, full, sharding in plan:
        if kind in (Kind.SCALAR, Kind.TEMPLATE):
            reads.append(None)
            continue
        x = array_of(leaf)
        shape = tuple(entry["shape"])
        if kind is Kind.KEY or isinstance(x, (np.ndarray, np.generic)):
            reads.append(stores.read(full, shape, tuple(slice(None) for _ in shape)))
            continue
        target = sharding if sharding is not None else _default_sharding(x)
        by_index: dict[Any, Any] = {}
        per_device = []
        for device, index in target.addressable_devices_indices_map(shape).items():
            key = _index_key(index)
            if key not in by_index:
                by_index[key] = stores.read(full, shape, index or tuple(slice(None) for _ in shape))
            per_device.append((device, key))
        reads.append((target, by_index, per_device))

    out = []
    for (leaf, kind, entry, _full, sharding), read in zip(plan, reads, strict=True):
        if kind is Kind.TEMPLATE:
            out.append(leaf)
        elif kind is Kind.SCALAR:
            out.append(entry["value"])
        elif kind is Kind.KEY:
            key = jax.random.wrap_key_data(jnp.asarray(read()), impl=entry["impl"])
            target = sharding if sharding is not None else getattr(array_of(leaf), "sharding", None)
            out.append(rewrap(leaf, jax.device_put(key, target) if target is not None else key))
        elif isinstance(array_of(leaf), (np.ndarray, np.generic)):
            value = read()
            out.append(rewrap(leaf, value if isinstance(array_of(leaf), np.ndarray) else value[()]))
        else:
            target, by_index, per_device = read
            host = {key: finish() for key, finish in by_index.items()}
            arrays = [jax.device_put(host[key], device) for device, key in per_device]
            shape = tuple(array_of(leaf).shape)
            out.append(rewrap(leaf, jax.make_array_from_single_device_arrays(shape, target, arrays)))
    return jax.tree_util.tree_unflatten(treedef, out)
