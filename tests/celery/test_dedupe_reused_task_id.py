"""``dedupe`` when callers choose their own task ids and reuse them (``apply_async(task_id=
"sync-42")``, for idempotency), with a real prefork worker on a Redis broker, on the
Postgres and file lock stores: the worker's parent, cleaning up after a message (a child
that died, an expired message it discarded), releases only the mark that message carried
(the token in its header), never a newer message's mark under the same id."""

from __future__ import annotations

import os
import signal
import uuid

import celery
import pytest
import redis

from celery_dlock import Outcome
from celery_dlock.records import Lease, Record
from tests.celery.prefork import BROKER_DB, Worker
from tests.celery.test_dedupe import customer, mark_of, marks, started
from tests.support import eventually, force_release

pytestmark = pytest.mark.slow


def _parked() -> str:
    """A queue no worker reads: a message sent there stays queued."""
    return f"parked-{uuid.uuid4().hex[:8]}"


def _held(worker: Worker, key: str) -> Lease:
    mark = worker.store.get(key)
    assert mark is not None, f"no mark on {key}"
    return mark


def _tidy(worker: Worker, key: str, *queues: str) -> None:
    force_release(worker.store, key, "the test is over")
    redis.Redis(host="127.0.0.1", port=6379, db=BROKER_DB).delete(*queues)


@pytest.mark.xfail(
    celery.VERSION < (5, 7),
    reason="Celery before 5.7 gives a dead child's parent no request (celery/celery#9720): "
    "it releases the mark held under the task id, a newer message's here (signals.py)",
    raises=AssertionError,
    strict=True,
)
def test_a_dead_childs_parent_leaves_the_mark_of_a_newer_message_with_the_same_id(
    worker: Worker,
) -> None:
    """The first message runs (its ``until_started`` mark ends ``dequeued``); a second one
    with the same id and key is queued and takes a mark; then the first one's child dies,
    and its parent cleans up after it. The second message's mark must stay: released, the
    next call would queue a duplicate behind the queued second message."""
    who = customer()
    task_id = f"sync-{who}"
    key = mark_of("w.sync", f"sync:{who}")
    sync = worker.tasks.sync
    parked = _parked()
    try:
        assert sync.apply_async((who, 600), task_id=task_id).id == task_id
        body = started(worker, task_id)
        [first] = marks(worker, key, 1)
        assert first.outcome is Outcome.DEQUEUED and first.lease.holder.task_id == task_id
        assert sync.apply_async((who, 0), task_id=task_id, queue=parked).id == task_id
        second = _held(worker, key)
        assert second.holder.task_id == task_id and second.token != first.lease.token

        os.kill(body["pid"], signal.SIGKILL)
        # The parent releases the dead body's lease after it has dealt with the mark: once
        # that record is there, the parent's clean-up of the first message is over.
        eventually(lambda: _dead_body(worker, f"job:sync:{who}", task_id), "the dead body released")

        assert _held(worker, key).token == second.token
        assert [r for r in worker.history(key) if r.lease.token == second.token] == []
        assert sync.delay(who, 0).id == task_id  # a duplicate of the queued second message
    finally:
        _tidy(worker, key, parked)


def test_an_expired_message_discarded_late_leaves_the_mark_of_a_newer_message_with_the_same_id(
    worker: Worker,
) -> None:
    """The first message (``expires``) waits in a queue no worker reads, and its mark ends
    with its expiry; a second one with the same id and key is queued and takes a mark; then
    a worker reads the first one's queue and discards it, expired. The second message's
    mark must stay."""
    who = customer()
    task_id = f"sync-{who}"
    key = mark_of("w.sync", f"sync:{who}")
    sync = worker.tasks.sync
    late, parked = _parked(), _parked()
    try:
        assert sync.apply_async((who, 0), task_id=task_id, queue=late, expires=1).id == task_id
        first = _held(worker, key)
        assert first.holder.task_id == task_id

        def second_sent() -> Lease | None:
            """Coalesced into the first message until its mark ends, then sent once."""
            assert sync.apply_async((who, 0), task_id=task_id, queue=parked).id == task_id
            mark = worker.store.get(key)
            return mark if mark is not None and mark.token != first.token else None

        second = eventually(second_sent, "a second message sent once the first mark expired")
        assert second.holder.task_id == task_id
        [ended] = [r for r in worker.history(key) if r.lease.token == first.token]
        assert ended.outcome is Outcome.EXPIRED
        # Behind the expired message in its queue: the worker's main thread handles a queue's
        # messages in order, so once this one's body ran, the discard had been dealt with.
        after = worker.tasks.hold.apply_async((f"after-{who}", 0), queue=late)

        replies = worker.app.control.add_consumer(late, destination=[worker.hostname], reply=True)
        assert replies, "the worker did not answer add_consumer"
        try:
            after.get(timeout=60)
            assert sync.AsyncResult(task_id).state == "REVOKED"  # discarded, expired
        finally:
            worker.app.control.cancel_consumer(late, destination=[worker.hostname], reply=True)

        assert _held(worker, key).token == second.token
        assert [r for r in worker.history(key) if r.lease.token == second.token] == []
        assert sync.delay(who, 0).id == task_id  # a duplicate of the queued second message
    finally:
        _tidy(worker, key, late, parked)


def _dead_body(worker: Worker, key: str, task_id: str) -> Record | None:
    """The record of ``task_id``'s body lease released by the worker's parent (its problem
    names the signal's exception; a store ending a dead holder's lease itself would not)."""
    return next(
        (
            r
            for r in worker.history(key)
            if r.outcome is Outcome.DISCONNECTED
            and r.problem == "WorkerLostError"
            and r.lease.holder.task_id == task_id
        ),
        None,
    )
