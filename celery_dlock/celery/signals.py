"""Worker lifecycle handlers: per-child setup, a child that died, revoke, shutdown; and
LockedTask's worker request class (:class:`LockedRequest`), for a child that died.

Facts of Celery 5.7 these rest on (measured):

- A SIGKILLed pool child runs no code; only the parent gets ``task_failure`` with
  ``WorkerLostError`` (a hard time limit gives ``TimeLimitExceeded``, fired twice), with the
  task's args and kwargs. The parent renders the key, finds the lease whose holder has that
  task id and is provably gone, and releases it by that lease's token as ``disconnected``.
- A dedupe mark is released from the parent only by the token its message carried in its
  header (``task_revoked``'s ``request``; for a dead child, ``sender.request``, which Celery
  5.7 sets to the message's request around ``task_failure``: ``Request.on_failure``, source).
  Never by the task id alone: callers may reuse task ids, and the mark held under that id
  may be a newer message's. A request without the header (the hard time limit's second
  ``task_failure``, after the first one released it) releases nothing. Where Celery gives
  the parent no request at all (before 5.7, celery/celery#9720) the mark held for the task
  id is released, as before: a dead child's key is not blocked for ``dedupe_ttl``, and a
  caller who reuses task ids there may see a newer message's mark go.
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

import celery
from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import SoftTimeLimitExceeded, WorkerLostError
from celery import signals as celery_signals
from celery.exceptions import TimeLimitExceeded
from celery.worker.request import Request
from celery.worker.state import task_ready

from celery_dlock.celery import dedupe, revoking, softlimit
from celery_dlock.celery.dedupe import DEDUPE_HEADER, body_leases, end_mark, mark_of
from celery_dlock.celery.settings import enable_metrics, settings
from celery_dlock.errors import BackendError, DLockError
from celery_dlock.events import fields
from celery_dlock.lock import Lock
from celery_dlock.process import release_all, shared_backend
from celery_dlock.records import Outcome, Record
from celery_dlock.releasing import unsettled

__all__ = ["connect", "release_dead_attempt"]

logger = logging.getLogger("celery_dlock.signals")

#: Whether this process warned that it released a dedupe mark by its task id.
_warned_by_task_id = False

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
        celery_signals.task_unknown.connect(_message_dropped, weak=False)
        celery_signals.task_rejected.connect(_message_dropped, weak=False)
        celery_signals.worker_process_shutdown.connect(_shutting_down, weak=False)
        celery_signals.worker_shutdown.connect(_shutting_down, weak=False)
        celery_signals.worker_init.connect(revoking.install, weak=False)
        celery_signals.worker_init.connect(_metrics_if_asked, weak=False)
        celery_signals.task_prerun.connect(_guard_from_the_first_task, weak=False)
        _connected.set()


def _guard_from_the_first_task(**_: Any) -> None:
    """In a pool child, the soft limit's guard in place as its first task starts, whatever
    the task (a plain one that takes ``celery_dlock.lock`` on the file store: its steps are
    guarded too); then this handler goes."""
    softlimit.ready()
    celery_signals.task_prerun.disconnect(_guard_from_the_first_task)


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
    if isinstance(exception, SoftTimeLimitExceeded):
        _soft_limit(sender, task_id, exception)
        return
    if not isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        return
    # The child died: its message's dedupe mark goes too, unless the message is sent again.
    # Celery 5.7 puts the message's request on the task's request stack while it sends this
    # signal (Request.on_failure).
    request = getattr(sender, "request", None)
    details = f"{type(exception).__name__}: {exception}"
    lost = isinstance(exception, WorkerLostError)
    if not (lost and _send_again(sender, request, task_id, exception)):
        if task_id is not None and getattr(request, "id", None) is None:  # before Celery 5.7
            attempt = {"args": args, "kwargs": kwargs, "details": details}
            _end_mark_of_task_id(sender, task_id, outcome=Outcome.DISCONNECTED, **attempt)
        else:
            _end_carried_mark(sender, request, task_id, Outcome.DISCONNECTED, details)
    _release_later(sender, task_id, args, kwargs, Outcome.DISCONNECTED, exception)


class LockedRequest(Request):  # type: ignore[misc]  # celery has no type hints
    """A LockedTask's message in the worker's main process. Where its pool child died
    before the body started, an ``until_started`` message is sent again under its mark
    (:func:`_send_again`) before Celery stores a ``FAILURE`` (which an ``AsyncResult``
    that read it would keep), sends ``task_failure`` or logs the loss as an error: the
    message is retried, as with Celery's ``retry_on_worker_lost``."""

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = exc_info.exception
        exc = exc.exc if isinstance(exc, ExceptionWithTraceback) else exc
        context = getattr(self, "_context", None)  # Celery 5.3+: the request as a task sees it
        lost = isinstance(exc, WorkerLostError) and context is not None
        if lost and _send_again(self.task, context, self.id, exc):
            task_ready(self)
            if self.task.acks_late:
                self.acknowledge()
            self.send_event("task-retried", exception=repr(exc), traceback=None)
            attempt = (self.task, self.id, self.args, self.kwargs, Outcome.DISCONNECTED, exc)
            _release_later(*attempt)
            return None
        return super().on_failure(exc_info, send_failed_event, return_ok)


def _send_again(task: Any, request: Any, task_id: str | None, exception: BaseException) -> bool:
    """An ``until_started`` message whose child died before its body started (the mark it
    carried still stands: it ends as the body starts) is sent again under that mark, as
    Celery's ``retry_on_worker_lost`` sends a task again (its state ``RETRY``): the calls
    coalesced into it get the run they were promised, where ending the mark would have
    dropped them all with the one message. True if sent. Not for a message that comes back
    by itself (``acks_late`` with ``reject_on_worker_lost``), nor where the store or the
    broker fails (the caller then ends the mark, as for a message that did start)."""
    if getattr(task, "dedupe", None) != "until_started" or getattr(request, "id", None) != task_id:
        return False
    mark = mark_of(request)
    if mark is None or (task.acks_late and task.reject_on_worker_lost):
        return False
    try:
        current = shared_backend(settings(task.app).backend).get(mark.key)
        if current is None or current.token != mark.token:
            return False  # it started (the mark ended), or a revoke ended it
        headers = {**(getattr(request, "headers", None) or {}), DEDUPE_HEADER: mark.to_dict()}
        task.signature_from_request(request, headers=headers).apply_async()
    except Exception as exc:  # the store, or the broker: the mark is ended instead
        extra = fields("send_again_failed", mark, task_id=task_id)
        logger.error("could not send %s[%s] again: %s", task.name, task_id, exc, extra=extra)
        return False
    dedupe.extend_mark(task, mark, dedupe.mark_ttl(task, settings(task.app).dedupe_ttl, {}))
    if not getattr(request, "ignore_result", False):
        task.backend.mark_as_retry(task_id, exception, request=request)
    extra = fields("sent_again", mark, task_id=task_id)
    logger.warning(
        "%s[%s] sent again under its dedupe mark: its child died before its body started (%s)",
        task.name, task_id, exception, extra=extra,
    )  # fmt: skip
    return True


def _soft_limit(task: Any, task_id: str | None, exception: BaseException) -> None:
    """In the child, a task that failed at its soft time limit: the dedupe mark its message
    carried is ended by its token, as the task's run ends it. The run ends it itself, but
    not when the limit came within the few calls of the task's start before its handlers
    were in place; a mark the run ended already is left as it is."""
    if getattr(task, "dedupe", None) is None:
        return
    details = f"ended before its mark's handlers were in place, by {exception!r}"
    _end_carried_mark(task, getattr(task, "request", None), task_id, Outcome.FAILED, details)


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
    _end_carried_mark(sender, request, request.id, outcome, why)
    if not terminated:  # a retry's message that will not run: the lease kept for it goes
        revoking.release_kept(sender, request, outcome, f"{why} (a retry)")
        return
    reason = f"revoked and terminated with signal {signum}"
    _release_later(
        sender, request.id, request.args, request.kwargs, Outcome.REVOKED, RuntimeError(reason)
    )


def _message_dropped(
    sender: Any = None,
    message: Any = None,
    exc: BaseException | None = None,
    name: str | None = None,
    **_: Any,
) -> None:
    """A message the worker dropped without running it (``task_unknown``: a task name this
    worker does not know, as in a deploy that reached the producers first; ``task_rejected``:
    a message it could not read): the dedupe mark it carried goes, by its token, recorded
    ``failed``. Kept, it would coalesce every later ``apply_async`` into a message that no
    one will run, until ``dedupe_ttl``."""
    mark = mark_of(message)
    app = getattr(sender, "app", None)
    if mark is None or app is None:
        return
    if name is not None:
        problem, why = "NotRegistered", f"no task {name!r} is registered in this worker"
    else:
        problem, why = type(exc).__name__ if exc else "UnknownMessage", str(exc or "unknown format")
    details = f"the worker dropped the message without running it: {why}"
    lock = Lock(settings(app).backend, mark.key)
    dedupe.release_mark(lock, mark, Outcome.FAILED, problem, details)


def _end_carried_mark(
    task: Any, request: Any, task_id: str | None, outcome: Outcome, details: str
) -> Record | None:
    """Release the dedupe mark that ``request``'s message carried, by its header's token;
    nothing when ``request`` is not ``task_id``'s or carries no mark (the mark of the same
    task id found in the store may be a newer message's: it is left to its ttl)."""
    if task_id is None or getattr(request, "id", None) != task_id:
        if getattr(task, "dedupe", None) is not None:
            logger.debug(
                "no request of %s[%s] here: its dedupe mark, if any, is left to its ttl",
                getattr(task, "name", task), task_id, extra=fields("mark_unknown", task_id=task_id),
            )  # fmt: skip
        return None
    mark = mark_of(request)
    return None if mark is None else end_mark(task, mark, outcome, details)


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
    gone = _gone([lease for _, lease in ours], wait, cause)
    if gone is not True:
        return gone
    # Only the dead holder's: a task id the caller reused may name a live attempt's slot.
    dead = [(lock, lease) for lock, lease in ours if lease.holder.is_gone()]
    records = [_end_dead(task, task_id, lock, lease, outcome, cause) for lock, lease in dead]
    return next((record for record in records if record is not None), None)


def _gone(leases: list[Any], wait: float, cause: BaseException) -> bool | object | None:
    """True once the holder of one of ``leases`` is gone; ``_WAITING`` while all live and
    ``wait`` is 0; None if all still live after ``wait`` seconds (left to the janitor)."""
    deadline = time.monotonic() + wait
    lease = leases[0]
    while not any(each.holder.is_gone() for each in leases):
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
    a task cut short), each by its own token. Not a lease a body still running in another
    thread holds: a threads pool's worker can reach its shutdown while a body runs (a cold
    shutdown during a warm one: Celery's threads pool cannot cancel a body), and releasing
    it would let another holder in beside that body; it ends with the body, or with the
    process by the store's liveness."""
    release_all(
        Outcome.REVOKED, "WorkerShutdown", "worker shutdown", kept=Outcome.RETRIED, in_use=False
    )
    unsettled.settle_all()  # a prefork child ends with os._exit: no exit handlers


def _end_mark_of_task_id(
    task: Any, task_id: str, *, args: Any, kwargs: Any, outcome: Outcome, details: str
) -> Record | None:
    """Release the mark held for ``task_id``, found in the store by its key: the parent's
    fallback where Celery gives it no request (before 5.7, a child that died). A task id
    the caller reused may name a newer message's mark: with a request, use its header."""
    if getattr(task, "dedupe", None) is None:
        return None
    try:
        key = dedupe.mark_key(task.lock_key_for(tuple(args or ()), dict(kwargs or {})), task.name)
        lock = Lock(settings(task.app).backend, key)
        mark = lock.current()
    except BackendError as exc:
        extra = fields("mark_lookup_failed", task_id=task_id)
        logger.error(
            "cannot look up the dedupe mark of %s[%s]: %s", task.name, task_id, exc, extra=extra
        )
        return None
    if mark is None or mark.holder.task_id != task_id:
        return None
    global _warned_by_task_id
    if not _warned_by_task_id:  # once per process: each such release is logged anyway
        _warned_by_task_id = True
        logger.warning(
            "Celery %s gives a dead child's parent no request (celery/celery#9720): the dedupe "
            "mark of %s[%s] is released by its task id, which with task ids you reuse may be "
            "a newer message's mark; Celery 5.7 or later releases the message's own",
            celery.__version__, task.name, task_id, extra=fields("mark_by_task_id", mark),
        )  # fmt: skip
    return dedupe.release_mark(lock, mark, outcome, None, details)
