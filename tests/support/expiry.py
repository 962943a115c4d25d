"""Leases whose ttl has run out while their holder (this process) lives on: what the
janitor's tests give it to clear."""

from __future__ import annotations

import time

from celery_dlock import Holder, Outcome
from celery_dlock.backends.base import LockBackend
from celery_dlock.records import Lease

#: Names tried for one key: a grant can come too late on a loaded machine (below).
TRIES = 4


def expired_leases(backend: LockBackend, keys: list[str], ttl: float) -> list[Lease]:
    """One lease per key of ``keys``, each past its expiry as the store stated it.

    An object store refuses a grant whose answer came after its ttl ran out (None; it
    records that lease ``expired`` at once): with a ttl under a second that happens on a
    loaded machine. That refusal is checked (the record is there) and the key is tried
    again as ``key~1``, ``key~2``…; callers take the keys from the leases returned."""
    leases = [_granted(backend, key, ttl) for key in keys]
    # Until the newest expiry as the store stated it: an object store sets it from the
    # upper bound of its clock (whole seconds of a Date header), later than ours + ttl.
    last = max(lease.expires_at or 0.0 for lease in leases)
    time.sleep(max(ttl, min(last - time.time(), 5.0)) + 0.3)
    return leases


def _granted(backend: LockBackend, key: str, ttl: float) -> Lease:
    holder = Holder.current()
    for attempt in range(TRIES):
        name = key if attempt == 0 else f"{key}~{attempt}"
        lease = backend.try_acquire(name, holder, ttl)
        if lease is not None:
            return lease
        (refused,) = backend.history(key=name, limit=None)
        assert refused.outcome is Outcome.EXPIRED and refused.lease.holder == holder, refused
    raise AssertionError(f"{key!r}: every grant of {TRIES} came after its ttl of {ttl} s")
