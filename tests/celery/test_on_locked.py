"""A busy key: the ``on_locked`` policies (retry, skip, fail, a callable), ``lock_wait``,
a direct or eager call; and in a real prefork worker, concurrent submissions that run one at
a time and a redelivered message that never runs a second body at once."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import kombu
import pytest
from celery import Celery, signals

from celery_dlock import (
    Holder,
    LockNotAcquiredError,
    LockTimeoutError,
    Outcome,
)
from celery_dlock.backends.memory import MemoryBackend
from tests.celery import embedded_tasks as tasks
from tests.celery.prefork import Worker, assert_never_overlapping, bodies, running
from tests.celery.support import new_run
from tests.support import eventually


def hold(store: MemoryBackend, key: str) -> Any:
    lease = store.try_acquire(key, Holder.current(task_id="blocker", task_name="t.block"), None)
    assert lease is not None
    return lease


@pytest.mark.usefixtures("app")
def test_skip_finishes_the_task_and_records_skipped_with_the_holder(store: MemoryBackend) -> None:
    run = new_run()
    blocker = hold(store, f"job:busy:{run}")
    assert tasks.skip.delay(run).get(timeout=10) is None
    assert tasks.SEEN[run] == []
    [record] = store.history(key=f"job:busy:{run}")
    assert record.outcome is Outcome.SKIPPED and record.problem == "locked"
    assert record.details is not None and "t.block[blocker]" in record.details
    assert f"fence {blocker.fence}" in record.details
    assert record.lease.holder.task_name == "t.skip"
    held = store.get(f"job:busy:{run}")
    assert held is not None and held.token == blocker.token


@pytest.mark.usefixtures("app")
def test_fail_raises_lock_not_acquired_through_the_result_backend(store: MemoryBackend) -> None:
    run = new_run()
    hold(store, f"job:busy:{run}")
    with pytest.raises(LockNotAcquiredError) as info:
        tasks.fail.delay(run).get(timeout=10)
    assert info.value.key == f"job:busy:{run}"
    assert info.value.holder is not None and "t.block[blocker]" in info.value.holder
    assert tasks.SEEN[run] == []


@pytest.mark.usefixtures("app")
def test_lock_wait_takes_a_key_freed_within_it_without_requeueing(store: MemoryBackend) -> None:
    run = new_run()
    blocker = hold(store, f"job:busy:{run}")
    result = tasks.patient.delay(run)
    time.sleep(0.3)
    assert tasks.SEEN[run] == []  # waiting on the held key
    store.release(blocker, Outcome.SUCCEEDED)
    assert result.get(timeout=30) == "ran"
    [seen] = tasks.SEEN[run]
    assert seen["retries"] == 0 and seen["fence"] > blocker.fence  # this attempt took it


@pytest.mark.usefixtures("app")
def test_lock_wait_gives_up_no_earlier_than_its_wait(store: MemoryBackend) -> None:
    run = new_run()
    hold(store, f"job:busy:{run}")
    started = time.monotonic()
    with pytest.raises(LockTimeoutError) as info:
        tasks.impatient.delay(run).get(timeout=30)
    assert time.monotonic() - started >= 0.5
    assert info.value.key == f"job:busy:{run}" and info.value.wait == 0.5
    assert tasks.SEEN[run] == []


@pytest.mark.usefixtures("app")
def test_retry_requeues_until_free_without_eating_max_retries(store: MemoryBackend) -> None:
    run = new_run()
    blocker = hold(store, f"job:busy:{run}")
    retries: list[Any] = []

    def count(sender: Any = None, request: Any = None, reason: Any = None, **_: Any) -> None:
        if sender.name == "t.requeue" and request.args[0] == run:
            retries.append(reason)

    signals.task_retry.connect(count, weak=False)
    try:
        result = tasks.requeue.delay(run)
        eventually(lambda: len(retries) >= 3, "three busy re-queues")
        assert tasks.SEEN[run] == []
        store.release(blocker, Outcome.SUCCEEDED)
        assert result.get(timeout=15) == 0  # max_retries=0, yet it ran after the re-queues
    finally:
        signals.task_retry.disconnect(count)
    assert all(isinstance(reason.exc, LockNotAcquiredError) for reason in retries)
    assert [s["retries"] for s in tasks.SEEN[run]] == [0]


@pytest.mark.usefixtures("app")
def test_callable_on_locked_decides_the_result(store: MemoryBackend) -> None:
    run = new_run()
    blocker = hold(store, f"job:busy:{run}")
    assert tasks.custom.delay(run).get(timeout=10) == {
        "busy": f"job:busy:{run}",
        "fence": blocker.fence,
    }


@pytest.mark.usefixtures("app")
def test_a_direct_call_on_a_busy_key_raises_instead_of_requeueing(store: MemoryBackend) -> None:
    run = new_run()
    hold(store, f"job:busy:{run}")
    with pytest.raises(LockNotAcquiredError):
        tasks.requeue(run)
    assert tasks.SEEN[run] == []


def test_eager_busy_key_raises_instead_of_requeueing(eager: tuple[Celery, dict[str, Any]]) -> None:
    _, calls = eager
    order = new_run()
    store = MemoryBackend.from_url("memory://eager-tests")
    assert store.try_acquire(f"job:busy:{order}", Holder.current(), None) is not None
    with pytest.raises(LockNotAcquiredError):
        calls["busy"].delay(order).get()
    assert [run for run in calls["runs"] if run[1] == order] == []


@pytest.mark.slow
def test_twenty_concurrent_submissions_run_one_at_a_time(worker: Worker) -> None:
    order = int(uuid.uuid4().int % 10**9)
    results = [worker.tasks.serial.delay(order, n) for n in range(20)]
    for result in results:
        result.get(timeout=120)
    events = bodies(worker, f"job:serial:{order}")
    assert len(events) == 40  # all 20 ran...
    assert_never_overlapping(events)  # ...never two at once


@pytest.mark.slow
@pytest.mark.skipif(
    kombu.VERSION < (5, 7),
    reason="kombu before 5.7 has no unacked_restore_interval: it restores unacked messages "
    "every 10 s, after the body has ended, so no second delivery comes to be refused",
)
def test_acks_late_redelivery_never_runs_a_second_body_at_once(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    # A visibility timeout shorter than the body: Redis hands the same message (same task
    # id) to another child while the first attempt still runs.
    with running(tmp_path, redis_url, lock_url, DLOCK_TEST_VISIBILITY="1") as late:
        order = uuid.uuid4().hex[:8]
        key = f"job:late:{order}"
        result = late.tasks.late.delay(order, 6)
        skipped = eventually(
            lambda: next((r for r in late.history(key) if r.outcome is Outcome.SKIPPED), None),
            "a redelivered attempt refused by the lock",
        )
        assert skipped.lease.holder.task_id == result.id  # the same task id, a new attempt
        events = bodies(late, key)
        eventually(lambda: len(bodies(late, key)) >= 2, "the first body to end")
        events = bodies(late, key)
        assert_never_overlapping(events[:2])
        first_token = events[0][1]
        assert skipped.lease.token != first_token


@pytest.mark.slow
def test_lock_limit_runs_at_most_that_many_bodies_at_once_each_in_its_slot(
    worker: Worker,
) -> None:
    tenant = uuid.uuid4().hex[:8]
    results = [worker.tasks.pooled.delay(tenant, n) for n in range(6)]
    for result in results:
        result.get(timeout=120)
    events = [e for e in worker.events() if (e["key"] or "").startswith(f"job:pool:{tenant}#")]
    assert len(events) == 12  # all six ran
    at_once, most = 0, 0
    for event in events:  # the ledger is written in order, under a file lock
        at_once += 1 if event["event"] == "start" else -1
        most = max(most, at_once)
    assert most == 2  # never more than lock_limit at once, and the limit was used
    slots = {
        r.key for r in worker.store.history(limit=None) if r.key.startswith(f"job:pool:{tenant}")
    }
    assert slots == {f"job:pool:{tenant}#0", f"job:pool:{tenant}#1"}
