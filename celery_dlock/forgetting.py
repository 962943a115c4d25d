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
from datetime import datetime

from celery_dlock.backends.base import LockBackend
from celery_dlock.keys import replacement_name, validate_key
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token

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
    """
    validate_key(key)
    kept = backend.last_success(key, task_name)
    if kept is None or (token is not None and kept.lease.token != token):
        return None
    steps = kept_steps(backend, key, task_name)
    if not backend.forget_success(key, task_name, kept.lease.token):
        return None  # forgotten by another, meanwhile
    gone = [name for name, step in steps.items() if backend.forget_success(key, name, step)]
    now = time.time()
    lease = Lease(key, new_token(), 0, Holder.current(), now)
    released = datetime.fromtimestamp(kept.released_at).isoformat(" ", "seconds")
    also = f" and those of {', '.join(gone)}" if gone else ""
    details = (
        f"the success of {task_name} kept by fence {kept.fence} (task id "
        f"{kept.lease.holder.task_id}, released {released}){also} forgotten"
        f"{'' if by is None else f' by {by}'}: {reason}"
    )
    record = Record(lease, now, Outcome.FORGOTTEN, "forgotten", details)
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
