"""The janitor's work: clear leases whose holder is gone and prune old history.

``reap(backend, ...)`` runs as a singleton under the janitor's own lock, so two beats (or a
manual ``celery dlock reap`` during a scheduled run) never reap at once, and it works in
bounded batches. The Celery task and its beat entry are in :mod:`celery_dlock.celery.janitor`.
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

__all__ = ["JANITOR_TASK", "janitor_key", "reap"]

logger = logging.getLogger("celery_dlock.janitor")

JANITOR_TASK = "celery_dlock.janitor"
#: The janitor's own lease lives this long unrenewed: a janitor that dies frees it soon.
JANITOR_TTL = 120.0


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
) -> dict[str, int]:
    """Reap dead leases (at most ``batch × max_batches``) and prune history older than
    ``retention`` seconds, under the janitor's own lock; ``cleared`` is called with the
    record of each lease cleared (each is logged too, as a warning).

    Returns:
        counts: ``reaped``, ``disconnected``, ``expired``, ``pruned``, and ``skipped`` (1
        when another janitor was running and this one did nothing).
    """
    counts = {"reaped": 0, "disconnected": 0, "expired": 0, "pruned": 0, "skipped": 0}
    guard = Lock(backend, janitor_key(namespace), ttl=JANITOR_TTL, wait=0)
    try:
        guard.acquire()
    except LockNotAcquiredError:
        counts["skipped"] = 1
        return counts
    try:
        for _ in range(max_batches):
            records = backend.reap(limit=batch)
            for record in records:
                counts["reaped"] += 1
                metrics.reaped(record.outcome.value)
                if record.outcome is Outcome.DISCONNECTED:
                    counts["disconnected"] += 1
                elif record.outcome is Outcome.EXPIRED:
                    counts["expired"] += 1
                if cleared is not None:
                    cleared(record)
                logger.warning(
                    "janitor cleared %s (fence %d, %s): %s",
                    record.key,
                    record.fence,
                    record.lease.holder.describe(),
                    record.outcome,
                    extra=fields(
                        "reaped", record.lease, outcome=record.outcome, backend=backend.url
                    ),
                )
            if len(records) < batch:
                break
        if retention is not None:
            counts["pruned"] = backend.prune_history(time.time() - retention)
    except BaseException as exc:
        guard.release(Outcome.FAILED, type(exc).__name__, str(exc))
        raise
    guard.release(Outcome.SUCCEEDED, result=counts)
    return counts
