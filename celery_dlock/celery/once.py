"""``once`` in a Celery task: the success kept on the task's key, looked up before the body
runs and again when the body's own transaction was refused (``record_success``), and its
replay to a duplicate.

A run that replaced itself (``Task.replace``) keeps the first success, with no value. Its
replacements on the same key go on (:func:`continues`), and each keeps its own success
under a name of its own, ``<task> (replacement <nesting>)`` (:func:`step`): what a
redelivery of that replacement, after it ended, replays instead of running again.

The lock store failing to say whether a success is kept is a store failure before any
effect: the lease is released as ``retried`` and the request re-queued (``busy.store_failed``),
never failed nor run. Once the kept success is known, the duplicate returns it whatever
becomes of its own lease's release: a release the store refuses waits for this process's
next release that reaches the store (``releasing.unsettled``), else the janitor records the
lease when it expires or its holder is gone."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.exceptions import Ignore

from celery_dlock.celery.busy import store_failed
from celery_dlock.celery.outcomes import REPLACED, lineage, replayed
from celery_dlock.errors import BackendError
from celery_dlock.events import fields
from celery_dlock.keys import replacement_name
from celery_dlock.lock import Lock
from celery_dlock.records import Outcome, Record, describe_exception
from celery_dlock.releasing import remember_success

__all__ = ["continues", "keep_step", "kept_success", "replay", "step"]

logger = logging.getLogger("celery_dlock.task")

#: Pages a duplicate looks through for the last page's success (a read each).
CHAIN_READS = 64


def kept_success(task: Any, lock: Lock, name: str | None = None) -> Record | None:
    """The success a ``once`` task replays on ``lock``'s key (kept under the task's name, or
    ``name``), or None. When the store fails to say, the lease is released as ``retried``
    and the request re-queued as for any store failure
    (:func:`~celery_dlock.celery.busy.store_failed`), never failed nor run."""
    try:
        return lock.last_success(name or task.name)
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
    if not _handed(previous):
        return False
    handed = previous.result[REPLACED]
    nesting, root = lineage(request)
    later = request.id in (handed.get("later") or ())  # a later step of the replaced run's chain
    return bool(
        nesting >= handed.get("nesting", 0) > 0 and root == handed.get("root_id") and not later
    )


def step(task: Any, lock: Lock, previous: Record) -> Record | None:
    """What this run replays, given the success ``previous`` kept on its key.

    - A replacement that goes on with the run that kept it (:func:`continues`): the success
      it kept under its own name in an earlier delivery, or None (run the body); the
      request notes that name (``dlock_step``) for :func:`keep_step`.
    - The replaced message delivered again (its task id): ``previous``, the hand-over.
    - A duplicate: when the run was handed to itself again (a page of a sync), the last
      page's success once it ended, looked up page by page; else ``previous``."""
    request = task.request
    if continues(request, previous):
        nesting, _ = lineage(request)
        request.dlock_step = _step_name(task, nesting)
        return kept_success(task, lock, request.dlock_step)
    if previous.lease.holder.task_id == request.id:
        return previous
    for _ in range(CHAIN_READS):
        if not _handed(previous) or not previous.result[REPLACED].get("itself"):
            break  # a value, or handed to another task or a workflow: its result is theirs
        later = kept_success(task, lock, _step_name(task, previous.result[REPLACED]["nesting"]))
        if later is None:
            break  # still going on, or a page failed
        previous = later
    return previous


def _step_name(task: Any, nesting: int) -> str:
    """The name a replacement ``nesting`` deep keeps its success under."""
    return replacement_name(task.name, nesting)


def keep_step(request: Any, lock: Lock, result: Any) -> None:
    """Keep a replacement's success (``result``: its value, or its own hand-over) under its
    own name before its release, so that its redelivery replays it. A store that fails is
    tried again as a release of a success is (``Lock.success_retry``); then the success is
    lost for that name (logged) and the release goes on."""
    name = getattr(request, "dlock_step", None)
    lease = lock.lease
    if name is None or lease is None or result is None:
        return
    record = Record(lease.for_task(name), time.time(), Outcome.SUCCEEDED, None, None, result)
    try:
        remember_success(lock.backend, record, lock.success_retry)
    except BackendError:  # logged as given up: the release goes on
        logger.error(
            "the success of %s is not kept as %r: a redelivery of this replacement would "
            "run it again",
            lock.key,
            name,
            extra=fields("step_not_kept", lease),
        )


def replay(lock: Lock, previous: Record, request: Any) -> Any:
    """End this run as ``skipped`` and return the kept result of ``previous``, even when the
    store refuses the release: the effect is known to be done, and failing the duplicate
    would tell its caller otherwise. A run handed to a replacement kept no value: its
    duplicates return None (the result is the replacement's, under the first task's id).
    The same message delivered again (``request`` has the task id that handed its run on)
    raises ``Ignore`` instead, as the run it repeats did: a result stored under that id now
    would be what its caller gets, and the replacement's could not replace it."""
    lease = lock.lease
    handed_on = _handed(previous) and previous.lease.holder.task_id == request.id
    details = (
        f"once: already succeeded (fence {previous.fence}, task "
        f"{previous.lease.holder.task_id}); "
        + ("its run went on in a replacement" if handed_on else "returning its stored result")
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
    if handed_on:
        request.dlock_mark_handed = True  # a dedupe mark went on with the run, if it did
        raise Ignore(f"{request.id} went on in a replacement: its result comes from there")
    return replayed(previous.result)


def _handed(previous: Record) -> bool:
    """Whether ``previous`` is the success of a run handed to a replacement."""
    stored = previous.result
    return isinstance(stored, dict) and isinstance(stored.get(REPLACED), dict)
