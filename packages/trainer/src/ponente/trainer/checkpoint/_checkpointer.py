"""Saving during training: when to save (policies), saving in the background, and what to keep."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax

from . import _location as loc
from ._discovery import cleanup_uncommitted, discover_checkpoints, latest_checkpoint_path
from ._io import snapshot, write_snapshot
from ._location import PathLike
from ._marker import delete_checkpoint
from ._sync import CheckpointWriteError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointInterval:
    """Keep a permanent checkpoint every ``every`` steps, up to step ``until`` (inclusive; None: forever).

    Raises:
        ValueError: if ``every`` < 1 or ``until`` < 0.
    """

    every: int
    until: int | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpointer.keep: `every` must be >= 1, got {self.every}")
        if self.until is not None and self.until < 0:
            raise ValueError(f"checkpointer.keep: `until` must be >= 0 or null, got {self.until}")


def _default_keep() -> list[CheckpointInterval]:
    return [CheckpointInterval(every=10000)]


@dataclasses.dataclass(frozen=True)
class CheckpointerConfig:
    """Where and when to save checkpoints during training (Levanter's ``trainer.checkpointer`` keys).

    Attributes:
        base_path: directory (local, ``memory://``, ``gs://``, ``s3://``) holding the runs' checkpoints.
        save_interval: save a *temporary* checkpoint when this much time has passed since the last save;
            the previous temporary one is deleted once the next checkpoint commits.
        keep: *permanent* checkpoints: at steps that are multiples of ``every``, using the first interval
            whose ``until`` is null or >= the step. Intervals with ``until`` come first, in increasing order.
        append_run_id_to_base_path: save under ``<base_path>/<run_id>/`` rather than ``<base_path>/``.
        on_corrupt: what a resume does when the latest committed checkpoint is damaged (unparseable
            ``metadata.json``, a missing or truncated file, a checksum mismatch). ``"fallback"``: log which
            checkpoint is skipped and why, and resume from the newest one that reads; ``"error"``: refuse to
            start, naming the damaged checkpoint.
        lease_seconds: the writer lease a training run holds on its checkpoint folder (one writer per run id):
            how long the lease of a run that died on another host blocks a restart; a second live run on the
            same id waits this long, then stops naming the holder. 0: no lease.

    Raises:
        ValueError: if ``keep`` is not ordered as described, or ``on_corrupt`` is not one of its values.

    Example:
        >>> cfg = CheckpointerConfig(keep=[CheckpointInterval(every=100, until=1000), CheckpointInterval(every=1000)])
        >>> cfg.is_permanent_step(100), cfg.is_permanent_step(1100), cfg.is_permanent_step(2000)
        (True, False, True)
    """

    base_path: str = "checkpoints/"
    save_interval: datetime.timedelta = datetime.timedelta(minutes=15)
    keep: list[CheckpointInterval] = dataclasses.field(default_factory=_default_keep)
    append_run_id_to_base_path: bool = True
    on_corrupt: Literal["fallback", "error"] = "fallback"
    lease_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.on_corrupt not in ("fallback", "error"):
            raise ValueError(f"checkpointer.on_corrupt must be 'fallback' or 'error', got {self.on_corrupt!r}")
        bounded = [k.until for k in self.keep if k.until is not None]
        for i, interval in enumerate(self.keep):
            if interval.until is None and i != len(self.keep) - 1:
                raise ValueError(
                    f"checkpointer.keep[{i}] has no `until` but is not the last interval; only the last may be open"
                )
        if bounded != sorted(bounded):
            raise ValueError(f"checkpointer.keep: the `until` values must increase, got {bounded}")
        if self.save_interval.total_seconds() <= 0:
            raise ValueError(f"checkpointer.save_interval must be positive, got {self.save_interval}")
        if self.lease_seconds < 0:
            raise ValueError(f"checkpointer.lease_seconds must be >= 0 (0: no lease), got {self.lease_seconds}")

    def is_permanent_step(self, step: int) -> bool:
        """Whether the ``keep`` policy asks for a permanent checkpoint at ``step`` (never at step 0)."""
        return _is_permanent_step(self.keep, step)

    def expanded_path(self, run_id: str | None) -> str:
        """The directory a run's checkpoints go to."""
        if self.append_run_id_to_base_path and run_id:
            return loc.join(loc.normalize(self.base_path), run_id)
        return loc.normalize(self.base_path)

    def create(
        self,
        run_id: str | None,
        *,
        metadata: Mapping[str, Any] | None = None,
        time_fn: Callable[[], float] = time.monotonic,
    ) -> Checkpointer:
        """The :class:`Checkpointer` for one run.

        Args:
            run_id: the run's id (appended to ``base_path`` if ``append_run_id_to_base_path``).
            metadata: JSON-serializable provenance stored in every checkpoint (e.g. the resolved config).
            time_fn: the clock, in seconds (tests inject a fake one).
        """
        return Checkpointer(
            self.expanded_path(run_id),
            save_interval=self.save_interval,
            keep=self.keep,
            metadata=metadata,
            time_fn=time_fn,
        )


def _is_permanent_step(keep: Sequence[CheckpointInterval], step: int) -> bool:
    if step <= 0:
        return False
    for interval in keep:
        if interval.until is None or step <= interval.until:
            return step % interval.every == 0
    return False


def _agree(*flags: bool) -> tuple[bool, ...]:
    """Process 0's flags, on every process (clocks and background threads differ between hosts).

    A device collective: call it only from the thread that runs the training steps, in the same order on
    every process.
    """
    if jax.process_count() == 1:
        return flags
    import numpy as np
    from jax.experimental import multihost_utils

    agreed = multihost_utils.broadcast_one_to_all(np.asarray(flags, dtype=np.int32))
    return tuple(bool(x) for x in np.asarray(agreed))


class Checkpointer:
    """Saves a run's checkpoints in the background, following time- and step-based policies.

    Checkpoints go to ``<run_path>/step-<N>/``. :meth:`on_step` saves a *permanent* checkpoint at the
    steps of the ``keep`` policy and a *temporary* one when ``save_interval`` has passed since the last
    save; a temporary checkpoint is deleted once a newer checkpoint commits (also across restarts: the
    flag is recorded in ``metadata.json``). One save is in flight at a time; an error in the background
    surfaces on the next call of :meth:`save`, :meth:`on_step` or :meth:`wait_until_finished`.

    With several JAX processes every process owns a ``Checkpointer`` for the same run and calls it with
    the same steps. Each one copies its shards on the calling thread and writes them in the background;
    the processes meet through the coordination service (not a device collective, so the background
    thread never competes with the training step's collectives), and process 0 writes the commit marker
    only after every process wrote its shards. A failure on one process raises on all of them.

    Args:
        run_path: the run's checkpoint directory.
        save_interval: time between temporary checkpoints.
        keep: the permanent-checkpoint policy.
        metadata: JSON-serializable provenance stored in every checkpoint.
        time_fn: the clock, in seconds.

    Example:
        >>> import datetime, tempfile, jax.numpy as jnp
        >>> ckpt = Checkpointer(
        ...     tempfile.mkdtemp(), save_interval=datetime.timedelta(hours=1), keep=[CheckpointInterval(every=2)]
        ... )
        >>> saved = tuple(ckpt.on_step({"w": jnp.full(3, s)}, s) for s in range(4))
        >>> saved
        (False, False, True, False)
        >>> ckpt.wait_until_finished()
        >>> ckpt.latest_checkpoint_path().endswith("step-2")
        True
    """

    def __init__(
        self,
        run_path: PathLike,
        *,
        save_interval: datetime.timedelta,
        keep: Sequence[CheckpointInterval],
        metadata: Mapping[str, Any] | None = None,
        time_fn: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_path = loc.normalize(run_path)
        self.save_interval = save_interval
        self.keep = list(keep)
        self._metadata = dict(metadata or {})
        self._time_fn = time_fn
        self._last_save_time = time_fn()
        existing = [c for c in discover_checkpoints(self.run_path) if c.committed]
        self._temporaries = [c.path for c in existing if c.temporary]
        self._last_saved_step: int | None = existing[-1].step if existing else None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ponente-checkpoint")
        self._future: concurrent.futures.Future[None] | None = None
        self.guard: Callable[[], None] | None = None
        """Called (process 0) just before each commit; raises to refuse it (a run sets its writer lease's check)."""

    def loaded(self, step: int) -> None:
        """Record that the run's state was loaded from this run's checkpoint of ``step``.

        A save at ``step`` is then skipped (that checkpoint exists), and any other step saves as usual, including
        the step of a newer, damaged checkpoint that the resume skipped (the save replaces it).
        """
        self._last_saved_step = step

    def checkpoint_path(self, step: int) -> str:
        """Where the checkpoint of ``step`` goes."""
        return loc.join(self.run_path, f"step-{step}")

    def latest_checkpoint_path(self) -> str | None:
        """The run's committed checkpoint with the highest step (waits for nothing)."""
        return latest_checkpoint_path(self.run_path)

    def on_step(self, tree: Any, step: int, *, force: bool = False) -> bool:
        """Save ``tree`` if the policies (or ``force``) ask for it at ``step``; returns whether it saves.

        A step already saved (or loaded at startup) is not saved again. ``force`` saves a permanent
        checkpoint (end of training, preemption). With several processes, every process must call this at
        every step: process 0's clock decides a time-based save for all, and a failed background save
        raises on every process at the same step.

        Raises:
            Exception: the error of a failed background save (with several processes, when process 0
                learned of it: a :class:`CheckpointWriteError` on the processes whose own part succeeded).
        """
        permanent = force or _is_permanent_step(self.keep, step)
        elapsed = self._time_fn() - self._last_save_time
        temporary = not permanent and step > 0 and elapsed >= self.save_interval.total_seconds()
        failed, permanent, temporary = _agree(self._background_failed(), permanent, temporary)
        if failed:
            self._raise_failure()
        if step == self._last_saved_step or not (permanent or temporary):
            return False
        self.save(tree, step, temporary=not permanent)
        return True

    def _background_failed(self) -> bool:
        future = self._future
        return future is not None and future.done() and future.exception() is not None

    def _raise_failure(self) -> None:
        """Raise the background save's error (process 0 saw one; with several processes, so will this one)."""
        self.wait_until_finished()
        # this process's part succeeded: the failure was process 0's own (e.g. deleting an old temporary)
        raise CheckpointWriteError(
            f"process 0's background checkpoint save failed (process {jax.process_index()}'s part succeeded); "
            "see process 0's log"
        )

    def save(self, tree: Any, step: int, *, temporary: bool = False) -> None:
        """Start saving ``tree`` as the checkpoint of ``step``; returns once the state is copied.

        Waits for the previous save first. The caller may mutate or donate ``tree`` as soon as this
        returns.

        Raises:
            Exception: the error of a previous background save, if it failed.
        """
        self.wait_until_finished()
        snap = snapshot(tree, step)
        self._last_save_time = self._time_fn()
        self._last_saved_step = step
        self._future = self._executor.submit(self._write_and_retain, snap, temporary)

    def _write_and_retain(self, snap: Any, temporary: bool) -> None:
        path = write_snapshot(
            snap, self.checkpoint_path(snap.step), metadata=self._metadata, temporary=temporary, guard=self.guard
        )
        if jax.process_index() == 0:
            for old in self._temporaries:
                if old != path:
                    logger.info("deleting temporary checkpoint %s (superseded by %s)", old, path)
                    delete_checkpoint(old)
            cleanup_uncommitted(self.run_path)
        self._temporaries = [path] if temporary else []

    def wait_until_finished(self) -> None:
        """Block until the save in flight (if any) has committed.

        Raises:
            Exception: the background save's error, if it failed.
        """
        if self._future is not None:
            future, self._future = self._future, None
            future.result()

    def close(self) -> None:
        """Wait for the save in flight and stop the background thread."""
        try:
            self.wait_until_finished()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
