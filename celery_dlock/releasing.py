"""How a lease's release ends, lease or no lease: the record, and what a lost lease still
owes ``once``.

A release that finds its lease gone records it ``lost``, naming the outcome it could not
record, and still keeps a success with a result for ``once`` (insert-if-absent: the first
success wins). A success whose store fails is tried again with backoff for a bounded time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from celery_dlock import metrics
from celery_dlock.backends import mask_url
from celery_dlock.backends.base import LockBackend, remembered
from celery_dlock.errors import BackendError
from celery_dlock.events import fields
from celery_dlock.records import DETAILS_LIMIT, Lease, Outcome, Record, truncate_utf8

__all__ = ["Ending", "release", "release_success", "settle"]

logger = logging.getLogger("celery_dlock")

#: First and longest pause between two attempts to store a success while the store fails.
SUCCESS_PAUSE = 0.25
SUCCESS_PAUSE_MAX = 5.0
#: Records of a key read back to find a release whose reply was lost.
RECENT = 50


@dataclass(frozen=True, slots=True)
class Ending:
    """What a release records: the lease, and how its holder says it ended."""

    lease: Lease
    outcome: Outcome
    problem: str | None
    details: str | None
    result: Any
    reported: bool


def release(backend: LockBackend, ending: Ending, retrying: bool = False) -> Record | None:
    lease = ending.lease
    started = time.perf_counter()
    try:
        record = backend.release(
            lease, ending.outcome, ending.problem, ending.details, ending.result
        )
    except BackendError:
        metrics.store_error(backend.name, "release")
        raise
    metrics.store_call(backend.name, "release", started)
    return settle(backend, ending, record, retrying)


def settle(
    backend: LockBackend, ending: Ending, record: Record | None, retrying: bool = False
) -> Record | None:
    """The end of a release whose store answered ``record``: counted, or, when the lease
    was gone (None), recorded ``lost`` (its success kept for ``once``)."""
    lease = ending.lease
    if record is not None:
        metrics.released(record)
        return record
    if retrying:  # an earlier attempt may have landed with its reply lost
        earlier = _record_of(backend, lease)
        if earlier is not None:
            return earlier
    _record_lost(backend, ending)
    return None


def release_success(backend: LockBackend, ending: Ending, retry: float) -> Record | None:
    """``_release`` of a success that ``once`` must remember, tried again with backoff
    while the store fails."""
    lease = ending.lease
    deadline = time.monotonic() + retry
    pause = SUCCESS_PAUSE
    attempt = 1
    while True:
        try:
            record = release(backend, ending, retrying=attempt > 1)
        except BackendError as exc:
            if time.monotonic() + pause > deadline:
                logger.error(
                    "gave up storing the success of %s (fence %d) [%s] after %d attempts "
                    "in %.0f s: once may run this task again: %s",
                    lease.key,
                    lease.fence,
                    mask_url(backend.url),
                    attempt,
                    retry,
                    exc,
                    extra=fields("success_given_up", lease, backend=backend.url),
                )
                raise
            logger.warning(
                "could not store the success of %s (fence %d) [%s], attempt %d; trying "
                "again in %.2f s: %s",
                lease.key,
                lease.fence,
                mask_url(backend.url),
                attempt,
                pause,
                exc,
                extra=fields("success_retrying", lease, backend=backend.url),
            )
            time.sleep(pause)
            pause = min(pause * 2, SUCCESS_PAUSE_MAX)
            attempt += 1
            continue
        if attempt > 1:
            logger.warning(
                "stored the success of %s (fence %d) at attempt %d",
                lease.key,
                lease.fence,
                attempt,
                extra=fields("success_stored", lease, outcome=Outcome.SUCCEEDED),
            )
        return record


def _record_of(backend: LockBackend, lease: Lease) -> Record | None:
    """The record of ``lease``'s own release, if one is in the recent history."""
    for record in backend.history(key=lease.key, limit=RECENT):
        if record.lease.token == lease.token and record.outcome is not Outcome.LOST:
            return record if record.released_at >= lease.acquired_at else None
    return None


def _record_lost(backend: LockBackend, ending: Ending) -> None:
    """The lease was gone at release: keep its success (first wins) and record the
    release as ``lost``, naming the outcome it could not record."""
    lease, outcome = ending.lease, ending.outcome
    now = time.time()
    kept = ""
    if remembered(outcome, ending.result, lease.holder.task_name) is not None:
        success = Record(lease, now, outcome, ending.problem, ending.details, ending.result)
        kept = _keep(backend, success)
    note = f"{outcome} not recorded: the lease was lost before its release{kept}"
    text = "\n".join(part for part in (note, ending.problem, ending.details) if part)
    lost = Record(lease, now, Outcome.LOST, "lost", truncate_utf8(text, DETAILS_LIMIT), None)
    backend.add_record(lost)
    metrics.released(lost)
    logger.log(
        logging.WARNING if ending.reported else logging.ERROR,
        "lease on %s (fence %d) was lost before release [%s] (outcome %s): %s",
        lease.key,
        lease.fence,
        mask_url(backend.url),
        Outcome.LOST,
        note,
        extra=fields("release_lost", lease, outcome=Outcome.LOST, backend=backend.url),
    )


def _keep(backend: LockBackend, success: Record) -> str:
    """``remember`` the success of a lost lease; what became of it, in words."""
    if backend.remember(success):
        return "; its success is kept for once"
    task_name = str(success.lease.holder.task_name)
    kept = backend.last_success(success.key, task_name)
    if kept is not None and kept.lease.token == success.lease.token:
        return "; its success is kept for once"
    fence = "?" if kept is None else kept.lease.fence
    return f"; the success of fence {fence}, kept before it, stays (first wins)"
