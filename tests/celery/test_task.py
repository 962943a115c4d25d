"""LockedTask semantics through an embedded worker (a real Celery worker in a thread)."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import pytest
from celery import signals
from celery.exceptions import Retry

from celery_dlock import (
    ConfigurationError,
    Holder,
    LockedTask,
    LockKeyError,
    LockLostError,
    LockNotAcquiredError,
    LockTimeoutError,
    Outcome,
)
from celery_dlock.backends.memory import MemoryBackend
from tests.celery import embedded_tasks as tasks
from tests.support import eventually, force_release

pytestmark = pytest.mark.usefixtures("app")


def new_run() -> str:
    return uuid.uuid4().hex[:12]


def outcomes(store: MemoryBackend, key: str) -> list[Outcome]:
    return [record.outcome for record in reversed(store.history(key=key))]


# -- the key and the lease ------------------------------------------------------------------


def test_success_holds_the_namespaced_key_and_records_succeeded(store: MemoryBackend) -> None:
    run = new_run()
    assert tasks.refund.delay(run).get(timeout=10) == "refunded"
    [seen] = tasks.SEEN[run]
    assert seen["key"] == f"job:order:{run}" and seen["fence"] >= 1
    [record] = store.history(key=f"job:order:{run}")
    assert record.outcome is Outcome.SUCCEEDED
    assert record.lease.token == seen["token"]
    assert record.lease.holder.task_name == "t.refund"
    assert record.lease.holder.task_id is not None
    assert store.get(f"job:order:{run}") is None


def test_positional_and_keyword_submissions_lock_the_same_key(store: MemoryBackend) -> None:
    run = new_run()
    tasks.charge.delay(run, 5).get(timeout=10)
    assert tasks.charge.apply_async(kwargs={"run": run, "amount": 5}).get(timeout=10)
    assert len(tasks.SEEN[run]) == 1  # once: the keyword call found the positional one's key


def test_literal_template_form_works(store: MemoryBackend) -> None:
    run = new_run()
    with pytest.raises(KeyError):
        tasks.explode.delay(run).get(timeout=10)
    assert tasks.SEEN[run][0]["key"] == f"job:explode:{run}"


# -- release on every exit --------------------------------------------------------------------


def test_exception_is_recorded_failed_with_type_message_and_traceback(store: MemoryBackend) -> None:
    run = new_run()
    with pytest.raises(KeyError):
        tasks.explode.delay(run).get(timeout=10)
    [record] = store.history(key=f"job:explode:{run}")
    assert record.outcome is Outcome.FAILED
    assert record.problem == "KeyError"
    assert record.details is not None
    assert f"no such order in {run}" in record.details
    assert "Traceback" in record.details and "embedded_tasks.py" in record.details
    assert store.get(f"job:explode:{run}") is None


def test_retry_keeps_the_lock_and_the_retry_takes_it_over(store: MemoryBackend) -> None:
    run = new_run()
    key = f"job:flaky:{run}"
    result = tasks.flaky.delay(run, 2)
    assert result.get(timeout=15) == 2
    seen = tasks.SEEN[run]
    assert [s["retries"] for s in seen] == [0, 1, 2]
    fences = [s["fence"] for s in seen]
    assert fences == sorted(set(fences))
    assert outcomes(store, key) == [Outcome.RETRIED, Outcome.RETRIED, Outcome.SUCCEEDED]
    records = list(reversed(store.history(key=key)))
    assert records[0].details is not None and "continued by its retry" in records[0].details
    assert store.get(key) is None


def test_the_key_stays_held_between_an_attempt_and_its_retry(store: MemoryBackend) -> None:
    run = new_run()
    key = f"job:flaky:{run}"
    gap_holders: list[str | None] = []

    def during_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
        if sender.name == "t.flaky" and request.args and request.args[0] == run:
            lease = store.get(key)
            gap_holders.append(None if lease is None else lease.holder.task_id)
            other = store.try_acquire(key, Holder.current(), None)
            gap_holders.append("stolen" if other is not None else "refused")

    signals.task_retry.connect(during_retry, weak=False)
    try:
        result = tasks.flaky.delay(run, 1)
        assert result.get(timeout=15) == 1
    finally:
        signals.task_retry.disconnect(during_retry)
    assert gap_holders == [result.id, "refused"]


def test_without_lock_across_retries_the_attempt_releases_as_retried(store: MemoryBackend) -> None:
    run = new_run()
    key = f"job:flaky:{run}"
    assert tasks.flaky_release.delay(run, 1).get(timeout=15) == 1
    assert outcomes(store, key) == [Outcome.RETRIED, Outcome.SUCCEEDED]
    [retried, _] = reversed(store.history(key=key))
    assert retried.problem == "celery.exceptions.Retry"


def test_ignore_is_recorded_skipped(store: MemoryBackend) -> None:
    run = new_run()
    result = tasks.ignore.delay(run)
    eventually(lambda: store.history(key=f"job:ignore:{run}"), "a record")
    [record] = store.history(key=f"job:ignore:{run}")
    assert record.outcome is Outcome.SKIPPED and record.problem == "celery.exceptions.Ignore"
    assert store.get(f"job:ignore:{run}") is None
    assert not result.ready()  # Celery's own semantics for Ignore


def test_reject_is_recorded_failed(store: MemoryBackend) -> None:
    run = new_run()
    tasks.reject.delay(run)
    eventually(lambda: store.history(key=f"job:reject:{run}"), "a record")
    [record] = store.history(key=f"job:reject:{run}")
    assert record.outcome is Outcome.FAILED and record.problem == "celery.exceptions.Reject"
    assert record.details is not None and record.details.startswith("requeue=False")


# -- a busy key -----------------------------------------------------------------------------------


def hold(store: MemoryBackend, key: str) -> Any:
    lease = store.try_acquire(key, Holder.current(task_id="blocker", task_name="t.block"), None)
    assert lease is not None
    return lease


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


def test_fail_raises_lock_not_acquired_through_the_result_backend(store: MemoryBackend) -> None:
    run = new_run()
    hold(store, f"job:busy:{run}")
    with pytest.raises(LockNotAcquiredError) as info:
        tasks.fail.delay(run).get(timeout=10)
    assert info.value.key == f"job:busy:{run}"
    assert info.value.holder is not None and "t.block[blocker]" in info.value.holder
    assert tasks.SEEN[run] == []


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


def test_lock_wait_gives_up_no_earlier_than_its_wait(store: MemoryBackend) -> None:
    run = new_run()
    hold(store, f"job:busy:{run}")
    started = time.monotonic()
    with pytest.raises(LockTimeoutError) as info:
        tasks.impatient.delay(run).get(timeout=30)
    assert time.monotonic() - started >= 0.5
    assert info.value.key == f"job:busy:{run}" and info.value.wait == 0.5
    assert tasks.SEEN[run] == []


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


def test_callable_on_locked_decides_the_result(store: MemoryBackend) -> None:
    run = new_run()
    blocker = hold(store, f"job:busy:{run}")
    assert tasks.custom.delay(run).get(timeout=10) == {
        "busy": f"job:busy:{run}",
        "fence": blocker.fence,
    }


# -- once -----------------------------------------------------------------------------------------


def test_once_runs_the_body_once_and_replays_the_stored_result(store: MemoryBackend) -> None:
    run = new_run()
    first = tasks.charge.delay(run, 10).get(timeout=10)
    again = [tasks.charge.delay(run, 99).get(timeout=10) for _ in range(3)]
    assert again == [first] * 3 == [{"run": run, "amount": 10}] * 3
    assert len(tasks.SEEN[run]) == 1
    key = f"job:order:{run}"
    assert outcomes(store, key) == [Outcome.SUCCEEDED] + [Outcome.SKIPPED] * 3
    replay = store.history(key=key)[0]
    assert replay.problem == "once" and replay.details is not None
    assert "already succeeded" in replay.details


def test_once_does_not_count_a_failure(store: MemoryBackend) -> None:
    run = new_run()
    with pytest.raises(ValueError):
        tasks.charge_flaky.delay(run, True).get(timeout=10)
    assert tasks.charge_flaky.delay(run, False).get(timeout=10) == "charged"
    assert tasks.charge_flaky.delay(run, False).get(timeout=10) == "charged"
    assert len(tasks.SEEN[run]) == 2


def test_once_does_not_block_another_task_on_the_same_key(store: MemoryBackend) -> None:
    run = new_run()
    tasks.charge.delay(run, 1).get(timeout=10)
    assert tasks.refund.delay(run).get(timeout=10) == "refunded"
    assert tasks.refund.delay(run).get(timeout=10) == "refunded"
    assert [s["task"] for s in tasks.SEEN[run]] == ["t.charge", "t.refund", "t.refund"]


# -- renewal and a lost lease ----------------------------------------------------------------


def test_long_body_keeps_a_short_lease_by_renewal(store: MemoryBackend) -> None:
    run = new_run()
    expiries = tasks.long.delay(run, 1.2).get(timeout=15)
    assert expiries[-1] > expiries[0] + 0.5  # renewed several times
    [record] = store.history(key=f"job:long:{run}")
    assert record.outcome is Outcome.SUCCEEDED


def test_on_lock_lost_raise_stops_the_body(
    store: MemoryBackend, caplog: pytest.LogCaptureFixture
) -> None:
    run = new_run()
    key = f"job:doomed:{run}"
    with caplog.at_level(logging.WARNING, logger="celery_dlock"):
        result = tasks.doomed.delay(run)
        eventually(lambda: tasks.SEEN[run], "the body started")
        assert force_release(store, key, "operator took it") is not None
        with pytest.raises(LockLostError) as info:
            result.get(timeout=15)
    fence = tasks.SEEN[run][0]["fence"]
    assert info.value.key == key and info.value.fence == fence
    # The operator's release, then the body's own end, recorded as lost with what it was.
    assert outcomes(store, key) == [Outcome.FORCED, Outcome.LOST]
    assert str(store.history(key=key)[0].details).startswith("failed not recorded")
    # One error line of ours for one lost lease, naming the key, its fence and the task;
    # the release that finds it gone then says so as a warning.
    ours = [r for r in caplog.records if r.name.startswith("celery_dlock")]
    [lost] = [r.getMessage() for r in ours if r.levelno >= logging.ERROR]
    assert key in lost and f"(fence {fence})" in lost and "t.doomed[" in lost
    [late] = [r.getMessage() for r in ours if r.levelno == logging.WARNING]
    assert key in late and "(outcome lost): failed not recorded" in late


# -- definition-time checks ---------------------------------------------------------------------


def test_bad_placeholder_names_task_and_placeholder(celery_session_app: Any) -> None:
    with pytest.raises(LockKeyError) as info:

        @celery_session_app.task(
            base=LockedTask, name="shop.charge", lock_key="order:{order}", shared=False
        )
        def charge(order_id: int) -> None:
            pass

        charge.name  # noqa: B018 - creates the task on a lazy app
    assert "shop.charge" in str(info.value) and "'order'" in str(info.value)


def test_bound_task_signature_skips_self(celery_session_app: Any) -> None:
    @celery_session_app.task(
        base=LockedTask, bind=True, name="shop.bound", lock_key="o:<order_id>", shared=False
    )
    def bound(self: Any, order_id: int) -> None:
        pass

    assert bound.lock_key_for((7,)) == "job:o:7"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_key": "o:{order_id}", "on_locked": "wait"}, "on_locked must be one of"),
        ({"lock_key": "o:{order_id}", "lock_ttl": 0}, "ttl"),
        ({"lock_key": "o:{order_id}", "lock_wait": -1}, "lock_wait"),
        ({"lock_key": "o:{order_id}", "on_lock_lost": "panic"}, "on_lock_lost"),
        ({}, "no lock_key"),
    ],
)
def test_bad_options_fail_at_definition(
    celery_session_app: Any, options: dict[str, Any], message: str
) -> None:
    name = f"shop.bad_{uuid.uuid4().hex[:6]}"
    with pytest.raises(ConfigurationError, match=message) as info:

        @celery_session_app.task(base=LockedTask, name=name, shared=False, **options)
        def bad(order_id: int) -> None:
            pass

        bad.name  # noqa: B018
    assert name in str(info.value)


# -- direct calls -------------------------------------------------------------------------------


def test_a_direct_call_runs_locked(store: MemoryBackend) -> None:
    run = new_run()
    assert tasks.refund(run) == "refunded"
    [seen] = tasks.SEEN[run]
    assert seen["key"] == f"job:order:{run}"
    assert outcomes(store, f"job:order:{run}") == [Outcome.SUCCEEDED]


def test_a_direct_call_on_a_busy_key_raises_instead_of_requeueing(store: MemoryBackend) -> None:
    run = new_run()
    hold(store, f"job:busy:{run}")
    with pytest.raises(LockNotAcquiredError):
        tasks.requeue(run)
    assert tasks.SEEN[run] == []


def test_retry_from_a_direct_call_raises_and_releases(store: MemoryBackend) -> None:
    run = new_run()
    with pytest.raises((ConnectionError, Retry)):
        tasks.flaky(run, 1)
    assert outcomes(store, f"job:flaky:{run}") == [Outcome.FAILED]
