"""Enqueue-time de-duplication (``dedupe``): guarding the queue, not only the body.

A ``LockedTask`` with ``dedupe`` takes a *mark* before it sends a message: a lease in the
task's lock store on ``<lock key>#queued:<task name>`` (its holder names the producer and
the new task id). While the message is being sent the mark lives with its producer (and at
most ``SEND_TTL``): a producer killed before its send leaves nothing that blocks the key for
long. Once the message is on the broker the mark is handed over to it
(``LockBackend.hand_over``): it lives by its ttl alone (``dedupe_ttl``, plus any countdown),
whatever becomes of the producer, so that a lost message never blocks the key for ever (a
producer that is itself a task in a pool child holds its own soft time limit back until the
hand-over is done: cut, the mark would end at ``SEND_TTL``, its message still queued). A second
``apply_async`` with the same key while the mark is held sends nothing and answers with the
queued task's ``AsyncResult`` (``on_duplicate``). The mark travels in a message header; the
worker releases it by that lease's token, never by key alone:

- ``until_started``: when the task's body starts, holding its lock (recorded
  ``dequeued``): at most one more run can queue behind a running one; a message re-queued
  because the key was busy keeps its mark;
- ``until_finished``: when the body ends, with the body's outcome; a retry (``self.retry``,
  or a re-queue for a busy body lock) is the same logical task and keeps the mark.

A re-sent message's mark lives ``dedupe_ttl`` past the re-send's countdown too; a message
put back by ``Reject(requeue=True)`` (``acks_late``) keeps its mark: it runs again.

A message that is part of a workflow (it carries the rest of a chain, callbacks, or belongs
to a group or chord), or continues one (a chain's next step, a callback, a ``Task.replace``,
which Celery sends under an id frozen in advance), is always sent, without a mark: not
sending it would drop the rest of the chain, or leave a result the caller holds waiting
under an id that never runs. The body lock still guards it.

A message revoked before it ran releases its mark at once: a plain revoke from the worker
that gets the broadcast (:mod:`celery_dlock.celery.revoking`), or
``task.revoke_queued(*args, **kwargs)`` by the arguments (``revoked``), neither of which
touches the mark of a running task. A worker starting the message at that very moment
settles it with the revoker through the store (:func:`revoke_queued`): either the mark is
released ``revoked`` and the body does not run (the task ends ``REVOKED``), or the body runs
and the mark is left alone. An expired message releases it when a worker discards it
(``expired``), and the mark of a message with ``expires`` ends with that expiry while it is
queued (RabbitMQ drops an expired message itself: no worker sees it); a child that died
mid-task releases it from the parent (``disconnected``), by the token of the header its
message carried (:mod:`celery_dlock.celery.signals`); a send that fails releases it before
``apply_async`` raises (``failed``). ``send_task`` by name does not pass through the
task class, so it is not guarded at enqueue; the body lock still guards the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid

from celery_dlock import critical
from celery_dlock.backends.base import LockBackend
from celery_dlock.celery import busy
from celery_dlock.celery.outcomes import outcome_of, replaced_by
from celery_dlock.celery.policies import call_policy
from celery_dlock.celery.revoking import (
    RevokedBeforeStart,
    body_leases,
    end_revoked,
    may_start,
    release_mark,
    revoke_mark,
)
from celery_dlock.celery.settings import settings
from celery_dlock.errors import BackendError, DLockError, DuplicateTaskError
from celery_dlock.events import fields
from celery_dlock.keys import MARK
from celery_dlock.lock import Lock
from celery_dlock.process import shared_backend
from celery_dlock.records import Holder, Lease, Outcome, Record

__all__ = [
    "DEDUPE_HEADER",
    "MODES",
    "ON_DUPLICATE",
    "body_leases",
    "end_mark",
    "extend_mark",
    "guards",
    "in_workflow",
    "mark_key",
    "mark_of",
    "mark_ttl",
    "release_mark",
    "revoke_queued",
    "run_marked",
    "send",
]

logger = logging.getLogger("celery_dlock.dedupe")

#: The message header that carries the mark's lease.
DEDUPE_HEADER = "dlock_dedupe"
MODES = ("until_started", "until_finished")
ON_DUPLICATE = ("return", "raise")
#: Tries when the mark is released between our attempt and our look at its holder.
_ATTEMPTS = 3
#: Seconds a mark lives while its message is being sent: a producer killed before the send
#: blocks the key this long at most on stores without holder liveness (Redis, S3, GCS).
SEND_TTL = 60.0
#: Seconds a mark of a message with ``expires`` outlives that expiry: no worker starts the
#: message later, and a duplicate after it must be sent, not coalesced into a message gone.
EXPIRY_GRACE = 1.0


def mark_key(lock_key: str, task_name: str) -> str:
    """The key of the mark of ``task_name``'s messages for ``lock_key``: per task, so that a
    queued ``charge`` does not hold back a ``refund`` of the same order."""
    return f"{lock_key}{MARK}{task_name}"


def send(
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    send_message: Callable[..., Any],
) -> Any:
    """``apply_async`` under a mark: send ``args``/``kwargs`` with ``send_message`` (the
    task's own ``apply_async``) unless a message of this task and key is queued already. A
    producer's soft limit (a task in a pool child) waits for the send and the hand-over: in
    the send, it would leave unknown whether the broker took the message.

    Raises:
        DuplicateTaskError: a duplicate, with ``on_duplicate="raise"``.
        BackendError: the store failed (nothing was sent).
    """
    current = settings(task.app)
    key = mark_key(task.lock_key_for(args, kwargs, current.namespace), task.name)
    task_id = options.pop("task_id", None) or uuid()
    ttl = mark_ttl(task, current.dedupe_ttl, options)
    holder = Holder.current(task_id=task_id, task_name=task.name)
    mark = Lock(current.backend, key, min(ttl, SEND_TTL), holder=holder, renew=False)
    for _ in range(_ATTEMPTS):
        if mark.attempt() is not None:
            break
        queued = mark.current()
        if queued is not None:
            return _duplicate(task, key, queued)
    else:  # released and taken again between our looks, each time: treat as queued
        raise BackendError(f"the dedupe mark {key!r} changed hands {_ATTEMPTS} times", None)
    lease = mark.detach()  # the message holds it now, not this process
    headers = {**(options.pop("headers", None) or {}), DEDUPE_HEADER: lease.to_dict()}
    critical.enter()
    try:
        try:
            sent = send_message(args, kwargs, task_id=task_id, headers=headers, **options)
        except BaseException as exc:
            details = f"the message was not sent ({type(exc).__name__}: {exc})"
            release_mark(mark, lease, Outcome.FAILED, type(exc).__name__, details)
            raise
        _hand_over(mark, lease, ttl)
    finally:
        critical.leave()
    return sent


def _hand_over(mark: Lock, lease: Lease, ttl: float) -> None:
    """The message is on the broker: its mark now lives by ``ttl`` alone, whatever becomes
    of this process (a script that exits, a web worker recycled), unless a worker that took
    the message first set its end already (:func:`extend_mark`): that end stands. A failure
    here is logged: the mark then ends after ``SEND_TTL`` or with this process, and a
    duplicate may be sent before the message runs (the body lock still guards the run)."""
    try:
        handed = mark.backend.hand_over(lease, ttl, if_unchanged=True)
    except BackendError as exc:
        extra = fields("hand_over_failed", lease)
        msg = "could not hand the dedupe mark %s to its message: %s"
        logger.error(msg, lease.key, exc, extra=extra)
        return
    if handed is None:
        _ended_before_hand_over(mark.backend, lease)


#: How a mark that ended before its hand-over ended when it is no sign of trouble: a worker
#: took the message first (and started or finished it), a revoke, an operator.
_TAKEN = frozenset(Outcome) - {Outcome.EXPIRED, Outcome.DISCONNECTED, Outcome.LOST}


def _ended_before_hand_over(backend: LockBackend, lease: Lease) -> None:
    """Log a mark that ended before its producer could hand it over: a warning if it expired
    or its store lost it while the message was being sent (a duplicate may be sent before
    the message runs); a debug line if a worker had taken the message and released it."""
    try:
        found = backend.history(key=lease.key, limit=20)
    except BackendError:
        found = []
    ended = next((r for r in found if r.lease.token == lease.token), None)
    extra = fields("hand_over_lost", lease)
    if ended is not None and ended.outcome in _TAKEN:
        logger.debug(
            "the dedupe mark %s was %s before its producer handed it over: %s",
            lease.key, ended.outcome.value, ended.details, extra=extra,
        )  # fmt: skip
        return
    logger.warning(
        "the dedupe mark %s ended (%s) while its message was being sent; a duplicate may be "
        "sent before the message runs",
        lease.key, "expired or lost" if ended is None else ended.outcome.value, extra=extra,
    )  # fmt: skip


#: Options of a message that carries or belongs to a workflow (callbacks, a group, a chord).
_WORKFLOW = ("link", "link_error", "group_id", "chord")
#: Options that only Celery's own machinery passes when it sends the next step of a
#: workflow under an id frozen in advance, which a result the caller holds waits for: a
#: chain's step (``chain``: an empty list for the last step, or a chain of one), a callback
#: or errback sent by the worker (``parent_id``), a ``Task.replace`` (``root_id``).
_CONTINUATION = ("parent_id", "root_id")


def in_workflow(options: dict[str, Any]) -> bool:
    """Whether the message of ``options`` carries, belongs to or continues a workflow."""
    names = _WORKFLOW + _CONTINUATION
    return options.get("chain") is not None or any(options.get(name) for name in names)


def mark_ttl(task: Any, default: float, options: dict[str, Any]) -> float:
    """The mark lives ``dedupe_ttl`` past the message's countdown or eta, and no longer
    than the message can be started: to its ``expires`` (a broker may drop an expired
    message itself, as RabbitMQ does: no worker ever sees it), plus ``EXPIRY_GRACE``."""
    ttl = float(task.dedupe_ttl) if task.dedupe_ttl is not None else default
    countdown = options.get("countdown")
    if isinstance(countdown, (int, float)) and not isinstance(countdown, bool):
        ttl += max(0.0, float(countdown))
    else:
        ttl += max(0.0, _seconds_until(options.get("eta")) or 0.0)
    expires = _seconds_until(options.get("expires", getattr(task, "expires", None)), now=True)
    if expires is not None:
        ttl = min(ttl, max(0.0, expires) + EXPIRY_GRACE)
    return ttl


def _seconds_until(when: Any, *, now: bool = False) -> float | None:
    """Seconds from now to ``when``: a datetime (naive: UTC, as Celery reads it on both
    sides, whatever the host's zone), an ISO 8601 string (a message's own ``eta``/``expires``),
    or with ``now`` a number of seconds from now (Celery's ``expires=60``); None for anything
    else."""
    if isinstance(when, str):
        try:
            when = datetime.fromisoformat(when)
        except ValueError:
            return None
    if isinstance(when, datetime):  # naive: UTC (celery.utils.time.maybe_make_aware)
        aware = when if when.utcoffset() is not None else when.replace(tzinfo=timezone.utc)
        return aware.timestamp() - time.time()
    if now and isinstance(when, (int, float)) and not isinstance(when, bool):
        return float(when)
    return None


def _duplicate(task: Any, key: str, queued: Lease) -> Any:
    task_id = queued.holder.task_id
    policy = task.on_duplicate
    extra = fields("duplicate", key=key, task_id=task_id)
    logger.info("%s not sent: %s is queued already as %s", task.name, key, task_id, extra=extra)
    if callable(policy):
        return call_policy(task, "on_duplicate", key, task_id)
    if policy == "raise":
        raise DuplicateTaskError(key, task_id)
    return task.AsyncResult(task_id)


def guards(task: Any, options: dict[str, Any], passing: tuple[str, ...] = ()) -> bool:
    """Whether ``apply_async`` with ``options`` is guarded by a mark: not without ``dedupe``,
    not for the same logical task again (a retry, a re-queue: the headers ``passing`` or a
    mark already), not eagerly, and not in a workflow (see :func:`in_workflow`)."""
    headers = options.get("headers") or {}
    return not (
        task.dedupe is None
        or DEDUPE_HEADER in headers
        or any(name in headers for name in passing)
        or options.get("retries")
        or task.app.conf.task_always_eager
        or in_workflow(options)
    )


def run_marked(task: Any, mark: Lease, run: Callable[[], Any]) -> Any:
    """``run()`` the body of a request sent under ``mark`` unless a revoke released the mark
    first (``revoking.may_start``), and release the mark by its token: as it starts
    (``until_started``), or when it ends (``until_finished``, with its outcome; a Retry
    keeps it: the same logical task goes on)."""
    where = getattr(task.request, "hostname", None) or "a direct call"
    if task.dedupe == "until_started":
        return _run_until_started(task, mark, run, where)
    return _run_until_finished(task, mark, run, where)


def _run_until_finished(task: Any, mark: Lease, run: Callable[[], Any], where: str) -> Any:
    """``until_finished``: the mark ends with the body's outcome; a Retry keeps it. With
    ``expires``, it is lengthened to ``dedupe_ttl`` as the message is taken (its run may be
    long), and again once the body lock is held (see :func:`_bound_for_retry`)."""
    ended: tuple[Outcome, str] | tuple[Outcome, str, str] | None
    ended = (Outcome.SUCCEEDED, f"finished on {where}")
    expires = getattr(task.request, "expires", None)
    started = False
    held: set[str] = set()  # the tokens of this attempt's body leases

    def on_held() -> None:
        nonlocal started
        held.update(lease.token for lease in task.leases)
        started = started or may_start(task, mark, where, release=False)
        if not started:
            end_revoked(task, mark, where)
        if expires is not None:
            extend_mark(task, mark, _dedupe_ttl(task))

    task.request.dlock_on_held = on_held
    task.request.dlock_mark = mark  # for a replacement it may go on with (replacing.py)
    try:
        if expires is not None:
            extend_mark(task, mark, _dedupe_ttl(task))
        result = run()
        if not started:  # on_locked="skip" or a callable: the body never ran
            ended = (Outcome.SKIPPED, f"its body did not run on {where}: the key was busy")
        return result
    except (Retry, RevokedBeforeStart) as exc:  # the same task goes on; the revoke ended it
        ended = None
        if isinstance(exc, Retry):
            _resent(task, mark, exc, held)
        raise
    except BaseException as exc:
        why = f"ended on {where} by {type(exc).__name__}: {exc}"
        ended = None if _comes_back(task, exc) else (outcome_of(exc), why, type(exc).__name__)
        if isinstance(exc, Ignore) and getattr(task.request, "dlock_mark_handed", False):
            ended = None  # it goes on with the replacement (replacing.hand_mark, once.replay)
        elif isinstance(exc, Ignore) and (handed := replaced_by(task.request)) is not None:
            ended = (Outcome.SUCCEEDED, f"{handed}; on {where}")
        raise
    finally:
        task.request.dlock_on_held = task.request.dlock_mark = None
        if ended is not None:
            end_mark(task, mark, *ended)


def _resent(task: Any, mark: Lease, exc: Retry, held: set[str] | None) -> None:
    """A retry, or a re-queue for a busy key, re-sent the task after ``exc.when``: its mark
    lives ``dedupe_ttl`` past that, as a sent message's (:func:`mark_ttl`), up to the ``expires``
    it keeps (+ ``EXPIRY_GRACE``); never shortened but for ``held``, an until_finished run's."""
    ttl = _dedupe_ttl(task) + max(0.0, _seconds_until(exc.when, now=True) or 0.0)
    left = _seconds_until(getattr(task.request, "expires", None))
    if left is not None:
        ttl = min(ttl, max(0.0, left) + EXPIRY_GRACE)
    if left is None or held is None:
        extend_mark(task, mark, ttl)
    else:
        _bound_for_retry(task, mark, ttl, held)


def _bound_for_retry(task: Any, mark: Lease, ttl: float, held: set[str]) -> None:
    """Bound a run's mark to ``ttl`` for its retry's message (sent already) unless a worker
    took it meanwhile: that worker lengthens the mark again once it holds the body lock,
    so either that comes after this bound, or the look here finds its body lease (of this
    task id, none of ``held``) and lengthens the mark again."""
    extend_mark(task, mark, ttl, shorten=True)
    request = task.request
    try:
        found = [lease for _, lease in body_leases(task, request.args, request.kwargs)]
    except DLockError as exc:  # cannot tell: the mark lives on rather than end under a run
        extra = fields("mark_lookup_failed", mark)
        logger.error("cannot tell whether %s's retry runs: %s", mark.key, exc, extra=extra)
    else:
        if all(lease.holder.task_id != request.id or lease.token in held for lease in found):
            return
    extend_mark(task, mark, _dedupe_ttl(task))


def _comes_back(task: Any, exc: BaseException) -> bool:
    """Whether ``exc`` puts the message back to run again under its mark: a ``Reject`` with
    ``requeue`` of a message not acknowledged yet (``acks_late``; ``Request.reject``)."""
    return isinstance(exc, Reject) and bool(exc.requeue) and bool(task.acks_late)


def _dedupe_ttl(task: Any) -> float:
    return float(task.dedupe_ttl) if task.dedupe_ttl is not None else settings(task.app).dedupe_ttl


def extend_mark(task: Any, mark: Lease, ttl: float, *, shorten: bool = False) -> None:
    """Make ``mark`` end ``ttl`` seconds from now, by its token: handed over (no earlier
    than it would), or renewed to ``shorten`` it; a producer's hand-over that comes after
    this leaves the end set here (``hand_over(if_unchanged=True)``). A store error is
    logged (the mark then ends when it would have)."""
    backend = shared_backend(settings(task.app).backend)
    try:
        (backend.renew if shorten else backend.hand_over)(mark, ttl)
    except BackendError as exc:
        extra = fields("extend_failed", mark)
        logger.error("could not extend the dedupe mark %s: %s", mark.key, exc, extra=extra)


def _run_until_started(task: Any, mark: Lease, run: Callable[[], Any], where: str) -> Any:
    """``until_started``: the mark ends when the body starts, holding its lock (the task
    calls ``request.dlock_on_held``), not when a worker picks the message up: a message
    re-queued because its key was busy is still queued, and keeps the mark."""
    started = False

    def on_held() -> None:
        nonlocal started
        if not started:
            try:
                may = may_start(task, mark, where, release=True)
            except BackendError as exc:  # the mark stands: re-queued, the body not run
                busy.store_failed(task, exc)
            started = True  # the mark ended: cut before, it is ended as before a start
            if not may:
                end_revoked(task, mark, where)

    task.request.dlock_on_held = on_held
    try:
        result = run()
    except Retry as exc:  # re-queued for a busy key, or retried: the same task keeps its mark
        if not started:
            _resent(task, mark, exc, None)
        raise
    except BaseException as exc:
        if not started and not _comes_back(task, exc):
            why = f"ended on {where} before its body started, by {type(exc).__name__}: {exc}"
            end_mark(task, mark, outcome_of(exc), why, type(exc).__name__)
        raise
    finally:
        task.request.dlock_on_held = None
    if not started:  # on_locked="skip" or a callable: the body never ran
        end_mark(task, mark, Outcome.SKIPPED, f"its body did not run on {where}: the key was busy")
    return result


def mark_of(request: Any) -> Lease | None:
    """The mark a worker's request carries in its headers, or None."""
    headers = getattr(request, "headers", None) or {}
    found = headers.get(DEDUPE_HEADER) if isinstance(headers, dict) else None
    if found is None:
        found = getattr(request, DEDUPE_HEADER, None)
    if not isinstance(found, dict):
        return None
    try:
        return Lease.from_dict(found)
    except (KeyError, TypeError, ValueError):
        extra = fields("bad_header")
        logger.warning("ignoring a malformed %s header: %r", DEDUPE_HEADER, found, extra=extra)
        return None


def end_mark(
    task: Any, mark: Lease, outcome: Outcome, details: str, problem: str | None = None
) -> Record | None:
    """Release ``mark`` by its token, recorded as ``outcome`` with ``problem`` (the type of
    the exception that ended its task); a mark that ended meanwhile (its ttl ran out, an
    operator released it) is left alone. Store errors are logged: the mark then ends at
    its ttl."""
    lock = Lock(settings(task.app).backend, mark.key)
    return release_mark(lock, mark, outcome, problem, details)


def revoke_queued(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Revoke the message queued under ``task``'s mark for these arguments and release the
    mark at once (recorded ``revoked``), so that the next ``apply_async`` sends again. The
    mark of a task that runs (``until_finished``: the store holds a body lease of its id,
    or one kept for its retry) is left alone, as a plain revoke leaves it: a revoke does not
    stop a running task, and a duplicate sent meanwhile would run after it. A worker that
    is starting the message settles it with this call through the store
    (:func:`~celery_dlock.celery.revoking.may_start`): the mark is released first, and the
    message revoked only then; the body then does not run.

    Returns:
        the id of the task revoked, or None when no message was queued under a mark.

    Raises:
        BackendError: the store failed (the message is revoked only after its mark went).
        LockTimeoutError: another revoker of this mark held it for ``REVOKING_TTL``.
    """
    current = settings(task.app)
    key = mark_key(task.lock_key_for(args, kwargs, current.namespace), task.name)
    return revoke_mark(task, Lock(current.backend, key), args, kwargs)
