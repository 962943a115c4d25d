"""A plain revoke releases the dedupe mark of a message that has not started, at once.

Celery fires no signal when a worker is told to revoke a task: ``task_revoked`` comes only
when the worker reaches the message (for a message with a countdown, at its eta), and a
message still in the broker is known to no worker at all. So the worker's ``revoke``
control command (what ``AsyncResult.revoke()``, ``app.control.revoke(id)``,
``celery control revoke`` and Flower's button send) is wrapped: after Celery's own
handling, the worker looks up, off its event loop, the marks in its app's lock store whose
holder is a revoked task id, and releases each by its token, recorded ``revoked``.

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
from celery_dlock.celery.dedupe import release_mark
from celery_dlock.celery.settings import settings
from celery_dlock.errors import DLockError
from celery_dlock.events import fields
from celery_dlock.lock import Lock
from celery_dlock.process import shared_backend
from celery_dlock.records import Lease, Outcome, Record

__all__ = ["install", "release_marks_of"]

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
            if ids and target is not None and _dedupes(target):
                threading.Thread(
                    target=release_marks_of,
                    args=(target, ids),
                    name="dlock-revoke",
                    daemon=True,
                ).start()
            return reply

        revoke.dlock_wrapped = True  # type: ignore[attr-defined]
        revoke.__doc__ = handler.__doc__
        Panel.data["revoke"] = revoke


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
