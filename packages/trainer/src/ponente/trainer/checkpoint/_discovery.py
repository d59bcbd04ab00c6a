"""Finding the committed checkpoints below a run directory or base path, and cleaning up the incomplete ones."""

from __future__ import annotations

import dataclasses
import logging
import re

from . import _location as loc
from ._errors import CheckpointCorruptError
from ._location import PathLike
from ._marker import METADATA_FILE, delete_checkpoint, read_metadata

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step-(\d+)")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory found below a run directory.

    Attributes:
        path: the checkpoint directory.
        step: the step in its name (``step-<N>``).
        committed: whether its ``metadata.json`` exists.
        temporary: whether a :class:`Checkpointer` saved it as temporary (False if uncommitted).
        timestamp: the commit time (ISO 8601), empty if uncommitted.
        damage: why a committed checkpoint's ``metadata.json`` is unreadable (empty: it reads); such a checkpoint
            still counts as committed, and loading it raises :class:`CheckpointCorruptError`.
    """

    path: str
    step: int
    committed: bool
    temporary: bool = False
    timestamp: str = ""
    damage: str = ""


def discover_checkpoints(path: PathLike) -> list[CheckpointInfo]:
    """All ``step-<N>`` directories directly below ``path`` or one level deeper (``<run_id>/step-<N>``).

    Args:
        path: a run directory or a base path holding run directories.

    Returns:
        The checkpoints, committed or not, sorted by (step, timestamp).
    """
    root = loc.normalize(path)
    dirs: dict[str, bool] = {}
    for key in loc.list_keys(root):
        parts = key.split("/")
        for depth in (0, 1):
            if len(parts) > depth + 1 and _STEP_DIR.fullmatch(parts[depth]):
                rel = "/".join(parts[: depth + 1])
                committed = len(parts) == depth + 2 and parts[-1] == METADATA_FILE
                dirs[rel] = dirs.get(rel, False) or committed
                break
    found = []
    for rel, committed in dirs.items():
        step = int(_STEP_DIR.fullmatch(rel.rsplit("/", 1)[-1]).group(1))  # type: ignore[union-attr]
        ckpt = loc.join(root, rel)
        try:
            meta = read_metadata(ckpt) if committed else None
        except CheckpointCorruptError as exc:
            found.append(CheckpointInfo(ckpt, step, True, damage=str(exc)))
            continue
        if meta is None:
            found.append(CheckpointInfo(ckpt, step, committed=False))
        else:
            found.append(CheckpointInfo(ckpt, step, True, bool(meta.get("temporary")), str(meta.get("timestamp", ""))))
    return sorted(found, key=lambda c: (c.step, c.timestamp, c.path))


def latest_checkpoint_path(path: PathLike) -> str | None:
    """The committed checkpoint with the highest step at or below ``path``, None if there is none.

    Args:
        path: a checkpoint directory (returned as is if committed), a run directory holding
            ``step-<N>/`` checkpoints, or a base path holding run directories (then the highest step
            of any run wins; pass the run directory to stay within one run).

    Returns:
        The checkpoint's normalized path, or None.
    """
    root = loc.normalize(path)
    if read_metadata(root) is not None:
        return root
    committed = [c for c in discover_checkpoints(root) if c.committed]
    return committed[-1].path if committed else None


def cleanup_uncommitted(run_path: PathLike) -> list[str]:
    """Delete the incomplete (uncommitted) checkpoints older than the latest committed one.

    Newer incomplete ones are left alone: another process may be writing them right now.

    Args:
        run_path: a run directory.

    Returns:
        The deleted directories.
    """
    found = discover_checkpoints(run_path)
    committed = [c.step for c in found if c.committed]
    if not committed:
        return []
    deleted = []
    for c in found:
        if not c.committed and c.step < max(committed):
            logger.info("deleting incomplete checkpoint %s (it has no %s)", c.path, METADATA_FILE)
            delete_checkpoint(c.path)
            deleted.append(c.path)
    return deleted


def resolve_checkpoint(path: PathLike) -> str:
    """``path`` if it is a committed checkpoint, else the latest committed checkpoint below it.

    Raises:
        FileNotFoundError: if there is no committed checkpoint there; the message names the directory.
    """
    target = loc.normalize(path)
    if read_metadata(target) is not None:
        return target
    latest = latest_checkpoint_path(target)
    if latest is None:
        raise FileNotFoundError(
            f"no committed checkpoint at {target}: neither {target}/{METADATA_FILE} nor a committed step-*/ "
            f"directory below it exists (directories without {METADATA_FILE} are incomplete and ignored)"
        )
    logger.info("%s is not a checkpoint itself; loading its latest committed checkpoint %s", target, latest)
    return latest
