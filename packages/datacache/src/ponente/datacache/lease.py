"""The builder lease: at most one process builds (or resumes) a cache at a time.

The lease is one small JSON object next to the ledger, ``LOCATION/builder.lease``, naming its holder
(``host/pid/random``) and when it expires. Every change to it is a conditional write on the storage
generation TensorStore reports for it (a compare-and-swap that the file, memory, ``gcs`` and ``s3`` kvstores
perform atomically, the last with ``If-Match``/``If-None-Match``):

- **acquire**: create it if it does not exist ("must not exist" generation), or replace it if it was
  released or has expired, conditional on the version read, then read it back to confirm;
- **renew**: a heartbeat thread rewrites it every ``heartbeat`` seconds, conditional on the version this
  holder wrote last; a failed renewal means another process took over, and the holder stops building;
- **release**: delete it (a finished cache holds no lease, so its bytes do not depend on who built it).

A lease has expired when its expiry time has passed on the reader's clock, or when a reader has watched it
for a whole lease duration without seeing it renewed (so a reader whose clock runs behind the holder's still
takes over from a dead holder). A holder fences itself: it checks, before writing, that its last successful
renewal started less than ``seconds - heartbeat`` seconds ago, so it stops before a reader can consider its
lease expired.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

import tensorstore as ts

from ponente.datacache.errors import DataCacheError
from ponente.datacache.store import _CONTEXT, kvstore_spec

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "LEASE_KEY",
    "BuilderLease",
    "LeaseLostError",
    "LeaseRecord",
    "holder_is_dead_here",
    "read_lease",
]

logger = logging.getLogger(__name__)

LEASE_KEY = "builder.lease"
"""Key of the lease object in a cache location."""

DEFAULT_LEASE_SECONDS = 60.0
"""Seconds a lease lasts without renewal: how long a dead builder blocks the others at most."""


class LeaseLostError(DataCacheError):
    """This builder lost its lease (it could not renew it in time, or another builder took it over).

    The builder stops without committing anything more; the cache stays resumable and the new holder
    continues it.
    """


@dataclass(frozen=True)
class LeaseRecord:
    """The content of a lease object.

    Attributes:
        holder: Who holds it: ``host/pid/random``.
        acquired: When the holder acquired it (Unix time, holder's clock).
        expires: When it expires unless renewed (Unix time, holder's clock).
        seconds: The lease duration the holder renews it for.
    """

    holder: str
    acquired: float
    expires: float
    seconds: float

    def to_bytes(self) -> bytes:
        """JSON bytes."""
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseRecord | None:
        """Parse a lease object; ``None`` if it is damaged (it is then treated as expired)."""
        try:
            raw = json.loads(data)
            record = cls(str(raw["holder"]), float(raw["acquired"]), float(raw["expires"]), float(raw["seconds"]))
        except (ValueError, TypeError, KeyError):
            return None
        return record if record.seconds > 0 else None


def _open(location: str) -> ts.KvStore:
    spec: dict[str, Any] = dict(kvstore_spec(location))
    if spec.get("driver") == "s3":
        # TensorStore only sends If-Match / If-None-Match to AWS endpoints by default; without them its
        # conditional writes are a HEAD then a PUT, which two builders can interleave.
        spec["use_conditional_write"] = True
    return ts.KvStore.open(spec, context=_CONTEXT).result()


def read_lease(location: str) -> LeaseRecord | None:
    """The lease of the cache at ``location`` as stored now, or ``None`` if there is none (or it is damaged).

    Examples:
        >>> read_lease("/data/cache")  # doctest: +SKIP
        LeaseRecord(holder='host-a/4242/5f0c...', acquired=..., expires=..., seconds=60.0)
    """
    result = _open(str(location)).read(LEASE_KEY).result()
    return LeaseRecord.from_bytes(result.value) if result.state == "value" else None


def holder_is_dead_here(holder: str) -> bool:
    """Whether ``holder`` (``host/pid/random``) names a process of this host, other than this one, that no longer
    runs (a process of another host, or one that cannot be probed, is not known to be dead)."""
    host, _, rest = holder.partition("/")
    pid_text = rest.partition("/")[0]
    if host != socket.gethostname() or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. another user's process: alive
        return False
    return False


def _holder_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:12]}"


class BuilderLease:
    """One process's claim to build the cache at ``location``; see the module docstring.

    Call :meth:`try_acquire` until it returns ``True`` (each call is one attempt: it reads the lease and
    takes it if it is free, released or expired), then build, calling :meth:`check` before every write, and
    :meth:`release` at the end (or use the lease as a context manager once acquired).

    Args:
        location: The cache location (local path, ``memory://``, ``gs://``, ``s3://``).
        seconds: Lease duration: the holder renews it well before; others take it over once it expired.
        heartbeat: Seconds between renewals (default: ``seconds / 4``); must be less than ``seconds / 2``.
        key: The lease object's key in ``location`` (another key makes another lease: e.g. the trainer's
            ``writer.lease`` on a run's checkpoint folder).
        subject: What ``location`` is, in messages (``cache``, ``checkpoint folder``).
        role: What the holder does, in messages (``builder``, ``writer``).
        take_over_dead: Treat a lease whose holder is a process of this host that no longer runs as expired
            (a killed process's lease is then taken over at once instead of after ``seconds``).

    Raises:
        ValueError: If ``seconds`` or ``heartbeat`` is out of range.

    Examples:
        >>> lease = BuilderLease("/data/cache", seconds=30)  # doctest: +SKIP
        >>> if lease.try_acquire():  # doctest: +SKIP
        ...     with lease:
        ...         lease.check()  # raises LeaseLostError once another process took over
    """

    def __init__(
        self,
        location: str,
        *,
        seconds: float = DEFAULT_LEASE_SECONDS,
        heartbeat: float | None = None,
        key: str = LEASE_KEY,
        subject: str = "cache",
        role: str = "builder",
        take_over_dead: bool = False,
    ) -> None:
        if not seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, found {seconds}")
        heartbeat = seconds / 4 if heartbeat is None else heartbeat
        if not 0 < heartbeat < seconds / 2:
            raise ValueError(f"lease heartbeat must be > 0 and < lease_seconds / 2 = {seconds / 2}, found {heartbeat}")
        self.location = str(location)
        self.key, self.subject, self.role = key, subject, role
        self.take_over_dead = take_over_dead
        self.seconds = float(seconds)
        self.heartbeat = float(heartbeat)
        self.holder = _holder_id()
        self.other: LeaseRecord | None = None
        """The other holder's lease as last seen by :meth:`try_acquire` (``None``: none seen)."""
        self._kv = _open(self.location)
        self._lock = threading.Lock()
        self._generation: bytes | None = None  # of the lease we wrote last, while we hold it
        self._acquired = 0.0
        self._renewed = 0.0  # monotonic time at which our last successful write started
        self._lost: str | None = None
        self._seen: tuple[bytes, float] | None = None  # another holder's generation and when we first saw it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Whether this process holds the lease (as far as it knows)."""
        return self._generation is not None

    def _expired(self, record: LeaseRecord | None, generation: bytes) -> bool:
        now = time.monotonic()
        if self._seen is None or self._seen[0] != generation:
            self._seen = (generation, now)
        if record is None:
            return True
        if self.take_over_dead and holder_is_dead_here(record.holder):
            return True
        return time.time() >= record.expires or now - self._seen[1] >= record.seconds

    def try_acquire(self) -> bool:
        """One attempt to acquire the lease; on success the heartbeat thread starts renewing it.

        Returns:
            ``True`` if this process now holds the lease, ``False`` if another holder has a live one (see
            :attr:`other`) or won the race for it.
        """
        if self.held:
            return True
        current = self._kv.read(self.key).result()
        generation = current.stamp.generation
        if current.state == "value":
            record = LeaseRecord.from_bytes(current.value)
            if not self._expired(record, generation):
                self.other = record
                return False
            logger.warning(
                "the %s lease of %s (held by %s) expired without renewal: taking over%s",
                self.role,
                self.location,
                record.holder if record else "an unreadable lease",
                " the build" if self.role == "builder" else "",
            )
        started = time.monotonic()
        now = time.time()
        mine = LeaseRecord(self.holder, now, now + self.seconds, self.seconds)
        written = self._kv.write(self.key, mine.to_bytes(), if_equal=generation).result()
        if not written.generation:
            return False  # another process changed it since we read it
        confirm = self._kv.read(self.key).result()
        if confirm.state != "value" or confirm.stamp.generation != written.generation:
            return False
        with self._lock:
            self._generation = written.generation
            self._acquired = now
            self._renewed = started
            self._lost = None
        self.other = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"{self.role}-lease:{self.location}", daemon=True)
        self._thread.start()
        logger.info("acquired the %s lease of %s as %s", self.role, self.location, self.holder)
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                self._renew()
            except Exception as exc:  # retried at the next beat; check() fails once too long has passed
                logger.warning("could not renew the %s lease of %s: %s", self.role, self.location, exc)
            if self._lost is not None:
                return

    def _renew(self) -> None:
        with self._lock:
            if self._generation is None:
                return
            started = time.monotonic()
            now = time.time()
            mine = LeaseRecord(self.holder, self._acquired, now + self.seconds, self.seconds)
            written = self._kv.write(self.key, mine.to_bytes(), if_equal=self._generation).result()
            if written.generation:
                self._generation = written.generation
                self._renewed = started
                return
            current = self._kv.read(self.key).result()
            record = LeaseRecord.from_bytes(current.value) if current.state == "value" else None
            self._generation = None
            self._lost = (
                f"{self.subject} {self.location}: {self.role} {self.holder} lost its lease to "
                f"{record.holder if record else 'nobody (it was deleted)'}"
                + ("; that builder continues the build" if self.role == "builder" else "")
            )
            logger.error("%s", self._lost)

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless this process surely still holds the lease.

        Raises:
            LeaseLostError: If a renewal found the lease taken over, or the last successful renewal started
                ``seconds - heartbeat`` or more seconds ago (others may consider it expired soon).
        """
        if self._lost is not None:
            raise LeaseLostError(self._lost)
        if self._generation is None:
            raise LeaseLostError(
                f"{self.subject} {self.location}: {self.role} {self.holder} does not hold the {self.role} lease"
            )
        age = time.monotonic() - self._renewed
        if age >= self.seconds - self.heartbeat:
            raise LeaseLostError(
                f"{self.subject} {self.location}: {self.role} {self.holder} could not renew its lease for {age:.1f} s "
                f"(lease_seconds={self.seconds:g}); stopping so that another {self.role} can take over"
            )

    def release(self) -> None:
        """Stop renewing and delete the lease if this process still holds it (a no-op otherwise)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        with self._lock:
            generation, self._generation = self._generation, None
        if generation is None:
            return
        try:
            self._kv.write(self.key, None, if_equal=generation).result()
        except Exception as exc:  # the lease then expires on its own
            logger.warning("could not release the %s lease of %s: %s", self.role, self.location, exc)
        else:
            logger.info("released the %s lease of %s", self.role, self.location)

    def __enter__(self) -> BuilderLease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
