# ruff: noqa: F811
"""A second adversarial trial of the janitor: reaping racing renewals and other janitors,
the fields of what it records, and pruning at its boundary, on real stores (the file
store, memory, PostgreSQL, Redis and the local S3 and GCS servers)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import Holder, Outcome
from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.file import FileBackend
from celery_dlock.reap import reap
from celery_dlock.records import Lease, Record
from tests.backends.storecase import StoreCase
from tests.support import eventually
from tests.support.expiry import expired_leases

# ``case`` is the first trial's fixture: the tests name it as a parameter (F811).
from tests.test_janitor_trial import ALL, case, stores  # noqa: F401

TTL = 0.4


def released(backend: LockBackend, key: str) -> Record:
    lease = backend.try_acquire(key, Holder.current(), 30.0)
    assert lease is not None
    record = backend.release(lease, Outcome.SUCCEEDED)
    assert record is not None
    return record


def run_together(*targets: Any) -> None:
    start = threading.Barrier(len(targets))
    errors: list[BaseException] = []

    def run(target: Any) -> None:
        start.wait()
        try:
            target()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors


# -- reaping -----------------------------------------------------------------------------------


@stores(*ALL)
def test_a_renewal_racing_the_janitor_never_revives_an_expired_lease(case: StoreCase) -> None:
    """Holders renew leases whose ttl ran out while a janitor clears them one per batch:
    no renewal succeeds, each lease ends exactly once as ``expired`` and no key is held."""
    backend, other = case.backend, case.second()
    leases = expired_leases(backend, [f"job:renew-race:{n}" for n in range(6)], TTL)
    renewed: dict[str, Lease | None] = {}
    cleared: list[Record] = []

    def holders() -> None:
        for lease in leases:
            renewed[lease.key] = other.renew(lease, 60.0)

    def janitor() -> None:
        reap(backend, batch=1, max_batches=20, cleared=cleared.append)

    run_together(holders, janitor)
    reap(backend)
    assert renewed == {lease.key: None for lease in leases}
    assert len({record.key for record in cleared}) == len(cleared)
    for lease in leases:
        records = backend.history(key=lease.key, limit=None)
        assert [(r.outcome, r.lease.token) for r in records] == [(Outcome.EXPIRED, lease.token)]
        assert backend.get(lease.key) is None


@stores(*ALL)
def test_the_record_of_an_expired_lease_is_that_lease(case: StoreCase) -> None:
    """What the janitor records of an expired lease is the lease as granted: key, token,
    fence, holder, acquisition and expiry; outcome and problem ``expired``; released at or
    after its expiry."""
    backend = case.backend
    key = "job:fields:ünï/🔒 {x}"
    (lease,) = expired_leases(backend, [key], TTL)
    cleared: list[Record] = []
    assert reap(backend, cleared=cleared.append)["expired"] == 1
    (record,) = cleared
    (stored,) = backend.history(key=lease.key, limit=None)
    for found in (record, stored):
        assert found.outcome is Outcome.EXPIRED and found.problem == "expired"
        assert found.lease.key == lease.key and found.key == lease.key
        assert (found.lease.token, found.fence) == (lease.token, lease.fence)
        assert found.lease.holder == lease.holder
        assert found.lease.acquired_at == pytest.approx(lease.acquired_at, abs=1e-3)
        assert lease.expires_at is not None and found.lease.expires_at is not None
        assert found.lease.expires_at == pytest.approx(lease.expires_at, abs=1e-3)
        assert found.released_at >= lease.expires_at - 1e-3


# -- pruning -----------------------------------------------------------------------------------


@stores(*ALL)
def test_a_prune_keeps_a_record_released_exactly_at_its_cut(case: StoreCase) -> None:
    """``prune_history(before)`` deletes records released *before* ``before``: one released
    at that very instant stays, on every store."""
    backend = case.backend
    record = released(backend, "job:boundary")
    backend.prune_history(record.released_at)
    (kept,) = backend.history(key="job:boundary", limit=None)
    assert kept.lease.token == record.lease.token


@stores(*ALL)
def test_a_retention_of_zero_keeps_what_is_released_after_the_prune(case: StoreCase) -> None:
    """The janitor prunes everything with retention 0, then holders go on: what they
    release afterwards is in the history, on every store."""
    backend, other = case.backend, case.second()
    released(other, "job:after:0")
    reap(backend, retention=0)
    record = released(other, "job:after:1")
    (kept,) = backend.history(key="job:after:1", limit=None)
    assert kept.lease.token == record.lease.token


def test_a_file_prune_of_today_loses_no_record_released_after_it(tmp_path: Path) -> None:
    """A worker's FileBackend has appended today; a janitor (another client) prunes with a
    cut-off a day ahead (``reap`` documents a negative retention as a future cut-off), so
    today's segment goes. The worker then releases a lease: that record, released after
    the prune, must be in the history."""
    directory = str(tmp_path / "locks")
    worker, janitor = FileBackend(directory), FileBackend(directory)
    try:
        released(worker, "job:file:before")
        assert reap(janitor, retention=-86400.0)["pruned"] == 1
        assert janitor.history(key="job:file:before", limit=None) == []
        record = released(worker, "job:file:after")
        found = janitor.history(key="job:file:after", limit=None)
        assert [r.lease.token for r in found] == [record.lease.token]
    finally:
        worker.close()
        janitor.close()


@stores("gcs", "memory", "postgres", "redis", "s3")
def test_a_prune_a_microsecond_past_a_record_deletes_it(case: StoreCase) -> None:
    """Just past its release (by 2 µs, above every store's resolution) a record goes, and
    one released later stays (the file store prunes whole days: not here)."""
    backend = case.backend
    record = released(backend, "job:cut:old")
    eventually(lambda: time.time() > record.released_at + 0.01, "10 ms to pass")
    later = released(backend, "job:cut:new")
    assert backend.prune_history(record.released_at + 2e-6) >= 1
    assert backend.history(key="job:cut:old", limit=None) == []
    (kept,) = backend.history(key="job:cut:new", limit=None)
    assert kept.lease.token == later.lease.token


@stores(*ALL)
def test_two_beat_janitors_at_once_record_each_dead_lease_once(case: StoreCase) -> None:
    """Two janitors on the beat schedule (``quiet_for``: the first batch is cleared outside
    the janitor's lock) start together on their own clients, small batches: between them
    and the next run every dead lease is cleared and recorded once, and a live one stays."""
    backend, other = case.backend, case.second()
    leases = expired_leases(backend, [f"job:twin:{n:02d}" for n in range(10)], TTL)
    live = backend.try_acquire("job:twin:live", Holder.current(), 60.0)
    assert live is not None
    found: list[dict[str, int]] = []
    cleared: list[Record] = []

    def janitor(store: LockBackend) -> Any:
        return lambda: found.append(
            reap(store, batch=2, max_batches=10, quiet_for=3600.0, cleared=cleared.append)
        )

    run_together(janitor(backend), janitor(other))
    janitor(backend)()  # the next run
    keys = sorted(record.key for record in cleared)
    left = [lease.key for lease in leases if backend.get(lease.key) is not None]
    assert keys == sorted(lease.key for lease in leases), (found, left)
    assert sum(counts["reaped"] for counts in found) == len(leases)
    for lease in leases:
        records = backend.history(key=lease.key, limit=None)
        assert [(r.outcome, r.lease.token) for r in records] == [(Outcome.EXPIRED, lease.token)]
        assert backend.get(lease.key) is None
    kept = backend.get("job:twin:live")
    assert kept is not None and kept.token == live.token
