"""Dedupe marks and body leases made directly on a store, in the shapes a worker leaves
them: for the tests of what ``celery-dlock marks`` and the janitor make of them."""

from __future__ import annotations

from celery_dlock import Holder, Outcome
from celery_dlock.backends.base import LockBackend
from celery_dlock.celery.dedupe import mark_key
from celery_dlock.records import Lease

TASK = "shop.sync"


def handed_mark(backend: LockBackend, lock_key: str, task_id: str) -> Lease:
    """A mark of ``task_id`` (of :data:`TASK`) on ``lock_key``, handed over to its message."""
    holder = Holder.current(task_id=task_id, task_name=TASK)
    lease = backend.try_acquire(mark_key(lock_key, TASK), holder, 60)
    assert lease is not None
    handed = backend.hand_over(lease, 3600)
    assert handed is not None
    return handed


def body(
    backend: LockBackend, key: str, task_id: str, outcome: Outcome | None, details: str = ""
) -> Lease:
    """A body lease of ``task_id`` on ``key``: released as ``outcome``, or held (None)."""
    lease = backend.try_acquire(key, Holder.current(task_id=task_id, task_name=TASK), 60)
    assert lease is not None
    if outcome is not None:
        assert backend.release(lease, outcome, None, details or None) is not None
    return lease
