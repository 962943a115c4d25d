"""A producer that is itself a task in a pool child, cut by its own soft time limit after
its ``apply_async`` sent a ``dedupe`` message and before the mark was handed over to the
message: the mark stayed with the producer's short lease (``SEND_TTL``, 60 s) while the
message was queued, so that a duplicate could be queued a minute later. Cut inside the
send, after the broker took the message, the mark was released as a failed send while the
message stayed queued. The limit now waits for the send and the hand-over
(``celery_dlock.critical``) and is raised after them."""

from __future__ import annotations

import signal
import sys
import time
import uuid

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Task

from celery_dlock import LockedTask
from celery_dlock.celery import dedupe
from celery_dlock.celery.settings import backend_for
from tests.celery.test_soft_limit_release import plain_app
from tests.support.cuts import arm_cut
from tests.support.poolchild import pool_child

__all__ = ["pool_child"]  # the fixture: this process as a pool child's

DEDUPE_TTL = 600.0


@pytest.mark.usefixtures("pool_child")
@pytest.mark.parametrize("where", ["hand-over", "send"])
def test_a_producer_s_soft_limit_after_its_send_waits_for_the_hand_over(where: str) -> None:
    app = plain_app("soft-producer")
    app.conf.update(broker_url="memory://", task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    store = backend_for(app)

    @app.task(base=LockedTask, shared=False, name="d.pay", lock_key="pay:{n}",
              dedupe="until_started", dedupe_ttl=DEDUPE_TTL)  # fmt: skip
    def pay(n: int) -> int:
        return n

    armed: list[list[str]] = []
    # Task.add_trail: what Celery's send_task calls in a task once the broker took the
    # message (a signal's receiver would not do: Celery logs what a receiver raises).
    cut = dedupe._hand_over if where == "hand-over" else Task.add_trail

    @app.task(shared=False, name="d.enqueue")
    def enqueue(n: int) -> str:
        armed.append(arm_cut(cut, signal.SIGUSR1))  # in the send, or as the hand-over starts
        try:
            return str(pay.apply_async((n,)).id)
        finally:
            sys.setprofile(None)

    failed = enqueue.apply((7,))
    assert armed == [[cut.__qualname__]]
    assert isinstance(failed.result, SoftTimeLimitExceeded)  # raised, after the hand-over
    mark = store.get(dedupe.mark_key("job:pay:7", "d.pay"))
    assert mark is not None and mark.expires_at is not None
    left = mark.expires_at - time.time()
    assert left > dedupe.SEND_TTL, f"the mark ends in {left:.0f} s: not handed over"
    assert left <= DEDUPE_TTL + 1
    # The message is queued: the next apply_async is a duplicate, nothing sent.
    assert pay.apply_async((7,)).id == mark.holder.task_id
    store.close()
