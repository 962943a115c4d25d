"""``once`` in a Celery task: the success kept on the task's key, looked up before the body
runs and again when the body's own transaction was refused (``record_success``), and its
replay to a duplicate.

The lock store failing to say whether a success is kept is a store failure before any
effect: the lease is released as ``retried`` and the request re-queued (``busy.store_failed``),
never failed nor run. Once the kept success is known, the duplicate returns it whatever
becomes of its own lease's release: a release the store refuses waits for this process's
next release that reaches the store (``releasing.unsettled``), else the janitor records the
lease when it expires or its holder is gone."""

from __future__ import annotations

import logging
from typing import Any

from celery_dlock.celery.busy import store_failed
from celery_dlock.celery.outcomes import REPLACED, lineage, replayed
from celery_dlock.errors import BackendError
from celery_dlock.events import fields
from celery_dlock.lock import Lock
from celery_dlock.records import Outcome, Record, describe_exception

__all__ = ["continues", "kept_success", "replay"]

logger = logging.getLogger("celery_dlock.task")


def kept_success(task: Any, lock: Lock) -> Record | None:
    """The success a ``once`` task replays on ``lock``'s key, or None. When the store fails
    to say, the lease is released as ``retried`` and the request re-queued as for any store
    failure (:func:`~celery_dlock.celery.busy.store_failed`), never failed nor run."""
    try:
        return lock.last_success(task.name)
    except BackendError as exc:
        failure = exc
    try:
        lock.release(Outcome.RETRIED, *describe_exception(failure))
    except BackendError:
        logger.exception(  # a failed release is tried again at this process's next one
            "could not release %s", lock.key, extra=fields("release_failed", key=lock.key)
        )
    return store_failed(task, failure)  # raises Retry (re-queued), or failure (no queue)


def continues(request: Any, previous: Record) -> bool:
    """Whether ``request`` goes on with the run that kept ``previous`` rather than repeating
    it: ``previous`` was handed to a replacement (``Task.replace``, which sends it under the
    same task id, one ``replaced_task_nesting`` deeper, in the same workflow), and
    ``request`` is that replacement or a step of a chain that replaced it. A duplicate
    (another root), a redelivery of the replaced message (its own nesting) and a later
    step of the chain the replaced run was in (Celery appends them to the replacement)
    are not."""
    stored = previous.result
    handed = stored.get(REPLACED) if isinstance(stored, dict) else None
    if not isinstance(handed, dict):
        return False
    nesting, root = lineage(request)
    later = request.id in (handed.get("later") or ())  # a later step of the replaced run's chain
    return bool(
        nesting >= handed.get("nesting", 0) > 0 and root == handed.get("root_id") and not later
    )


def replay(lock: Lock, previous: Record) -> Any:
    """End this run as ``skipped`` and return the kept result of ``previous``, even when the
    store refuses the release: the effect is known to be done, and failing the duplicate
    would tell its caller otherwise. A run handed to a replacement kept no value: its
    duplicates return None (the result is the replacement's, under the first task's id)."""
    lease = lock.lease
    details = (
        f"once: already succeeded (fence {previous.fence}, task "
        f"{previous.lease.holder.task_id}); returning its stored result"
    )
    try:
        lock.release(Outcome.SKIPPED, "once", details)
    except BackendError:
        logger.exception(
            "could not release %s after replaying the success of fence %d; tried again at "
            "this worker's next release (else the janitor records it)",
            lock.key,
            previous.fence,
            extra=fields("release_failed", lease, outcome=Outcome.SKIPPED),
        )
    return replayed(previous.result)
