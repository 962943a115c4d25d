"""The janitor: clears leases whose holder is gone and prunes old history.

``reap(backend, ...)`` is the work; ``register(app)`` adds the ``celery_dlock.janitor`` task
and its beat entry. The janitor runs as a singleton under its own lock, so two beats (or a
manual run during a scheduled one) never reap at once, and it works in bounded batches.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from celery_dlock.backends.base import LockBackend
from celery_dlock.errors import LockNotAcquiredError
from celery_dlock.lock import Lock
from celery_dlock.records import Outcome

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["JANITOR_TASK", "reap", "register"]

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
) -> dict[str, int]:
    """Reap dead leases (at most ``batch × max_batches``) and prune history older than
    ``retention`` seconds, under the janitor's own lock.

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


def register(app: Celery) -> Any:
    """Add the janitor task to ``app`` and its beat entry, whatever the order of
    configuration; returns the task."""
    from celery import signals as celery_signals

    from celery_dlock.app import backend_for, forget_settings, settings

    existing = getattr(app, "_dlock_janitor", None)
    if existing is not None:
        return existing

    @app.task(name=JANITOR_TASK, ignore_result=False, shared=False)  # type: ignore[untyped-decorator]
    def janitor() -> dict[str, int]:
        """Reap leases whose holder is gone and prune history past retention."""
        current = settings(app)
        return reap(
            backend_for(app), namespace=current.namespace, retention=current.history_retention
        )

    def add_entry(sender: Any = None, **_: Any) -> None:
        target = sender if sender is not None else app
        if target is not app:
            return
        forget_settings(app)  # a (re)configuration: read the settings anew
        interval = settings(app).janitor_interval
        app.add_periodic_task(interval, janitor.s(), name=JANITOR_TASK)

    # on_after_configure fires once per (re)configuration; an app already configured gets the
    # entry now. Both are needed: see shared/notes/celery-5.7-facts.md §6.
    app.on_after_configure.connect(add_entry, weak=False)
    if app.configured:
        add_entry(app)

    def ensure_entry(sender: Any = None, **_: Any) -> None:
        # A beat_schedule dict assigned after install replaces ours: put it back.
        scheduler = getattr(sender, "scheduler", None)
        if scheduler is None or getattr(sender, "app", None) is not app:
            return
        if JANITOR_TASK not in scheduler.schedule:
            interval = settings(app).janitor_interval
            scheduler.update_from_dict({JANITOR_TASK: {"task": JANITOR_TASK, "schedule": interval}})

    celery_signals.beat_init.connect(ensure_entry, weak=False)
    app._dlock_janitor = janitor
    return janitor
