"""The builder lease: one holder among racing processes, renewal, expiry and take-over, release, fencing.

Each race starts its contenders behind a barrier and counts the winners; the reference is "exactly one".
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import tensorstore as ts
from s3_support import S3Bucket, s3_bucket_fixture  # noqa: F401  (the s3_bucket fixture)

from ponente.datacache.lease import LEASE_KEY, BuilderLease, LeaseLostError, LeaseRecord, read_lease
from ponente.datacache.store import kvstore_spec


def _race(location: str, contenders: int, **options: float) -> list[BuilderLease]:
    """Let ``contenders`` leases try to acquire ``location`` at the same instant; return the winners."""
    leases = [BuilderLease(location, **options) for _ in range(contenders)]
    barrier = threading.Barrier(contenders)
    won: list[BuilderLease] = []
    errors: list[BaseException] = []

    def attempt(lease: BuilderLease) -> None:
        try:
            barrier.wait()
            if lease.try_acquire():
                won.append(lease)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=attempt, args=(lease,)) for lease in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return won


def _write_record(location: str, record: LeaseRecord | bytes) -> None:
    """Put a lease object in place the way a (now dead) other builder would have left it."""
    kv = ts.KvStore.open(kvstore_spec(location)).result()
    kv.write(LEASE_KEY, record if isinstance(record, bytes) else record.to_bytes()).result()


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_exactly_one_of_racing_builders_acquires(tmp_path: Path, scheme: str) -> None:
    for attempt in range(5):
        location = str(tmp_path / f"c{attempt}") if scheme == "file" else f"memory://lease-race-{attempt}"
        won = _race(location, 8, seconds=5.0)
        try:
            assert len(won) == 1
            stored = read_lease(location)
            assert stored is not None
            assert stored.holder == won[0].holder
        finally:
            for lease in won:
                lease.release()
        assert read_lease(location) is None  # released: deleted


def test_a_live_lease_is_renewed_and_never_taken(tmp_path: Path) -> None:
    location = str(tmp_path / "cache")
    holder = BuilderLease(location, seconds=1.0, heartbeat=0.1)
    assert holder.try_acquire()
    first = read_lease(location)
    other = BuilderLease(location, seconds=1.0, heartbeat=0.1)
    try:
        deadline = time.monotonic() + 2.5  # 2.5 lease durations
        while time.monotonic() < deadline:
            assert not other.try_acquire()
            holder.check()
            time.sleep(0.05)
        assert other.other is not None
        assert other.other.holder == holder.holder
        renewed = read_lease(location)
        assert first is not None
        assert renewed is not None
        assert renewed.holder == holder.holder
        assert renewed.expires > first.expires + 1.5
    finally:
        holder.release()
    assert other.try_acquire()  # released: free at once
    other.release()


def test_a_dead_holders_lease_is_taken_over_once_expired(tmp_path: Path) -> None:
    location = str(tmp_path / "cache")
    now = time.time()
    _write_record(location, LeaseRecord("dead-host/1/x", now - 10, now + 0.8, 1.0))
    lease = BuilderLease(location, seconds=1.0, heartbeat=0.1)
    assert not lease.try_acquire()  # not yet expired
    assert lease.other is not None
    assert lease.other.holder == "dead-host/1/x"
    time.sleep(0.9)
    assert lease.try_acquire()
    stored = read_lease(location)
    assert stored is not None
    assert stored.holder == lease.holder
    lease.release()


def test_a_lease_stamped_by_a_clock_ahead_is_taken_after_a_duration_without_renewal(tmp_path: Path) -> None:
    # The dead holder's clock ran an hour ahead: its expiry time is useless here, but nobody renews it.
    location = str(tmp_path / "cache")
    now = time.time()
    _write_record(location, LeaseRecord("fast-clock/1/x", now, now + 3600, 1.0))
    lease = BuilderLease(location, seconds=1.0, heartbeat=0.1)
    started = time.monotonic()
    while not lease.try_acquire():
        assert time.monotonic() - started < 5
        time.sleep(0.05)
    assert time.monotonic() - started >= 1.0
    lease.release()


def test_a_damaged_lease_is_taken_over(tmp_path: Path) -> None:
    location = str(tmp_path / "cache")
    _write_record(location, b"{not json")
    lease = BuilderLease(location, seconds=1.0, heartbeat=0.1)
    assert lease.try_acquire()
    lease.release()


def test_a_holder_that_stops_renewing_is_fenced_and_cannot_delete_the_new_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    location = str(tmp_path / "cache")
    frozen = threading.Event()
    stale = BuilderLease(location, seconds=1.0, heartbeat=0.1)
    original = stale._renew

    def renew() -> None:  # a process stopped (SIGSTOP, a long GC pause...): no renewal while frozen
        if not frozen.is_set():
            original()

    monkeypatch.setattr(stale, "_renew", renew)
    assert stale.try_acquire()
    frozen.set()
    time.sleep(0.95)
    with pytest.raises(LeaseLostError, match="could not renew"):
        stale.check()  # it stops writing before the others may consider the lease expired
    taker = BuilderLease(location, seconds=1.0, heartbeat=0.1)
    started = time.monotonic()
    while not taker.try_acquire():
        assert time.monotonic() - started < 5
        time.sleep(0.05)
    frozen.clear()  # the stale holder wakes up: its next renewal finds the lease taken
    deadline = time.monotonic() + 2
    while stale.held and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(LeaseLostError, match=taker.holder):
        stale.check()
    stale.release()  # must not delete the new holder's lease
    stored = read_lease(location)
    assert stored is not None
    assert stored.holder == taker.holder
    taker.check()
    taker.release()


def test_lease_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lease_seconds"):
        BuilderLease(str(tmp_path), seconds=0)
    with pytest.raises(ValueError, match="heartbeat"):
        BuilderLease(str(tmp_path), seconds=2, heartbeat=1)


@pytest.mark.integration
def test_exactly_one_acquires_and_one_takes_over_on_s3(s3_bucket: S3Bucket) -> None:
    # Without If-Match / If-None-Match (TensorStore sends them to AWS endpoints only, unless asked), a
    # conditional write is a HEAD then a PUT that two builders can interleave; races below rarely show it.
    spec = BuilderLease(s3_bucket.url("spec"))._kv.spec().to_json()
    assert spec["use_conditional_write"] is True
    for attempt in range(3):
        location = s3_bucket.url(f"race{attempt}")
        won = _race(location, 8, seconds=5.0)
        assert len(won) == 1
        won[0].release()
        assert f"race{attempt}/{LEASE_KEY}" not in s3_bucket.keys()  # noqa: SIM118  (a list of the bucket's keys)
    # Eight processes find the same expired lease: one takes it over.
    location = s3_bucket.url("expired")
    now = time.time()
    _write_record(location, LeaseRecord("dead-host/1/x", now - 10, now - 1, 1.0))
    won = _race(location, 8, seconds=5.0)
    assert len(won) == 1
    stored = read_lease(location)
    assert stored is not None
    assert stored.holder == won[0].holder
    won[0].release()
