"""The commit marker: a checkpoint directory is a checkpoint exactly when its ``metadata.json`` exists.

Writers write the marker last and deleters delete it first, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import json
from typing import Any

from . import _location as loc
from ._errors import CheckpointCorruptError
from ._location import PathLike

METADATA_FILE = "metadata.json"
"""The commit marker: a checkpoint directory is valid exactly when this file exists."""


def delete_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint directory: its commit marker first, so a crash midway never leaves a broken one."""
    target = loc.normalize(path)
    loc.delete_key(target, METADATA_FILE)
    loc.delete_tree(target)


def read_metadata(path: PathLike) -> dict[str, Any] | None:
    """The parsed ``metadata.json`` of the checkpoint at ``path``, or None if it is not committed.

    Raises:
        CheckpointCorruptError: if ``metadata.json`` exists but is not a JSON object with a ``leaves`` table (a
            damaged or truncated file); the message names the file.
    """
    target = loc.normalize(path)
    raw = loc.read_bytes(target, METADATA_FILE)
    if raw is None:
        return None
    where = loc.join(target, METADATA_FILE)
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointCorruptError(f"checkpoint {target} is damaged: {where} is not valid JSON ({exc})") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("leaves"), dict):
        raise CheckpointCorruptError(f"checkpoint {target} is damaged: {where} has no 'leaves' table")
    return parsed
