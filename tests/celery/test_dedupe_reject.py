"""An ``until_finished`` body that raises ``Reject(requeue=True)`` (``acks_late``) puts its
message back on the queue: the same message, with the same mark in its header, runs again.
The mark used to be released ``failed`` as the body ended, so while the message waited to
run again a duplicate was sent: two messages queued for one key, the promise of
``until_finished`` (one queued or running) broken. The mark is kept for the message that
comes back, as for a retry; a ``Reject`` that drops the message (``requeue=False``) still
ends it. The same holds for an ``until_started`` message put back before its body started
(an ``on_locked`` callable that rejects it while the key is busy): it ran nothing, and its
mark was released ``failed`` all the same. A real embedded worker, on a real store."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Reject

from celery_dlock import Lock, LockedTask, Outcome
from celery_dlock.celery.dedupe import DEDUPE_HEADER, mark_key
from celery_dlock.celery.settings import backend_for
from tests.celery.support import embedded_worker
from tests.celery.test_dedupe_retry_race import app
from tests.support import eventually

__all__ = ["app"]  # the fixture: an app on the lock store, for an embedded worker

pytestmark = pytest.mark.slow


#: (requeue, acks_late): only a message not acknowledged yet is put back on the queue.
REJECTS = {"back": (True, True), "dropped": (False, True), "acked already": (True, False)}


@pytest.mark.parametrize("reject", REJECTS)
def test_a_message_rejected_back_to_the_queue_keeps_its_mark(app: Celery, reject: str) -> None:
    requeue, acks_late = REJECTS[reject]
    back = requeue and acks_late
    seen: list[tuple[int, bool, str]] = []  # (run, mark held, id a duplicate call got)

    @app.task(
        base=LockedTask,
        bind=True,
        lock_key="sync:{who}",
        dedupe="until_finished",
        acks_late=acks_late,
        shared=False,
    )
    def sync(self: Any, who: str) -> None:
        mark = getattr(self.request, DEDUPE_HEADER)["token"]
        held = backend_for(app).get(mark_key(f"job:sync:{who}", sync.name))
        duplicate = sync.apply_async((who,), countdown=3600).id
        seen.append((len(seen), held is not None and held.token == mark, duplicate))
        if len(seen) == 1:
            raise Reject("not now", requeue=requeue)

    who = uuid.uuid4().hex[:10]
    key = mark_key(f"job:sync:{who}", sync.name)
    with embedded_worker(app, pool="solo"):
        sent = sync.delay(who)
        if back:
            eventually(lambda: len(seen) == 2 or None, "the message ran again")
        else:
            eventually(lambda: backend_for(app).history(key=key) or None, "the mark's end")
    assert seen[0] == (0, True, sent.id)
    if not back:  # dropped: the mark ends with it
        [record] = backend_for(app).history(key=key)
        assert record.outcome is Outcome.FAILED and record.lease.holder.task_id == sent.id
        return
    assert seen[1] == (1, True, sent.id), "the mark went while the message was back in the queue"
    [record] = eventually(lambda: backend_for(app).history(key=key) or None, "the mark's end")
    assert record.outcome is Outcome.SUCCEEDED and record.lease.holder.task_id == sent.id


def test_an_until_started_message_rejected_back_before_its_body_keeps_its_mark(
    app: Celery,
) -> None:
    seen: list[bool] = []  # at each call of on_locked: the message's mark still held

    def put_back(task: Any, key: str, lease: Any) -> None:
        mark = getattr(task.request, DEDUPE_HEADER)["token"]
        held = backend_for(app).get(mark_key(key, task.name))
        seen.append(held is not None and held.token == mark)
        if len(seen) == 1:
            raise Reject("busy: back to the queue", requeue=True)

    @app.task(
        base=LockedTask,
        lock_key="sync:{who}",
        dedupe="until_started",
        acks_late=True,
        on_locked=put_back,
        shared=False,
    )
    def sync(who: str) -> None: ...

    who = uuid.uuid4().hex[:10]
    key = mark_key(f"job:sync:{who}", sync.name)
    with (
        Lock(backend_for(app), f"job:sync:{who}"),
        embedded_worker(app, pool="solo"),
    ):
        sent = sync.delay(who)
        eventually(lambda: len(seen) == 2 or None, "the message came back")
        [record] = eventually(lambda: backend_for(app).history(key=key) or None, "its end")
    assert seen == [True, True], "the mark went while the message was back in the queue"
    assert record.outcome is Outcome.SKIPPED and record.lease.holder.task_id == sent.id
