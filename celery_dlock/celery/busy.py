"""A busy key in a Celery task: the ``on_locked`` policy, and the re-queue with backoff
that ``"retry"`` (and a failing store: ``store_failed``) uses."""

from __future__ import annotations

import logging
import random
from typing import Any, NoReturn

from celery.exceptions import Retry

from celery_dlock import metrics
from celery_dlock.celery.outcomes import lineage
from celery_dlock.celery.policies import call_policy
from celery_dlock.errors import BackendError, LockNotAcquiredError
from celery_dlock.events import fields
from celery_dlock.lock import Lock
from celery_dlock.locks import Locks
from celery_dlock.records import Lease, Outcome

__all__ = [
    "BUSY_HEADER",
    "PREDECESSOR_WAIT",
    "RETRY_HEADER",
    "after_predecessor",
    "apply_policy",
    "current_lease",
    "header",
    "requeue",
    "store_failed",
]

logger = logging.getLogger("celery_dlock.task")

#: Message header carrying the token of the lease a retry continues.
RETRY_HEADER = "dlock_lease"
#: Message header counting re-queues for a busy key (not Celery's own ``retries``).
BUSY_HEADER = "dlock_busy"
#: Seconds a replacement waits for the run it replaces to release their key.
PREDECESSOR_WAIT = 10.0


def apply_policy(task: Any, lock: Lock | Locks, exc: LockNotAcquiredError) -> Any:
    """The task's ``on_locked`` policy for a busy key: a callable's answer, a ``skipped``
    record, the error, or a re-queue."""
    policy = task.on_locked
    metrics.busy(task.name, "callable" if callable(policy) else str(policy))
    current = current_lease(lock, exc.key, task.request.id)
    if isinstance(lock, Lock) and ended_own_dead_attempt(task, lock, current):
        attempt = int(header(task.request, BUSY_HEADER) or 0)
        return requeue(task, exc, f"{lock.key} was held by a dead attempt of this task", attempt)
    if callable(policy):  # of a set: the key found busy, not the set's joined keys
        return call_policy(task, "on_locked", exc.key, current)
    if policy == "skip":
        blocker = (
            f"held by {current.holder.describe()} (fence {current.fence})"
            if current is not None
            else "held"
        )
        lock.record_skip("locked", blocker)
        task_id = None if lock.holder is None else lock.holder.task_id
        extra = fields("skipped", key=lock.key, task_id=task_id, outcome=Outcome.SKIPPED)
        logger.info("%s[%s] skipped: %s %s", task.name, task_id, lock.key, blocker, extra=extra)
        return None
    if policy == "fail" or not_queued(task):
        raise exc
    attempt = int(header(task.request, BUSY_HEADER) or 0)
    if task.lock_retry_max is not None and attempt >= task.lock_retry_max:
        raise exc
    return requeue(task, exc, f"{lock.key} is busy", attempt)


def after_predecessor(task: Any, lock: Lock | Locks, exc: LockNotAcquiredError) -> bool:
    """Whether this run, a replacement (``Task.replace``) that found its key held by the run
    it replaces (its own task id: that run sends it, then releases), took the key by waiting
    up to :data:`PREDECESSOR_WAIT` for that release. A sibling child may take the message
    at once; it must not be re-queued, skipped or failed for its own predecessor."""
    if not isinstance(lock, Lock) or not lineage(task.request)[0]:
        return False
    current = current_lease(lock, exc.key, task.request.id)
    if current is None or current.holder.task_id != task.request.id:
        return False
    try:
        lock.acquire(PREDECESSOR_WAIT)
    except (LockNotAcquiredError, BackendError):  # the policy then, as for any busy key
        return False
    return True


def ended_own_dead_attempt(task: Any, lock: Lock, current: Lease | None) -> bool:
    """Whether ``current``, the lease on the busy key, was an earlier attempt of this very
    request (same task id) whose process is provably gone, and is now ended by its token,
    recorded ``disconnected``. A message redelivered because its child died (``acks_late``
    with ``reject_on_worker_lost``) comes with no signal to the worker's parent, which
    would release that lease; on a store whose leases live by their ttl (Redis, S3, GCS)
    the key would stay blocked for the ttl, and the redelivery re-queued until then."""
    request = task.request
    if current is None or not_queued(task) or current.holder.task_id != request.id:
        return False
    if current.key not in lock.slots or not current.holder.is_gone():
        return False  # a live attempt of the same id (a redelivery by visibility timeout)
    details = (
        f"the attempt's process is gone (holder {current.holder.describe()}); ended by the "
        "redelivery of its message"
    )
    try:
        record = lock.end(current, Outcome.DISCONNECTED, "WorkerLostError", details)
    except BackendError:
        return False
    if record is None:
        return False
    extra = fields("dead_released", current, outcome=Outcome.DISCONNECTED)
    logger.warning(
        "released %s of a dead attempt of %s[%s] as disconnected",
        current.key,
        task.name,
        request.id,
        extra=extra,
    )
    return True


def not_queued(task: Any) -> bool:
    """Eager runs and direct calls have no queue to go back to."""
    request = task.request
    return bool(request.called_directly or request.is_eager)


def requeue(
    task: Any, exc: Exception, why: str, attempt: int = 0, level: int = logging.INFO
) -> Any:
    """Send this request again later with jittered backoff (``attempt``: the re-queues of
    this request so far), keeping Celery's own ``retries`` count, and end this attempt as
    RETRY; logged at ``level``."""
    if not_queued(task):
        raise exc
    request = task.request
    delay = min(task.lock_retry_backoff_max, task.lock_retry_backoff * 2**attempt)
    delay *= random.uniform(0.5, 1.0)
    headers = dict(request.headers or {})
    headers[BUSY_HEADER] = attempt + 1
    headers.pop(RETRY_HEADER, None)
    signature = task.signature_from_request(
        request, None, None, countdown=delay, retries=request.retries, headers=headers
    )
    signature.apply_async()
    extra = fields("requeued", task_id=request.id)
    logger.log(
        level, "%s[%s] re-queued in %.1f s: %s", task.name, request.id, delay, why, extra=extra
    )
    raise Retry(exc=exc, when=delay, sig=signature)


def store_failed(task: Any, exc: BackendError) -> NoReturn:
    """The lock store failed before the body ran: re-queue this request with the busy
    key's backoff, not limited by ``lock_retry_max`` (the work is kept); logged at ERROR.
    An eager run or a direct call raises ``exc``."""
    attempt = int(header(task.request, BUSY_HEADER) or 0)
    requeue(task, exc, f"the lock store failed: {exc}", attempt, logging.ERROR)
    raise exc  # not reached: requeue raises Retry, or exc where there is no queue


def header(request: Any, name: str) -> Any:
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name) if isinstance(headers, dict) else None
    return value if value is not None else getattr(request, name, None)


def current_lease(lock: Lock | Locks, busy: str, task_id: str | None = None) -> Lease | None:
    """The lease on the key found busy (of a set: ``busy``), or None; with a ``limit``,
    ``task_id``'s own on a slot if there is one (an earlier attempt of the same run: its
    dead process's slot is to be ended), else one of them."""
    try:
        if isinstance(lock, Locks):
            return lock.backend.get(busy)
        if lock.limit == 1:
            return lock.current()
        leases = lock.holders()
    except BackendError:
        return None
    own = [lease for lease in leases if task_id and lease.holder.task_id == task_id]
    return next(iter(own or leases), None)
