"""What a task's run leaves in the history: success, failure with its exception, a
skipped or rejected run, a long body kept by renewal, a direct call; and a lock store that
fails (the task never runs unlocked). Embedded worker (eager runs are tested with the
behaviour they exercise: test_once, test_on_locked, test_retries)."""

from __future__ import annotations

import logging
import time
from typing import Any

import celery
import pytest
from celery.exceptions import Retry

from celery_dlock import (
    BackendError,
    Outcome,
)
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.celery.settings import forget_settings
from tests.celery import embedded_tasks as tasks
from tests.celery.support import new_run, outcomes
from tests.support import eventually


@pytest.mark.usefixtures("app")
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


@pytest.mark.usefixtures("app")
def test_positional_and_keyword_submissions_lock_the_same_key(store: MemoryBackend) -> None:
    run = new_run()
    tasks.charge.delay(run, 5).get(timeout=10)
    assert tasks.charge.apply_async(kwargs={"run": run, "amount": 5}).get(timeout=10)
    assert len(tasks.SEEN[run]) == 1  # once: the keyword call found the positional one's key


@pytest.mark.usefixtures("app")
def test_literal_template_form_works(store: MemoryBackend) -> None:
    run = new_run()
    with pytest.raises(KeyError):
        tasks.explode.delay(run).get(timeout=10)
    assert tasks.SEEN[run][0]["key"] == f"job:explode:{run}"


@pytest.mark.usefixtures("app")
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


@pytest.mark.usefixtures("app")
def test_ignore_is_recorded_skipped(store: MemoryBackend) -> None:
    run = new_run()
    result = tasks.ignore.delay(run)
    eventually(lambda: store.history(key=f"job:ignore:{run}"), "a record")
    [record] = store.history(key=f"job:ignore:{run}")
    assert record.outcome is Outcome.SKIPPED and record.problem == "celery.exceptions.Ignore"
    assert store.get(f"job:ignore:{run}") is None
    assert not result.ready()  # Celery's own semantics for Ignore


@pytest.mark.usefixtures("app")
def test_reject_is_recorded_failed(store: MemoryBackend) -> None:
    run = new_run()
    tasks.reject.delay(run)
    eventually(lambda: store.history(key=f"job:reject:{run}"), "a record")
    [record] = store.history(key=f"job:reject:{run}")
    assert record.outcome is Outcome.FAILED and record.problem == "celery.exceptions.Reject"
    assert record.details is not None and record.details.startswith("requeue=False")


@pytest.mark.usefixtures("app")
def test_long_body_keeps_a_short_lease_by_renewal(store: MemoryBackend) -> None:
    run = new_run()
    expiries = tasks.long.delay(run, 3.0).get(timeout=15)
    assert expiries[-1] > expiries[0] + 2.0  # renewed after the first expiry
    [record] = store.history(key=f"job:long:{run}")
    assert record.outcome is Outcome.SUCCEEDED


@pytest.mark.usefixtures("app")
def test_a_direct_call_runs_locked(store: MemoryBackend) -> None:
    run = new_run()
    assert tasks.refund(run) == "refunded"
    [seen] = tasks.SEEN[run]
    assert seen["key"] == f"job:order:{run}"
    assert outcomes(store, f"job:order:{run}") == [Outcome.SUCCEEDED]


@pytest.mark.usefixtures("broken_store")
def test_store_failure_retries_the_task_and_never_runs_it_unlocked(
    app: Any, store: MemoryBackend
) -> None:
    run = new_run()
    result = tasks.refund.delay(run)
    deadline = time.monotonic() + 15
    while result.state != "RETRY":
        assert time.monotonic() < deadline, f"state stayed {result.state}"
        time.sleep(0.02)
    assert tasks.SEEN[run] == []
    app.conf.dlock_backend = "memory://celery-tests"  # the store is back
    forget_settings(app)
    assert result.get(timeout=20) == "refunded"
    [seen] = tasks.SEEN[run]
    assert seen["key"] == f"job:order:{run}"  # ran under the lock, once the store was back
    assert [r.outcome for r in store.history(key=f"job:order:{run}")] == [Outcome.SUCCEEDED]


@pytest.mark.usefixtures("broken_store")
def test_store_failure_with_run_policy_runs_unlocked_and_says_so(
    app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.dlock_on_backend_error = "run"
    forget_settings(app)
    run = new_run()
    with caplog.at_level(logging.WARNING, logger="celery_dlock.task"):
        assert tasks.refund.delay(run).get(timeout=10) == "refunded"
    [seen] = tasks.SEEN[run]
    assert seen["key"] is None  # no lease: it ran unlocked
    assert any("UNLOCKED" in message for message in caplog.messages)


def test_store_failure_in_a_direct_call_raises(app: Any, broken_store: None) -> None:
    with pytest.raises(BackendError):
        tasks.refund(new_run())


@pytest.mark.usefixtures("app")
def test_lock_metadata_of_the_tasks_arguments_is_stored_with_lease_and_record(
    store: MemoryBackend,
) -> None:
    run = new_run()
    assert tasks.charge_described.delay(run, 1999, currency="USD").get(timeout=10) == 1999
    [seen] = tasks.SEEN[run]
    assert seen["metadata"] == {"amount": 1999, "currency": "USD"}  # on the lease, in the body
    [record] = store.history(key=f"job:order:{run}")
    assert record.lease.metadata == {"amount": 1999, "currency": "USD"}


@pytest.mark.usefixtures("app")
def test_an_exception_whose_str_fails_is_still_recorded_and_its_key_freed(
    store: MemoryBackend,
) -> None:
    # Found by trying the API: the release described the exception with str(exc), which
    # raised, so the lease stayed held (no ttl) until the worker child went.
    run = new_run()
    with pytest.raises(tasks.GatewayError):
        tasks.unprintable.delay(run).get(timeout=10)
    key = f"job:unprintable:{run}"
    assert store.get(key) is None
    [record] = store.history(key=key)
    assert record.outcome is Outcome.FAILED
    assert record.problem == "tests.celery.embedded_tasks.GatewayError"
    assert record.details is not None
    assert "str() of the exception failed: KeyError" in record.details
    assert "Traceback" in record.details


@pytest.mark.usefixtures("broken_store")
def test_store_failure_re_queues_with_backoff_and_logs_an_error(
    app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by trying the API: every re-queue for a store failure waited 0.5-1 s, for ever,
    # logged at INFO, where a busy key backs off 1 s doubling to 60 s.
    run = new_run()
    with caplog.at_level(logging.INFO, logger="celery_dlock.task"):
        tasks.refund.delay(run)

        def requeues() -> list[logging.LogRecord]:
            found = [r for r in caplog.records if "re-queued" in r.getMessage()]
            return found if len(found) >= 3 else []

        first, second, third = eventually(requeues, "three re-queues", timeout=30)[:3]
    delays = [
        float(r.getMessage().split(" re-queued in ")[1].split(" s")[0])
        for r in (first, second, third)
    ]
    # lock_retry_backoff 1 s, jittered 0.5-1x: attempt n waits 2**n x [0.5, 1] s
    assert 0.5 <= delays[0] <= 1.0 and 1.0 <= delays[1] <= 2.0 and 2.0 <= delays[2] <= 4.0
    assert {r.levelno for r in (first, second, third)} == {logging.ERROR}
    assert "the lock store failed" in first.getMessage()
    assert tasks.SEEN[run] == []  # never ran unlocked


@pytest.mark.skipif(
    celery.VERSION < (5, 7),
    reason="Celery before 5.7 sends retry(kwargs=...) of a positional call with both "
    "(celery/celery#6494) and rejects it itself, with or without celery-dlock",
)
@pytest.mark.usefixtures("app")
def test_a_retry_with_arguments_of_another_key_releases_the_lease(store: MemoryBackend) -> None:
    # Found by trying the API: the lease was kept for the retry, which locked another key,
    # so each page's key stayed held for 5 minutes after the task had succeeded.
    run = new_run()
    assert tasks.paginate.delay(run, 0).get(timeout=20) == 2
    for cursor, outcome in [(0, Outcome.RETRIED), (1, Outcome.RETRIED), (2, Outcome.SUCCEEDED)]:
        key = f"job:page:{run}:{cursor}"
        assert store.get(key) is None
        assert outcomes(store, key) == [outcome]


@pytest.mark.skipif(
    celery.VERSION < (5, 7),
    reason="Celery before 5.7 sends retry(kwargs=...) of a positional call with both "
    "(celery/celery#6494) and rejects it itself, with or without celery-dlock",
)
@pytest.mark.usefixtures("app")
def test_a_retry_given_keywords_for_a_positional_call_keeps_the_lease_of_its_key(
    store: MemoryBackend,
) -> None:
    """Celery 5.7 merges ``retry(kwargs=...)`` into a positional call's arguments: the retry
    locks the same key. The lease was released (``retried``) instead of kept for it: the
    key was judged by the old positional and the new keyword values at once, which no call
    can take, so ``lock_across_retries`` left a gap between the attempts."""
    run = new_run()
    assert tasks.resume.delay(run, 0).get(timeout=20) == 1
    key = f"job:resume:{run}"
    assert outcomes(store, key) == [Outcome.RETRIED, Outcome.SUCCEEDED]
    retried, _ = reversed(store.history(key=key))
    assert (retried.details or "").startswith("continued by its retry"), retried.details


@pytest.mark.usefixtures("app")
def test_a_direct_call_that_retries_releases_its_lease(store: MemoryBackend) -> None:
    # A direct call sends no retry: keeping the lease for one blocked the key for 5 minutes.
    run = new_run()
    with pytest.raises(Retry):
        tasks.retry_soon(run)
    key = f"job:soon:{run}"
    assert store.get(key) is None
    assert outcomes(store, key) == [Outcome.RETRIED]
