"""A worker can take a dedupe mark's message before its producer has handed the mark over
(the producer does it once the broker has the message). The worker lengthens the mark of a
message with ``expires`` to ``dedupe_ttl`` as it takes it; the producer's hand-over, for
the message's shorter ``expires``, came after it and cut the mark of the running task back
to 31 s (found by CI: ``test_a_message_taken_before_its_expiry_keeps_its_until_finished_
mark_while_it_runs``). Here the worker's step runs inside the publish, deterministically,
on a real store; ``LockBackend.hand_over`` now never shortens a lease.

A mark a worker released before the hand-over (an ``until_started`` body started within
milliseconds) is no trouble: the producer no longer warns that "a duplicate may be sent",
which it did for every such fast start; a mark that expired while its message was being
sent still warns."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_dlock import Lease, LockedTask, Outcome
from celery_dlock.celery.dedupe import DEDUPE_HEADER, EXPIRY_GRACE, extend_mark, mark_key
from celery_dlock.celery.settings import backend_for
from tests.celery.test_dedupe_retry_race import DEDUPE_TTL, app

__all__ = ["app"]  # the fixture: an app on the lock store, with dlock_dedupe_ttl


def test_the_producers_late_hand_over_keeps_the_mark_a_worker_lengthened(app: Celery) -> None:
    @app.task(base=LockedTask, lock_key="report:{who}", dedupe="until_finished", shared=False)
    def report(who: str) -> None: ...

    backend = backend_for(app)
    taken: list[Lease] = []

    def a_worker_takes_it(sender: str, headers: dict[str, Any], **_: Any) -> None:
        if sender == report.name:  # as run_marked does for a message with expires
            mark = Lease.from_dict(headers[DEDUPE_HEADER])
            lengthened = backend.hand_over(mark, DEDUPE_TTL)
            assert lengthened is not None
            taken.append(lengthened)

    who = uuid.uuid4().hex[:10]
    before_task_publish.connect(a_worker_takes_it, weak=False)
    try:
        sent = report.apply_async((who,), expires=30)
    finally:
        before_task_publish.disconnect(a_worker_takes_it)
    [lengthened] = taken
    mark = backend.get(mark_key(f"job:report:{who}", report.name))
    assert mark is not None and mark.holder.task_id == sent.id
    assert mark.token == lengthened.token
    assert mark.expires_at is not None
    assert mark.expires_at - time.time() > DEDUPE_TTL - 60  # was 30 + EXPIRY_GRACE
    assert EXPIRY_GRACE < 60


def test_the_producers_late_hand_over_keeps_the_mark_a_worker_shortened(app: Celery) -> None:
    """Found by CI (``test_a_replacement_with_expires_that_no_worker_sees_lets_the_next_call_
    send``): a worker ran the first page and handed the mark to its replacement, sent with
    ``expires=2``, shortening the mark to that; the producer's hand-over came after it and
    put back ``dedupe_ttl``, so the mark outlived the replacement that expired unseen by an
    hour. The producer's hand-over now leaves an end a worker set."""

    @app.task(base=LockedTask, lock_key="paged:{who}", dedupe="until_finished", shared=False)
    def paged(who: str) -> None: ...

    shortened: list[Lease] = []

    def a_worker_replaces_it(sender: str, headers: dict[str, Any], **_: Any) -> None:
        if sender == paged.name and not shortened:  # as replacing.hand_mark does
            mark = Lease.from_dict(headers[DEDUPE_HEADER])
            extend_mark(paged, mark, 2 + EXPIRY_GRACE, shorten=True)
            shortened.append(mark)

    who = uuid.uuid4().hex[:10]
    before_task_publish.connect(a_worker_replaces_it, weak=False)
    try:
        sent = paged.apply_async((who,))  # its mark: dedupe_ttl
    finally:
        before_task_publish.disconnect(a_worker_replaces_it)
    [handed] = shortened
    mark = backend_for(app).get(mark_key(f"job:paged:{who}", paged.name))
    assert mark is not None and mark.token == handed.token and mark.holder.task_id == sent.id
    assert mark.expires_at is not None
    assert mark.expires_at - time.time() < 2 + EXPIRY_GRACE  # was DEDUPE_TTL


def test_a_mark_a_worker_released_before_the_hand_over_is_not_reported(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    @app.task(base=LockedTask, lock_key="sync:{who}", dedupe="until_started", shared=False)
    def sync(who: str) -> None: ...

    backend = backend_for(app)

    def a_worker_starts_it(sender: str, headers: dict[str, Any], **_: Any) -> None:
        if sender == sync.name:  # as an until_started body does when it starts
            mark = Lease.from_dict(headers[DEDUPE_HEADER])
            assert backend.release(mark, Outcome.DEQUEUED, None, "started on w1") is not None

    who = uuid.uuid4().hex[:10]
    before_task_publish.connect(a_worker_starts_it, weak=False)
    try:
        with caplog.at_level(logging.DEBUG, logger="celery_dlock.dedupe"):
            sent = sync.delay(who)
    finally:
        before_task_publish.disconnect(a_worker_starts_it)
    key = mark_key(f"job:sync:{who}", sync.name)
    [record] = backend.history(key=key)
    assert record.outcome is Outcome.DEQUEUED and record.lease.holder.task_id == sent.id
    assert backend.get(key) is None
    [line] = [r for r in caplog.records if r.name == "celery_dlock.dedupe"]
    assert line.levelno == logging.DEBUG, line.getMessage()
    assert "dequeued before its producer handed it over: started on w1" in line.getMessage()


def test_a_mark_that_expired_while_its_message_was_sent_is_reported(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    @app.task(base=LockedTask, lock_key="sync:{who}", dedupe="until_started", shared=False)
    def sync(who: str) -> None: ...

    def a_slow_broker(sender: str, **_: Any) -> None:
        if sender == sync.name:  # the mark lives expires + EXPIRY_GRACE while it is sent
            time.sleep(0.01 + EXPIRY_GRACE + 0.3)

    who = uuid.uuid4().hex[:10]
    before_task_publish.connect(a_slow_broker, weak=False)
    try:
        with caplog.at_level(logging.DEBUG, logger="celery_dlock.dedupe"):
            sync.apply_async((who,), expires=0.01)
    finally:
        before_task_publish.disconnect(a_slow_broker)
    [line] = [r for r in caplog.records if r.name == "celery_dlock.dedupe"]
    assert line.levelno == logging.WARNING
    message = line.getMessage()
    assert f"job:sync:{who}" in message and "a duplicate may be sent" in message
    assert "(expired" in message  # recorded expired (file), or not yet recorded (Postgres)
