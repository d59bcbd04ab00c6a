"""One writer per run: the writer lease on a run's checkpoint folder.

Two processes that train under one run id (a requeued job started twice) would otherwise both write
``<base_path>/<run_id>/step-N`` and could commit a checkpoint that mixes both. The run's process 0 holds a lease,
``<run_path>/writer.lease`` (the data cache's builder lease, :class:`ponente.datacache.BuilderLease`, under another
key), while it trains: a second process on the same run id waits for it and, if the holder keeps renewing it, stops
with one line. A holder that died on this host is taken over at once; one on another host after ``lease_seconds``.
Each save also carries a nonce checked at commit and at load (see ``_io.write_snapshot``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import jax

from ponente.datacache import BuilderLease, PonenteUserError

if TYPE_CHECKING:
    from ._location import PathLike

__all__ = ["WRITER_LEASE_KEY", "CheckpointLeaseError", "acquire_writer_lease"]

logger = logging.getLogger(__name__)

WRITER_LEASE_KEY = "writer.lease"
"""The key of the lease object in a run's checkpoint folder."""


class CheckpointLeaseError(PonenteUserError):
    """Another live process writes this run's checkpoints (two runs share one run id); exit status 1."""


def acquire_writer_lease(run_path: PathLike, *, seconds: float, wait: float | None = None) -> BuilderLease | None:
    """Take the writer lease of ``run_path`` on process 0 (None on the other processes, or if ``seconds`` is 0).

    Args:
        run_path: the run's checkpoint folder.
        seconds: the lease's duration (``trainer.checkpointer.lease_seconds``): how long a holder that died on
            another host blocks a restart.
        wait: how long to wait for a live holder (default: ``seconds`` plus a heartbeat, the time a dead holder's
            lease takes to expire).

    Returns:
        The held lease (release it when the run ends), or None.

    Raises:
        CheckpointLeaseError: naming the folder and the holder, if another process keeps the lease for ``wait``.
    """
    if not seconds or jax.process_index() != 0:
        return None
    from . import _location as loc

    where = loc.normalize(run_path)
    lease = BuilderLease(
        where, seconds=seconds, key=WRITER_LEASE_KEY, subject="checkpoint folder", role="writer", take_over_dead=True
    )
    deadline = time.monotonic() + (seconds + lease.heartbeat if wait is None else wait)
    logged = False
    while not lease.try_acquire():
        holder = lease.other.holder if lease.other is not None else "another process"
        if time.monotonic() >= deadline:
            raise CheckpointLeaseError(
                f"trainer.checkpointer: {where} is being written by another process ({holder}), which keeps "
                f"renewing its writer lease: two runs share this run id; stop the other run, or give this one "
                "another trainer.id"
            )
        if not logged:
            logger.warning("%s: waiting for the writer lease held by %s (a run with the same id?)", where, holder)
            logged = True
        time.sleep(min(1.0, lease.heartbeat))
    return lease
