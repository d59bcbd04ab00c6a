"""Checkpoints of the full training state: TensorStore zarr3 in a few files, async, atomically committed.

Layout: ``<base_path>/<run_id>/step-<N>/`` holds one OCDBT key-value store per writing process
(``process-<i>/``, a handful of large files) with one zarr3 array per array leaf, keyed by the leaf's
dotted tree path (``model.transformer.layers.stacked.mlp.up_proj.weight``), the list of blocks each
process wrote (``process-<i>.json``), and ``metadata.json`` (step, timestamp, number of processes,
leaves with dtypes, shapes and named axes, versions, user metadata such as the resolved config),
written last as the commit marker. Directories without it are ignored and cleaned up.

- :func:`save_checkpoint` / :func:`load_checkpoint`: one checkpoint, synchronously; loading reads each
  array straight into the requested sharding (any mesh), optionally only a sub-tree (``subpath``).
- :class:`Checkpointer` (built by :class:`CheckpointerConfig`): background saves during training with
  time-based temporary and step-based permanent policies.
- :func:`latest_checkpoint_path`, :func:`discover_checkpoints`, :func:`cleanup_uncommitted`.

With several JAX processes every process writes its own shards; the processes meet through the
coordination service of ``jax.distributed`` (never a device collective, so background saves cannot
deadlock with training steps), process 0 commits only after all of them wrote, and a failure on one
process raises :class:`CheckpointWriteError` on all of them.

Faults: a damaged committed checkpoint (unparseable ``metadata.json``, a missing or truncated file, a chunk
whose crc32c checksum does not match) raises :class:`CheckpointCorruptError` naming it, and a resume falls back
to the previous checkpoint (``on_corrupt``); a full disk during a save raises :class:`CheckpointDiskFullError`
(``disk full while writing checkpoint <path>``) and leaves the partial directory uncommitted.
"""

from ._checkpointer import Checkpointer, CheckpointerConfig, CheckpointInterval
from ._discovery import CheckpointInfo, cleanup_uncommitted, discover_checkpoints, latest_checkpoint_path
from ._errors import CheckpointCorruptError, CheckpointDiskFullError, CheckpointError
from ._io import load_checkpoint, save_checkpoint, sync_processes
from ._lease import WRITER_LEASE_KEY, CheckpointLeaseError, acquire_writer_lease
from ._marker import METADATA_FILE, delete_checkpoint, read_metadata
from ._sync import CheckpointWriteError

__all__ = [
    "METADATA_FILE",
    "WRITER_LEASE_KEY",
    "CheckpointCorruptError",
    "CheckpointDiskFullError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointInterval",
    "CheckpointLeaseError",
    "CheckpointWriteError",
    "Checkpointer",
    "CheckpointerConfig",
    "acquire_writer_lease",
    "cleanup_uncommitted",
    "delete_checkpoint",
    "discover_checkpoints",
    "latest_checkpoint_path",
    "load_checkpoint",
    "read_metadata",
    "save_checkpoint",
    "sync_processes",
]
