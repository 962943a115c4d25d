"""The janitor's work: clear leases whose holder is gone, release dedupe marks held for a
message that has run, and prune old history.

``reap(backend, ...)`` runs as a singleton under the janitor's own lock, so two beats (or a
manual ``celery dlock reap`` during a scheduled run) never reap at once beyond a first batch
(below), and it works in bounded batches. The lock's release records the run in the
history, with its counts (what ``doctor`` reads as the janitor's last run).

A run with ``marks`` first releases the dedupe marks held for a message that has run (a
store lost their release: :mod:`celery_dlock.marks`), each by its token, without the lock.
A run on the beat schedule (``quiet_for``) then clears one batch without the lock, and
when that cleared nothing (nor any mark) and a run was recorded less than ``quiet_for``
seconds ago, it stops there: an idle janitor leaves one record an hour, not one every 30
seconds in the history of the keys users look at. Clearing outside the lock is safe: a
reap releases each dead lease (and each mark) by its token, so two janitors at once clear
and record it once. The Celery task and its beat entry are in
:mod:`celery_dlock.celery.janitor`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from celery_dlock import metrics
from celery_dlock.backends.base import LockBackend
from celery_dlock.errors import ConfigurationError, LockNotAcquiredError
from celery_dlock.events import fields
from celery_dlock.lock import Lock
from celery_dlock.marks import ran_marks, release_ran
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
    limit: int | None = None,
    marks: int = 0,
) -> dict[str, int]:
    """Reap dead leases (at most ``limit``, by default ``batch × max_batches``) and prune
    history older than ``retention`` seconds (None: keep it; 0: all of it; a negative one
    is a cut-off in the future), under the janitor's own lock; ``cleared`` is called with
    the record of each lease cleared (each is logged too, as a warning).

    ``marks``: how many dedupe marks to look at for a message that has run (0: none), each
    released by its token, recorded ``forced`` (:func:`celery_dlock.marks.ran_marks`).

    ``quiet_for`` (seconds; None: every run is recorded): a run whose first batch, cleared
    without the lock, cleared nothing (nor released any mark) ends there, unrecorded and
    without pruning, when a run of the janitor succeeded less than ``quiet_for`` seconds
    ago (a failed run does not count: the next one tries again).

    Returns:
        counts: ``reaped``, ``disconnected``, ``expired``, ``pruned``, ``marks`` (the marks
        released), ``skipped`` (1 when another janitor was running and this one did no more
        than its first batch), and ``quiet`` (1 for a run that found nothing to do and was
        not recorded).

    Raises:
        ConfigurationError: ``retention`` is not finite seconds, ``batch``, ``max_batches``
            or ``limit`` is not a whole number >= 1, or ``marks`` not one >= 0.
    """
    _check(retention, batch, max_batches, limit, marks)
    names = ("reaped", "disconnected", "expired", "pruned", "marks", "skipped", "quiet")
    counts = dict.fromkeys(names, 0)
    left = batch * max_batches if limit is None else limit
    if marks:
        prefix = f"{namespace}:" if namespace else ""
        found = ran_marks(backend, prefix, sample=marks)
        for record in release_ran(backend, found, "the janitor"):
            counts["marks"] += 1
            _log_mark(record, backend.url)

    def clear(records: list[Record]) -> None:
        nonlocal left
        left -= len(records)
        for record in records:
            _count(counts, record, backend.url)
            if cleared is not None:
                cleared(record)

    key = janitor_key(namespace)
    batches = max_batches
    first: list[Record] | None = None
    if quiet_for is not None:
        first = backend.reap(limit=min(batch, left))
        clear(first)
        if not first and not counts["marks"] and _recorded_within(backend, key, quiet_for):
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
        # A batch clears fewer than it asked for when another janitor's first batch (taken
        # without the lock) cleared some of the same leases: only an empty one says that
        # nothing is left.
        more = first is None or bool(first)
        for _ in range(batches if more else 0):
            if left <= 0:
                break
            records = backend.reap(limit=min(batch, left))
            clear(records)
            if not records:
                break
        before = None if retention is None else time.time() - retention
        # Nothing was released before 1970: a retention reaching further back prunes
        # nothing (the object stores' names and Postgres's timestamps cannot say it).
        if before is not None and before > 0:
            counts["pruned"] = backend.prune_history(before)
    except BaseException as exc:
        guard.release(Outcome.FAILED, type(exc).__name__, str(exc))
        raise
    guard.release(Outcome.SUCCEEDED, result=counts)
    return counts


def _check(
    retention: float | None, batch: int, max_batches: int, limit: int | None, marks: int
) -> None:
    """Refuse what ``reap`` cannot do as asked: a NaN retention pruned every record of the
    file store (and failed elsewhere). A negative one is a cut-off in the future (tests use
    it to prune the file store's day of today)."""
    if retention is not None and (
        isinstance(retention, bool)
        or not isinstance(retention, (int, float))
        or not math.isfinite(retention)
    ):
        raise ConfigurationError(
            f"the janitor's retention must be finite seconds or None, not {retention!r}"
        )
    sizes = {"batch": batch, "max_batches": max_batches}
    for name, value in (sizes if limit is None else {**sizes, "limit": limit}).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"the janitor's {name} must be an int >= 1, not {value!r}")
    if isinstance(marks, bool) or not isinstance(marks, int) or marks < 0:
        raise ConfigurationError(f"the janitor's marks must be an int >= 0, not {marks!r}")


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


def _log_mark(record: Record, url: str) -> None:
    """Log ``record``, of a dedupe mark the janitor released."""
    logger.warning(
        "janitor released %s, held for message %s, which had run: %s",
        record.key,
        record.lease.holder.task_id,
        record.details,
        extra=fields("mark_released", record.lease, outcome=record.outcome, backend=url),
    )


def _recorded_within(backend: LockBackend, key: str, seconds: float) -> bool:
    """True when a run of the janitor (its ``key``) succeeded less than ``seconds`` ago.

    Only a success counts: after a failed run (its prune refused, its lock lost) the next
    run does its work again and records it, rather than staying quiet for ``seconds``."""
    since = time.time() - seconds
    return bool(backend.history(key=key, outcome=Outcome.SUCCEEDED, since=since, limit=1))
