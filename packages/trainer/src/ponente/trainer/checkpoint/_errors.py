"""The checkpoint module's errors: a checkpoint that does not fit the request, a damaged one, a full disk."""

from __future__ import annotations

import errno


class CheckpointError(ValueError):
    """A checkpoint does not match what the caller asked to load (missing leaf, shape, dtype, axes, kind)."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint cannot be read: its ``metadata.json`` does not parse, a file is missing or truncated,
    or a chunk's checksum does not match. The message names the checkpoint directory and what is wrong.

    A resume skips such a checkpoint for the previous one (``trainer.checkpointer.on_corrupt: fallback``) or
    refuses to start (``error``).
    """


class CheckpointDiskFullError(OSError):
    """The disk (or quota) filled up while a checkpoint was written: ``disk full while writing checkpoint <path>``.

    The checkpoint is not committed (it has no ``metadata.json``), so it is never loaded; the previous checkpoint
    is intact.
    """

    def __init__(self, path: str, detail: str = "") -> None:
        message = f"disk full while writing checkpoint {path}"
        super().__init__(errno.ENOSPC, message + (f" ({detail})" if detail else ""))
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (an ``OSError``, or a TensorStore error with the operating system's text) is ENOSPC/EDQUOT."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return isinstance(exc, (ValueError, RuntimeError, OSError)) and (
        "No space left on device" in text or "Disk quota exceeded" in text or "ENOSPC" in text
    )
