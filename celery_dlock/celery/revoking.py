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
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery.utils.functional import maybe_list
from celery.worker import state as worker_state
from celery.worker.control import Panel

from celery_dlock.backends.base import LockBackend
from celery_dlock.celery.busy import RETRY_HEADER, header
from celery_dlock.celery.dedupe import body_leases, release_mark
from celery_dlock.celery.settings import settings
from celery_dlock.errors import DLockError
from celery_dlock.events import fields
from celery_dlock.lock import Lock
from celery_dlock.process import shared_backend
from celery_dlock.records import Lease, Outcome, Record

__all__ = ["install", "kept_token", "release_kept", "release_marks_of"]

logger = logging.getLogger("celery_dlock.dedupe")

#: What a mark's key holds between the lock key and the task name (see dedupe.mark_key).
_MARK = "#queued:"
_installed = threading.Lock()


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
            retries = _waiting_retries(ids)
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


def _waiting_retries(task_ids: set[str]) -> list[Any]:
    """This worker's requests of ``task_ids`` not running (scheduled for their countdown, or
    reserved) that carry the token of a lease kept for them."""
    # Not ``requests`` by id: a retry's entry there goes when its first attempt ends.
    waiting = [*worker_state.scheduled_requests, *worker_state.reserved_requests]
    active = set(worker_state.active_requests)
    return [
        request
        for request in waiting
        if request.id in task_ids and request not in active and kept_token(request) is not None
    ]


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
    its token, recorded ``revoked``; the records written."""
    current = settings(app)
    active = {request.id for request in worker_state.active_requests}
    backend = shared_backend(current.backend)
    try:
        leases = backend.leases(f"{current.namespace}:" if current.namespace else "")
    except DLockError as exc:
        extra = fields("revoke_lookup_failed")
        logger.error("cannot look up the dedupe marks of revoked tasks: %s", exc, extra=extra)
        return []
    running = {lease.holder.task_id for lease in leases if _MARK not in lease.key} | active
    records = []
    for mark in leases:
        task_id = mark.holder.task_id
        if _MARK in mark.key and task_id in task_ids and task_id not in running:
            record = _release(backend, mark)
            if record is not None:
                records.append(record)
    return records


def _release(backend: LockBackend, mark: Lease) -> Record | None:
    why = "revoked while queued (a revoke reached the worker)"
    record = release_mark(Lock(backend, mark.key), mark, Outcome.REVOKED, None, why)
    if record is not None:
        extra = fields("mark_revoked", mark, outcome=Outcome.REVOKED)
        logger.info(
            "released the dedupe mark %s of revoked %s", mark.key, mark.holder.task_id, extra=extra
        )
    return record
