"""Dedupe marks held for a message that has already run, found and released by the janitor.

A store that loses a mark's *release* brings the mark back, held for a message that has
already run: every call of its key is then coalesced into that message, with no run after
it, until the mark's ``dedupe_ttl`` ends (an hour by default). A Redis restarted from its
snapshot or from an AOF written every second does that, and so does a failover without
``replicas=N``. The janitor (``reap``'s ``marks``) releases such marks by their token,
recorded ``forced``; so does the operator's ``celery-dlock marks --release-ran``, which
looks further (the slots of a key taken with a limit, and without the janitor's bounds).

A message has run when the last body lease of its task id on the mark's lock key ended in a
way that ends the task: ``succeeded``, ``failed``, ``revoked`` or ``skipped``
(:data:`FINISHED`). Not ``retried``, a success that handed the run to a ``Task.replace``
replacement, nor a ``Reject`` that put the message back (the same task goes on under its
id: :func:`~celery_dlock.records.goes_on`), nor ``disconnected``, ``expired``, ``lost`` or
``abandoned`` (its message may be delivered again).

The janitor's check is bounded and careful, as a run every 30 s must be:

- at most ``sample`` marks a run, chosen at random among those held (a queue of many
  legitimate marks does not hide a stale one for good), each one history query of its lock
  key (its newest :data:`RECENT` records since the mark's grant);
- a body lease of the task id held now on the lock key leaves the mark alone;
- the run must have been granted after the mark (:data:`SKEW` allowed for clocks of
  different hosts): a task id used again by a later message is not taken for its run;
- and it must have ended more than :data:`GRACE` seconds ago: the worker releases an
  ``until_finished`` mark just after its body's record, and keeps a release the store
  refused for its next one; the janitor leaves that to it.
"""

from __future__ import annotations

import random

from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.common import store_now
from celery_dlock.keys import MARK, is_mark, slot_of
from celery_dlock.records import Lease, Outcome, Record, goes_on

__all__ = [
    "FINISHED", "GRACE", "RECENT", "SKEW", "bodies_held", "ended_task", "last_run", "lock_key_of",
    "ran_marks", "release_ran",
]  # fmt: skip

#: How a body lease ends when its task has run for good.
FINISHED = frozenset({Outcome.SUCCEEDED, Outcome.FAILED, Outcome.REVOKED, Outcome.SKIPPED})
#: Seconds after its run's end before the janitor takes a mark for one whose release was lost.
GRACE = 300.0
#: Seconds a run's grant may seem to come before its mark's, on the clocks of two hosts.
SKEW = 5.0
#: Records of a lock key the janitor reads per mark.
RECENT = 50


def ended_task(record: Record) -> bool:
    """Whether ``record``, of a task's body lease, ended the task."""
    return record.outcome in FINISHED and not goes_on(record)


def lock_key_of(mark: Lease) -> str | None:
    """The lock key whose message ``mark`` is held for, if it is a dedupe mark."""
    task_name = mark.holder.task_name
    if task_name is None or mark.holder.task_id is None or not is_mark(mark.key, task_name):
        return None
    return mark.key[: -len(MARK + task_name)]


def bodies_held(
    backend: LockBackend,
    listed: list[Lease],
    prefix: str,
    mark: Lease,
    lock_key: str,
    *,
    slots: bool,
) -> list[Lease]:
    """The body leases of ``mark``'s task id held now on ``lock_key`` (and, with ``slots``,
    on its slots), from ``listed`` (the leases under ``prefix``) where it holds them."""
    # A mark's key begins with its lock key: the listing under ``prefix`` already holds the
    # body's leases when the lock key begins with ``prefix`` too.
    held = listed if lock_key.startswith(prefix) else backend.leases(lock_key)
    return [
        lease
        for lease in held
        if (lease.key == lock_key or (slots and slot_of(lease.key, lock_key)))
        and lease.holder.task_id == mark.holder.task_id
    ]


def last_run(records: list[Record], mark: Lease) -> Record | None:
    """The newest of ``records`` (newest first) of ``mark``'s task id."""
    return next((r for r in records if r.lease.holder.task_id == mark.holder.task_id), None)


def ran_marks(
    backend: LockBackend, prefix: str, *, sample: int, grace: float | None = None
) -> list[tuple[Lease, Record]]:
    """Marks under ``prefix`` held for a message that ended at least ``grace`` seconds ago
    (default :data:`GRACE`), at most ``sample`` looked at, each with the record of its run."""
    grace = GRACE if grace is None else grace
    listed = backend.leases(prefix)
    marks = [(lease, key) for lease in listed if (key := lock_key_of(lease)) is not None]
    if len(marks) > sample:
        marks = random.sample(marks, sample)
    now = store_now(backend)
    found = []
    for mark, lock_key in marks:
        if bodies_held(backend, listed, prefix, mark, lock_key, slots=False):
            continue  # its body runs now
        since = mark.acquired_at - SKEW
        last = last_run(backend.history(key=lock_key, since=since, limit=RECENT), mark)
        if (
            last is not None
            and ended_task(last)
            and last.lease.acquired_at >= since
            and now - last.released_at >= grace
        ):
            found.append((mark, last))
    return found


def release_ran(backend: LockBackend, found: list[tuple[Lease, Record]], by: str) -> list[Record]:
    """Release each mark of ``found`` by its token, recorded ``forced`` with ``by`` (who, and
    how) and the run it was held for; the records (a mark taken since is left alone)."""
    records = []
    for mark, ran in found:
        details = (
            f"released by {by}: its message {mark.holder.task_id} had run "
            f"({ran.outcome} on {ran.key})"
        )
        record = backend.release(mark, Outcome.FORCED, "forced", details)
        if record is not None:
            records.append(record)
    return records
