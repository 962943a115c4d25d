"""The janitor's work: clear leases whose holder is gone and prune old history.

``reap(backend, ...)`` runs as a singleton under the janitor's own lock, so two beats (or a
manual ``celery dlock reap`` during a scheduled run) never reap at once beyond a first batch
(below), and it works in bounded batches. The lock's release records the run in the
history, with its counts (what ``doctor`` reads as the janitor's last run).

A run on the beat schedule (``quiet_for``) first clears one batch without the lock, and
when that cleared nothing and a run was recorded less than ``quiet_for`` seconds ago, it
stops there: an idle janitor leaves one record an hour, not one every 30 seconds in the
history of the keys users look at. Clearing outside the lock is safe: a reap releases each
dead lease by its token, so two janitors at once clear and record it once. The Celery task
and its beat entry are in :mod:`celery_dlock.celery.janitor`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from celery_dlock import metrics
from celery_dlock.backends.base import LockBackend
from celery_dlock.errors import LockNotAcquiredError
from celery_dlock.events import fields
from celery_dlock.lock import Lock
from celery_dlock.records import Outcome, Record

__all__ = ["JANITOR_QUIET", "JANITOR_TASK", "janitor_key", "reap"]

logger = logging.getLogger("celery_dlock.janitor")

JANITOR_TASK = "celery_dlock.janitor"
#: The janitor's own lease lives this long unrenewed: a janitor that dies frees it soon.
JANITOR_TTL = 120.0
#: A janitor on the beat schedule that finds nothing to do records a run this often.
JANITOR_QUIET = 3600.0


def janitor_key(namespace: str) -> str:
    return f"{namespace}:{JANITOR_TASK}" if namespace else JANITOR_TASK


def reap(
    backend: LockBackend,
    *,
    namespace: str = "job",
    retention: float | None = None,
    batch: int = 100,
    max_batches: int = 10,
    cleared: Callable[[Record], object] | None = None,
    quiet_for: float | None = None,
) -> dict[str, int]:
    """Reap dead leases (at most ``batch × max_batches``) and prune history older than
    ``retention`` seconds, under the janitor's own lock; ``cleared`` is called with the
    record of each lease cleared (each is logged too, as a warning).

    ``quiet_for`` (seconds; None: every run is recorded): a run whose first batch, cleared
    without the lock, cleared nothing ends there, unrecorded and without pruning, when a
    run of the janitor was recorded less than ``quiet_for`` seconds ago.

    Returns:
        counts: ``reaped``, ``disconnected``, ``expired``, ``pruned``, ``skipped`` (1 when
        another janitor was running and this one did no more than its first batch), and
        ``quiet`` (1 for a run that found nothing to do and was not recorded).
    """
    counts = {"reaped": 0, "disconnected": 0, "expired": 0, "pruned": 0, "skipped": 0, "quiet": 0}

    def clear(records: list[Record]) -> None:
        for record in records:
            _count(counts, record, backend.url)
            if cleared is not None:
                cleared(record)

    key = janitor_key(namespace)
    batches = max_batches
    first: list[Record] | None = None
    if quiet_for is not None:
        first = backend.reap(limit=batch)
        clear(first)
        if not first and _recorded_within(backend, key, quiet_for):
            counts["quiet"] = 1
            return counts
        batches -= 1
    guard = Lock(backend, key, ttl=JANITOR_TTL, wait=0)
    try:
        guard.acquire()
    except LockNotAcquiredError:
        counts["skipped"] = 1
        return counts
    try:
        more = first is None or len(first) == batch
        for _ in range(batches if more else 0):
            records = backend.reap(limit=batch)
            clear(records)
            if len(records) < batch:
                break
        if retention is not None:
            counts["pruned"] = backend.prune_history(time.time() - retention)
    except BaseException as exc:
        guard.release(Outcome.FAILED, type(exc).__name__, str(exc))
        raise
    guard.release(Outcome.SUCCEEDED, result=counts)
    return counts


def _count(counts: dict[str, int], record: Record, url: str) -> None:
    """Count and log ``record``, of a lease the janitor cleared."""
    counts["reaped"] += 1
    metrics.reaped(record.outcome.value)
    if record.outcome is Outcome.DISCONNECTED:
        counts["disconnected"] += 1
    elif record.outcome is Outcome.EXPIRED:
        counts["expired"] += 1
    logger.warning(
        "janitor cleared %s (fence %d, %s): %s",
        record.key,
        record.fence,
        record.lease.holder.describe(),
        record.outcome,
        extra=fields("reaped", record.lease, outcome=record.outcome, backend=url),
    )


def _recorded_within(backend: LockBackend, key: str, seconds: float) -> bool:
    """True when the newest record of the janitor's ``key`` was released less than
    ``seconds`` ago."""
    newest = backend.history(key=key, limit=1)
    return bool(newest) and time.time() - newest[0].released_at < seconds
