"""Forgetting what ``once`` keeps: :func:`forget`, for an app's own code (a refund whose
charge is due again) and for ``celery-dlock forget``.

The success forgotten is the one kept when the call looks, by the token of the lease that
kept it: a success kept since by another run is left alone. The successes the task's
replacements kept (``Task.replace``, the pages of a sync: ``NAME (replacement N)``) go with
it: a new run's pages would replay them instead of running. The act is recorded on the key
as ``forgotten``, with what was forgotten, by whom and why, beside the records of the runs.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from celery_dlock.backends.base import LockBackend
from celery_dlock.errors import BackendError
from celery_dlock.keys import replacement_name, validate_key
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token, truncate_utf8

__all__ = ["STEPS", "forget", "kept_steps"]

#: Replacements looked up, one nesting deeper each (a ``once`` duplicate reads as many).
STEPS = 64


def forget(
    backend: LockBackend,
    key: str,
    task_name: str,
    *,
    reason: str = "no reason given",
    by: str | None = None,
    token: str | None = None,
) -> Record | None:
    """Forget the success ``once`` keeps for ``task_name`` on ``key``, and those of its
    replacements, so that the next run of the task on the key runs its body again.

    Args:
        key: the full key (``job:order:42``).
        task_name: the task's Celery name.
        reason: kept in the record.
        by: who forgot it, kept in the record (default: this process's holder).
        token: forget only the success kept by the lease with this token (the one an
            operator was shown); another is left alone.

    Returns:
        The ``forgotten`` record written on the key, or None when no success (or not
        ``token``'s) was kept: then nothing changed.

    Raises:
        BackendError: the store failed. A forget whose answer was lost is read back (a
            success found gone is recorded as forgotten); once the success is forgotten,
            an error says so, and what may be kept still.
    """
    validate_key(key)
    kept = backend.last_success(key, task_name)
    if kept is None or (token is not None and kept.lease.token != token):
        return None
    steps = kept_steps(backend, key, task_name)
    try:
        if not backend.forget_success(key, task_name, kept.lease.token):
            return None  # forgotten by another, meanwhile
    except BackendError as exc:
        _read_back(backend, kept, task_name, exc)
        reason = f"{reason} (the store's answer was lost; found forgotten on reading back)"
    try:
        return _recorded(backend, kept, task_name, steps, reason=reason, by=by)
    except BackendError as exc:
        # The success is gone already: the error must not read as "nothing happened".
        left = (
            f"; the successes of {', '.join(steps)} may be kept still (forget each by its "
            "name as the task)"
            if steps
            else ""
        )
        message = (
            f"the success of {task_name} on {key!r} kept by fence {kept.fence} was forgotten, "
            f"but the store failed and the act is not recorded ({exc.message}){left}; "
            f"forgotten for: {reason}"
        )
        raise BackendError(message, exc.backend) from exc


def _read_back(backend: LockBackend, kept: Record, task_name: str, failed: BackendError) -> None:
    """After ``forget_success`` of ``kept`` failed (its answer lost, say): return if the
    success is gone on reading back, as the failed call may have made it; else raise."""
    try:
        now = backend.last_success(kept.key, task_name)
    except BackendError as exc:
        message = (
            f"the store failed while forgetting the success of {task_name} on {kept.key!r} "
            f"kept by fence {kept.fence} ({failed.message}), and on reading it back: it may "
            "be forgotten, unrecorded. Run forget again: 'no success kept' then means it was"
        )
        raise BackendError(message, exc.backend) from failed
    if now is not None and now.lease.token == kept.lease.token:
        raise failed  # still kept: nothing changed


def _recorded(
    backend: LockBackend,
    kept: Record,
    task_name: str,
    steps: dict[str, str],
    *,
    reason: str,
    by: str | None,
) -> Record:
    """Forget the successes of the replacements (``steps``) of ``kept``, the success of
    ``task_name`` just forgotten, and write the record of it all; that record."""
    key = kept.key
    gone = [name for name, step in steps.items() if backend.forget_success(key, name, step)]
    now = time.time()
    lease = Lease(key, new_token(), 0, Holder.current(), now)
    # With its offset: the record is read on other hosts, in other time zones.
    released = datetime.fromtimestamp(kept.released_at, timezone.utc).isoformat(" ", "seconds")
    also = f" and those of {', '.join(gone)}" if gone else ""
    details = (
        f"the success of {task_name} kept by fence {kept.fence} (task id "
        f"{kept.lease.holder.task_id}, released {released}){also} forgotten"
        f"{'' if by is None else f' by {by}'}: {reason}"
    )
    # Bounded as every record's details are (a pasted reason can be long): head and tail.
    record = Record(lease, now, Outcome.FORGOTTEN, "forgotten", truncate_utf8(details))
    backend.add_record(record)
    return record


def kept_steps(backend: LockBackend, key: str, task_name: str) -> dict[str, str]:
    """The successes kept by ``task_name``'s replacements on ``key``: the token of the
    lease that kept each, by name, one nesting deeper each, up to the first not kept."""
    steps: dict[str, str] = {}
    for nesting in range(1, STEPS + 1):
        name = replacement_name(task_name, nesting)
        step = backend.last_success(key, name)
        if step is None:
            break
        steps[name] = step.lease.token
    return steps
