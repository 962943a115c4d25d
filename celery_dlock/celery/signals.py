"""Worker lifecycle handlers: per-child setup, a child that died, revoke, shutdown.

Facts of Celery 5.7 these rest on (measured):

- A SIGKILLed pool child runs no code; only the parent gets ``task_failure`` with
  ``WorkerLostError`` (a hard time limit gives ``TimeLimitExceeded``, fired twice), with the
  task's args and kwargs. The parent renders the key, finds the lease whose holder has that
  task id and is provably gone, and releases it by that lease's token as ``disconnected``.
- ``revoke(terminate=True)`` fires ``task_revoked`` in the parent right after it signals the
  child, which may still be dying: the release then waits (off the worker's main thread)
  until the holder is gone, a few seconds at most, before it gives up to the janitor.
- No signal fires when a worker is told to revoke a queued task: the ``revoke`` control
  command is wrapped instead (:mod:`celery_dlock.celery.revoking`).
- Handlers tolerate firing twice: a release by a stale token changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from billiard.exceptions import WorkerLostError
from celery import signals as celery_signals
from celery.exceptions import TimeLimitExceeded

from celery_dlock.celery import revoking
from celery_dlock.celery.dedupe import body_leases, end_mark_of_attempt
from celery_dlock.celery.settings import enable_metrics, settings
from celery_dlock.errors import DLockError
from celery_dlock.events import fields
from celery_dlock.lock import Lock
from celery_dlock.process import release_all
from celery_dlock.records import Outcome, Record
from celery_dlock.releasing import unsettled

__all__ = ["connect", "release_dead_attempt"]

logger = logging.getLogger("celery_dlock.signals")

#: How long the parent waits for a signalled child to die before leaving it to the janitor.
DEATH_WAIT = 10.0

_connected = threading.Event()
_connect_mutex = threading.Lock()


def connect() -> None:
    """Connect the handlers once per process (idempotent)."""
    if _connected.is_set():
        return
    with _connect_mutex:
        if _connected.is_set():
            return
        celery_signals.task_failure.connect(_task_failed, weak=False)
        celery_signals.task_revoked.connect(_task_revoked, weak=False)
        celery_signals.worker_process_shutdown.connect(_shutting_down, weak=False)
        celery_signals.worker_shutdown.connect(_shutting_down, weak=False)
        celery_signals.worker_init.connect(revoking.install, weak=False)
        celery_signals.worker_init.connect(_metrics_if_asked, weak=False)
        _connected.set()


def _metrics_if_asked(sender: Any = None, **_: Any) -> None:
    """The worker's main process counts what it releases for its children (a child that
    died): with ``dlock_metrics``, its metrics are on from the start."""
    app = getattr(sender, "app", None)
    if app is not None and settings(app).metrics:
        enable_metrics()


def _task_failed(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    if not isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        return
    if task_id is not None:  # the child died: its message's dedupe mark goes too
        details = f"{type(exception).__name__}: {exception}"
        attempt = {"args": args, "kwargs": kwargs, "details": details}
        end_mark_of_attempt(sender, task_id, outcome=Outcome.DISCONNECTED, **attempt)
    _release_later(sender, task_id, args, kwargs, Outcome.DISCONNECTED, exception)


def _task_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    signum: Any = None,
    expired: bool = False,
    **_: Any,
) -> None:
    if request is None:
        return
    # A message revoked (or expired) before it ran, or a run terminated: its dedupe mark goes.
    outcome = Outcome.EXPIRED if expired else Outcome.REVOKED
    why = "expired before it ran" if expired else "revoked"
    args, kwargs = request.args, request.kwargs
    end_mark_of_attempt(sender, request.id, args=args, kwargs=kwargs, outcome=outcome, details=why)
    if not terminated:  # a retry's message that will not run: the lease kept for it goes
        revoking.release_kept(sender, request, outcome, f"{why} (a retry)")
        return
    reason = f"revoked and terminated with signal {signum}"
    _release_later(
        sender, request.id, request.args, request.kwargs, Outcome.REVOKED, RuntimeError(reason)
    )


def _release_later(  # noqa: PLR0917 - the signal's own fields, passed on
    task: Any,
    task_id: str | None,
    args: Any,
    kwargs: Any,
    outcome: Outcome,
    cause: BaseException,
) -> None:
    if not callable(getattr(task, "lock_key_for", None)) or task_id is None:
        return  # not a LockedTask
    # Release now when the holder is already gone (WorkerLostError: the child is dead),
    # otherwise from a thread, so the worker's event loop never waits on a dying child.
    attempt = {"args": args, "kwargs": kwargs, "outcome": outcome, "cause": cause}
    if release_dead_attempt(task, task_id, wait=0.0, **attempt) is _WAITING:
        threading.Thread(
            target=release_dead_attempt,
            args=(task, task_id),
            kwargs={"wait": DEATH_WAIT, **attempt},
            name=f"dlock-release:{task_id}",
            daemon=True,
        ).start()


_WAITING = object()


def release_dead_attempt(
    task: Any,
    task_id: str,
    *,
    args: Any,
    kwargs: Any,
    outcome: Outcome,
    cause: BaseException,
    wait: float,
) -> Record | object | None:
    """Release the lease of ``task_id``'s attempt if its holder is gone (waiting up to
    ``wait`` seconds for it to go). Returns the record, None, or ``_WAITING`` when the holder
    is still alive and ``wait`` is 0."""
    try:
        found = body_leases(task, args, kwargs)
        ours = [(lock, lease) for lock, lease in found if lease.holder.task_id == task_id]
    except DLockError as exc:
        extra = fields("dead_lookup_failed", task_id=task_id)
        logger.error("cannot look up the lease of %s[%s]: %s", task.name, task_id, exc, extra=extra)
        return None
    if not ours:
        return None  # released already, or another attempt's
    gone = _gone(ours[0][1], wait, cause)
    if gone is not True:
        return gone
    records = [_end_dead(task, task_id, lock, lease, outcome, cause) for lock, lease in ours]
    return next((record for record in records if record is not None), None)


def _gone(lease: Any, wait: float, cause: BaseException) -> bool | object | None:
    """True once ``lease``'s holder is gone; ``_WAITING`` while it lives and ``wait`` is 0;
    None if it still lives after ``wait`` seconds (left to the janitor)."""
    deadline = time.monotonic() + wait
    while not lease.holder.is_gone():
        if wait == 0:
            return _WAITING
        if time.monotonic() > deadline:
            logger.warning(
                "holder of %s (%s) still alive %.0f s after %s; leaving it to the janitor",
                lease.key,
                lease.holder.describe(),
                wait,
                type(cause).__name__,
                extra=fields("holder_alive", lease),
            )
            return None
        time.sleep(0.05)
    return True


def _end_dead(  # noqa: PLR0917 - one dead attempt's lease and why
    task: Any, task_id: str, lock: Lock, lease: Any, outcome: Outcome, cause: BaseException
) -> Record | None:
    details = f"{type(cause).__name__}: {cause}; holder {lease.holder.describe()} is gone"
    try:
        record = lock.end(lease, outcome, type(cause).__name__, details)
    except DLockError as exc:
        extra = fields("release_failed", lease, outcome=outcome)
        logger.error(
            "cannot release %s of dead %s[%s]: %s", lease.key, task.name, task_id, exc, extra=extra
        )
        return None
    if record is not None:
        extra = fields("dead_released", lease, outcome=outcome)
        logger.warning(
            "released %s of dead %s[%s] as %s", lease.key, task.name, task_id, outcome, extra=extra
        )
    return record


def _shutting_down(**_: Any) -> None:
    """Warm shutdown: release what this process still holds (leases kept for a retry, or
    a task cut short), each by its own token."""
    release_all(Outcome.REVOKED, "WorkerShutdown", "worker shutdown", kept=Outcome.RETRIED)
    unsettled.settle_all()  # a prefork child ends with os._exit: no exit handlers
