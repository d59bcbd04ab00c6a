"""Cross-process agreement for checkpoint writes, through the coordination service's key-value store.

A multi-process save has three meeting points (target cleared, every process's shards written, metadata
committed). They run on the :class:`~ponente.trainer.checkpoint.Checkpointer`'s background thread while the
main thread keeps running training steps. A device collective there (``sync_global_devices``) could be
enqueued before a training step's collectives on one process and after them on another, and the processes
would then wait for each other forever. So the meeting points use ``jax.distributed``'s coordination
service instead: a barrier with a unique name only matches barriers of the same name, whatever any other
thread does, and needs no device.

Each meeting point also carries every process's outcome: a process whose part failed still arrives, with
its error stored under the meeting's key, and then every process raises :class:`CheckpointWriteError`
naming the failed processes, instead of the others waiting for a process that will never come.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from typing import Any

import jax

logger = logging.getLogger(__name__)

BARRIER_TIMEOUT_SECONDS = 6 * 3600
"""How long a process waits for the others at a checkpoint meeting point (a slow store may take long)."""

_OK = "ok"

_sequence = itertools.count()
_sequence_lock = threading.Lock()


class CheckpointWriteError(RuntimeError):
    """A multi-process checkpoint save failed on at least one process (the message names which and why)."""


def next_save_id() -> int:
    """A number for the next save, the same on every process when the processes save in the same order.

    Called on the thread that starts a save (the training loop's), so the n-th save of every process gets
    the same number even when writes overlap in the background; it keeps barrier names unique even when
    the same step is saved twice.
    """
    with _sequence_lock:
        return next(_sequence)


def save_nonce(meeting: str) -> str:
    """A random token naming one save, the same on every process: process 0 draws it and publishes it through the
    coordination service under ``meeting``; the others wait for it there.

    Each process writes it into its piece list and process 0 into ``metadata.json``, so a checkpoint whose files
    come from two writers (two jobs saving under one run id) is detected at commit and at load.
    """
    import uuid

    if jax.process_count() == 1:
        return uuid.uuid4().hex
    client: Any = _client()
    key = f"{meeting}/nonce"
    if jax.process_index() == 0:
        client.key_value_set(key, uuid.uuid4().hex)
    return str(client.blocking_key_value_get(key, BARRIER_TIMEOUT_SECONDS * 1000))


def _client() -> Any:
    from jax._src import distributed as _jax_distributed  # the coordination client: no public accessor

    client = _jax_distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"{jax.process_count()} JAX processes but jax.distributed has no coordination client; "
            "initialize the run with jax.distributed.initialize (trainer.distributed)"
        )
    return client


def agree(name: str, *, token: str = "", error: BaseException | None = None) -> None:
    """Meet every other process at ``name``; raise if any process reports a failure or another ``token``.

    A no-op with one process (the caller raises its own error there).

    Args:
        name: the meeting point's name, unique for the run (e.g. ``ponente-checkpoint/3/written``).
        token: what every process must agree on (e.g. the checkpoint's path and step); a process that
            arrives with another token is reported as an error instead of silently matching.
        error: this process's failure in the work before the meeting, or None.

    Raises:
        CheckpointWriteError: if any process reported a failure or a different token; the message names the
            processes, what they reported and the meeting point (chained to ``error`` when it is this process's).
        RuntimeError: if the meeting times out or a process died (the coordination service's heartbeat).
    """
    if jax.process_count() == 1:
        return
    client: Any = _client()
    me = jax.process_index()
    outcome = {"token": token, "error": None if error is None else f"{type(error).__name__}: {error}"}
    client.key_value_set(f"{name}/outcome/{me}", json.dumps(outcome))
    try:
        client.wait_at_barrier(name, BARRIER_TIMEOUT_SECONDS * 1000)
    except Exception as e:
        raise RuntimeError(f"process {me}: checkpoint barrier {name!r} failed (did a process die?): {e}") from e
    problems = []
    for key, value in sorted(client.key_value_dir_get(f"{name}/outcome/")):
        process, theirs = key.rsplit("/", 1)[-1], json.loads(value)
        if theirs["error"] is not None:
            problems.append(f"process {process} failed: {theirs['error']}")
        elif theirs["token"] != token:
            problems.append(f"process {process} saves {theirs['token']!r} but process {me} saves {token!r}")
    if problems:
        raise CheckpointWriteError(f"checkpoint save ({name}): " + "; ".join(problems)) from error
