"""A plain revoke releases the dedupe mark of a message that has not started, at once.

Celery fires no signal when a worker is told to revoke a task: ``task_revoked`` comes only
when the worker reaches the message (for a message with a countdown, at its eta), and a
message still in the broker is known to no worker at all. So the worker's ``revoke``
control command (what ``AsyncResult.revoke()``, ``app.control.revoke(id)``,
``celery control revoke`` and Flower's button send) is wrapped: after Celery's own
handling, the worker looks up, off its event loop, the marks in its app's lock store whose
holder is a revoked task id, and releases each by its token, recorded ``revoked``.

A lease an attempt kept for its retry (``lock_across_retries``) goes the same way when the
retry's message is revoked before it ran, by the token in that message's header, recorded
``revoked``: at once where a worker holds the message (a retry's countdown), else when a
worker discards it (``task_revoked``). It used to stay for the backstop, countdown + 5 min.

A mark is left alone while its task runs (a revoke without ``terminate`` does not stop a
running task, and ``until_finished`` holds the mark until the body ends): when this worker
runs it, or when the store holds a body lease of that task id. Every worker gets the
broadcast and looks; the first release wins, the others find nothing to release. A
``terminate=True`` revoke of a running task is handled by ``task_revoked`` as before.

A revoker and a worker starting that very message settle it through the store, on every
store, with only its plain steps (:func:`revoke_mark`, :func:`may_start`): exactly one of
them wins. Either the mark is released ``revoked`` and the body does not run (its body
lease released ``revoked``, the task stored ``REVOKED``), or the body runs and the mark
is left alone (an ``until_finished`` mark held until the body ends, an ``until_started``
one released ``dequeued``) while the revoker revokes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, NoReturn

from celery.exceptions import Ignore
from celery.utils.functional import maybe_list
from celery.worker import state as worker_state
from celery.worker.control import Panel
from celery.worker.request import Request

from celery_dlock import metrics
from celery_dlock.backends.base import LockBackend
from celery_dlock.celery.busy import RETRY_HEADER, header
from celery_dlock.celery.settings import settings
from celery_dlock.errors import BackendError, DLockError, LockLostError
from celery_dlock.events import fields
from celery_dlock.keys import MARK, is_mark
from celery_dlock.lock import Lock
from celery_dlock.process import shared_backend
from celery_dlock.records import Holder, Lease, Outcome, Record
from celery_dlock.releasing import Ending, unsettled

__all__ = [
    "REVOKING",
    "REVOKING_TTL",
    "RevokedBeforeStart",
    "body_leases",
    "end_revoked",
    "install",
    "kept_token",
    "may_start",
    "release_kept",
    "release_mark",
    "release_marks_of",
    "revoke_mark",
]

logger = logging.getLogger("celery_dlock.dedupe")

_installed = threading.Lock()
#: What a revoker holds beside a mark's key while it decides (``<mark key>#revoking``), and
#: for how long at most: one that dies mid-way holds a worker starting that message this long.
REVOKING = "#revoking"
REVOKING_TTL = 30.0
#: Seconds of clock difference allowed for when the history is searched for a mark's record.
_SKEW = 600.0


class RevokedBeforeStart(Ignore):  # type: ignore[misc]  # celery has no type hints
    """The request's mark was released by a revoke before its body started: not run."""


def install(sender: Any = None, **_: Any) -> None:
    """Wrap the worker's ``revoke`` control command once (a ``worker_init`` handler)."""
    with _installed:
        handler = Panel.data.get("revoke")
        if handler is None or getattr(handler, "dlock_wrapped", False):
            return
        app = getattr(sender, "app", None)

        def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
            reply = handler(state, task_id, *args, **kwargs)
            ids = {str(each) for each in maybe_list(task_id) or []}
            target = getattr(state, "app", None) or app
            retries = _waiting_retries(state, ids)
            if ids and target is not None and (retries or _dedupes(target)):
                threading.Thread(
                    target=_release_revoked,
                    args=(target, ids, retries),
                    name="dlock-revoke",
                    daemon=True,
                ).start()
            return reply

        revoke.dlock_wrapped = True  # type: ignore[attr-defined]
        revoke.__doc__ = handler.__doc__
        Panel.data["revoke"] = revoke


def _waiting_retries(state: Any, task_ids: set[str]) -> list[Any]:
    """This worker's requests of ``task_ids`` not running (scheduled for their countdown, or
    reserved) that carry the token of a lease kept for them."""
    # Not ``requests`` by id: a retry's entry there goes when its first attempt ends.
    waiting = [*_scheduled(state), *worker_state.reserved_requests]
    active = set(worker_state.active_requests)
    return [
        request
        for request in waiting
        if request.id in task_ids and request not in active and kept_token(request) is not None
    ]


def _scheduled(state: Any) -> list[Any]:
    """This worker's requests waiting for their countdown or eta."""
    scheduled = getattr(worker_state, "scheduled_requests", None)
    if scheduled is not None:
        return list(scheduled)
    # Celery before 5.7 keeps no set of them: such a request is only an entry of the
    # consumer's timer (``Consumer.apply_eta_task``), which ``celery inspect scheduled`` reads
    # the same way (``celery.worker.control._iter_schedule_requests``).
    timer = getattr(getattr(state, "consumer", None), "timer", None)
    entries = list(getattr(getattr(timer, "schedule", None), "queue", None) or ())
    found = []
    for waiting in entries:
        args = getattr(getattr(waiting, "entry", None), "args", None) or ()
        if args and isinstance(args[0], Request):
            found.append(args[0])
    return found


def _release_revoked(app: Any, task_ids: set[str], retries: list[Any]) -> None:
    for request in retries:
        task = app.tasks.get(request.name)
        if task is not None:
            release_kept(task, request, Outcome.REVOKED, "revoked before its retry ran")
    if _dedupes(app):
        release_marks_of(app, task_ids)


def kept_token(request: Any) -> str | None:
    """The token of the lease kept for the retry that a worker's ``request`` is."""
    found = getattr(request, "request_dict", None)  # a worker's Request; else a Context
    token = found.get(RETRY_HEADER) if isinstance(found, dict) else header(request, RETRY_HEADER)
    return token if isinstance(token, str) and token else None


def release_kept(task: Any, request: Any, outcome: Outcome, why: str) -> Record | None:
    """Release the lease kept for ``request``, a retry that will not run, by its token."""
    token = kept_token(request)
    if token is None or not callable(getattr(task, "lock_keys_for", None)):
        return None
    try:
        for lock, lease in body_leases(task, request.args, request.kwargs):
            if lease.token == token:
                details = f"{why}: the lease its attempt kept for it is released"
                return lock.end(lease, outcome, None, details)
    except DLockError as exc:
        extra = fields("release_failed", task_id=request.id)
        logger.error(
            "cannot release the lease kept for %s[%s]: %s", task.name, request.id, exc, extra=extra
        )
    return None


def _dedupes(app: Any) -> bool:
    return any(getattr(task, "dedupe", None) for task in app.tasks.values())


def release_marks_of(app: Any, task_ids: set[str]) -> list[Record]:
    """Release the dedupe marks held for ``task_ids`` whose tasks have not started, each by
    its token, recorded ``revoked``; the records written. Each mark is released under its
    guard, as :func:`revoke_mark` releases one, against a worker starting its message."""
    current = settings(app)
    backend = shared_backend(current.backend)
    prefix = f"{current.namespace}:" if current.namespace else ""
    guards: list[Lock] = []
    try:
        marks = [
            lease
            for lease in backend.leases(prefix)
            if is_mark(lease.key, lease.holder.task_name) and lease.holder.task_id in task_ids
        ]
        for mark in marks:
            guards.append(guard(backend, mark))
        # Waits for later guards (one a dead revoker left lives its ttl) may have outlasted
        # the first ones: a mark whose guard ran out is left, as a worker may have started it.
        marks = [mark for mark, taken in zip(marks, guards, strict=True) if _fresh(taken)]
        leases = backend.leases(prefix) if marks else []  # after the guards (see may_start)
        # Body leases: neither marks nor the guards beside them.
        running = {lease.holder.task_id for lease in leases if MARK not in lease.key}
        running |= {request.id for request in worker_state.active_requests}
        return [
            record
            for mark in marks
            if mark.holder.task_id not in running and (record := _release(backend, mark))
        ]
    except DLockError as exc:
        extra = fields("revoke_lookup_failed")
        logger.error("cannot release the dedupe marks of revoked tasks: %s", exc, extra=extra)
        return []
    finally:
        for each in guards:
            unguard(each, "a revoke reached the worker")


def _fresh(taken: Lock) -> bool:
    """Whether the guard ``taken`` is still ours, its ttl renewed for the decision.

    Raises:
        BackendError: the store failed (the revoke then releases nothing).
    """
    try:
        taken.renew()
    except LockLostError:
        return False
    return True


def _release(backend: LockBackend, mark: Lease) -> Record | None:
    why = "revoked while queued (a revoke reached the worker)"
    record = release_mark(Lock(backend, mark.key), mark, Outcome.REVOKED, None, why)
    if record is not None:
        extra = fields("mark_revoked", mark, outcome=Outcome.REVOKED)
        logger.info(
            "released the dedupe mark %s of revoked %s", mark.key, mark.holder.task_id, extra=extra
        )
    return record


def release_mark(
    lock: Lock, mark: Lease, outcome: Outcome, problem: str | None, details: str
) -> Record | None:
    """Release ``mark`` by its token through ``lock``; None for a mark that ended meanwhile.
    A store error is logged and gives None: the release is tried again at this process's
    next release that reaches the store (``releasing.unsettled``; a mark left meanwhile
    would have later calls coalesced into a message that has run), else the mark ends at
    its ttl."""
    try:
        return lock.end(mark, outcome, problem, details)
    except BackendError as exc:
        unsettled.add(lock.backend, Ending(mark, outcome, problem, details, None, False))
        extra = fields("release_failed", mark, outcome=outcome)
        message = "could not release the dedupe mark %s (tried again at this process's next "
        message += "release, else it ends at its ttl): %s"
        logger.error(message, mark.key, exc, extra=extra)
        return None


def body_leases(task: Any, args: Any, kwargs: Any) -> list[tuple[Lock, Lease]]:
    """Every lease on the body keys of ``task`` for these arguments now (each slot of a
    ``lock_limit``), with the Lock of its key, to end one by its token.

    Raises:
        DLockError: the store failed, or the arguments render no key.
    """
    backend = settings(task.app).backend
    keys = task.lock_keys_for(tuple(args or ()), dict(kwargs or {}))
    locks = [Lock(backend, key, limit=getattr(task, "lock_limit", 1)) for key in keys]
    return [(lock, lease) for lock in locks for lease in lock.holders()]


def revoke_mark(task: Any, lock: Lock, args: Any, kwargs: Any) -> str | None:
    """``revoke_queued``'s half of the handshake of :func:`may_start`: under the mark's
    guard, release the mark on ``lock``'s key (``revoked``) unless the store holds a body
    lease of its task (or one kept for its retry), and revoke that task only once its mark
    went; the id revoked, or None.

    Raises:
        BackendError: the store failed (nothing was revoked).
        LockTimeoutError: another revoker held the guard for ``REVOKING_TTL``.
    """
    mark = lock.current()
    task_id = None if mark is None else mark.holder.task_id
    if mark is None or task_id is None:
        return None
    held = guard(lock.backend, mark)
    try:
        runs = any(lease.holder.task_id == task_id for _, lease in body_leases(task, args, kwargs))
        why = "revoked while queued (revoke_queued)"
        if runs or lock.end(mark, Outcome.REVOKED, None, why) is None:
            return None
    finally:
        unguard(held, "revoke_queued")
    task.app.control.revoke(task_id)
    return task_id


def guard(backend: LockBackend, mark: Lease) -> Lock:
    """The guard of ``mark`` (``<mark key>#revoking``), taken for a revoker: waiting while
    another revoker holds it, at most ``REVOKING_TTL``.

    Raises:
        LockTimeoutError: another revoker held it all that time.
        BackendError: the store failed.
    """
    holder = Holder.current(task_id=mark.holder.task_id, task_name=mark.holder.task_name)
    key = mark.key + REVOKING
    taken = Lock(backend, key, REVOKING_TTL, REVOKING_TTL, holder=holder, renew=False)
    taken.acquire()
    return taken


def unguard(taken: Lock, revoker: str) -> None:
    """Release a guard taken by :func:`guard`; a store error is logged (it ends at its ttl)."""
    try:
        taken.release(Outcome.SUCCEEDED, None, f"{revoker} decided")
    except BackendError as exc:
        extra = fields("release_failed", key=taken.key)
        logger.error("could not release %s (it ends at its ttl): %s", taken.key, exc, extra=extra)


def may_start(task: Any, mark: Lease, where: str, *, release: bool) -> bool:
    """Whether the body of the request sent under ``mark`` may start: asked holding its
    lock, False when a revoke released ``mark`` (recorded ``revoked``) first. ``release``:
    end the mark now, ``dequeued`` (``until_started``), rather than only look at it.

    The worker's half of its handshake with a revoker (:func:`revoke_mark`,
    :func:`release_marks_of`), who takes the mark's guard, then looks for a body lease of
    the task, then releases the mark. The worker took its body lease before it looks at
    the guard (waiting while a revoker holds it), then at the mark: each side writes
    before it reads what the other writes, so one of them at least sees the other. Either
    the revoker leaves the mark of a body that runs, or the worker finds its mark revoked.
    A store error is raised with ``release`` (the mark stands: a body started now would
    have later calls coalesced into a run that has begun); else logged, and the body runs.

    Raises:
        BackendError: with ``release``, the store failed."""
    backend = shared_backend(settings(task.app).backend)
    try:
        _await_revoker(backend, mark.key + REVOKING)
        if release:
            why = f"started by {where}"
            # No Lock for this: a soft limit on the way into a dropped Lock's __del__ is
            # swallowed (an exception there is only printed), and this runs in every task.
            if (ended := backend.release(mark, Outcome.DEQUEUED, None, why)) is not None:
                metrics.released(ended)
                return True
        elif (current := backend.get(mark.key)) is not None and current.token == mark.token:
            return True
        # Gone: released by a revoke, or ended by its ttl (or an operator): that one runs.
        found = backend.history(mark.key, Outcome.REVOKED, mark.acquired_at - _SKEW, None)
        return all(record.lease.token != mark.token for record in found)
    except BackendError as exc:
        if release:
            raise
        extra = fields("revoke_check_failed", mark)
        logger.error(
            "cannot tell whether the dedupe mark %s was revoked; the body runs: %s",
            mark.key,
            exc,
            extra=extra,
        )
        return True


def _await_revoker(backend: LockBackend, key: str) -> None:
    """Return once no revoker holds ``key`` (its decision is in the store), or after
    ``REVOKING_TTL``, when its lease has expired."""
    deadline = time.monotonic() + REVOKING_TTL
    while backend.get(key) is not None and (left := deadline - time.monotonic()) > 0:
        place = backend.wait(key, min(left, 1.0))
        if place is not None:  # no place kept in its queue: this worker never takes it
            place.leave()


def end_revoked(task: Any, mark: Lease, where: str) -> NoReturn:
    """End the request whose mark a revoke released before its body started: the body lock
    it holds released ``revoked``, the task's state stored ``REVOKED`` (with the reason
    Celery's worker gives a revoked message), and no body run.

    Raises:
        RevokedBeforeStart: always (an ``Ignore``: Celery stores nothing more).
    """
    request = task.request
    lock = getattr(request, "dlock_lock", None)
    request.dlock_lock = None
    why = f"its message was revoked before its body started on {where}"
    extra = fields("revoked_at_start", mark, outcome=Outcome.REVOKED)
    logger.info("%s[%s] not run: %s", task.name, request.id, why, extra=extra)
    try:
        if lock is not None:
            lock.release(Outcome.REVOKED, None, why)
    finally:
        store = not task.ignore_result or task.store_errors_even_if_ignored
        task.backend.mark_as_revoked(request.id, "revoked", request=request, store_result=store)
    raise RevokedBeforeStart(why)
