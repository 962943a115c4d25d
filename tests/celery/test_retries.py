"""A retry is the same logical run: it keeps the key between its attempts and takes its
own lease over; without ``lock_across_retries`` the attempt releases as ``retried``; a warm
shutdown releases a lease kept for a retry."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from celery.exceptions import Retry

from celery_dlock import (
    Holder,
    Outcome,
    backend_from_url,
)
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.records import Lease
from tests.celery import embedded_tasks as tasks
from tests.celery.prefork import running
from tests.celery.support import new_run, outcomes
from tests.support import eventually


@pytest.mark.usefixtures("app")
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


@pytest.mark.usefixtures("app")
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


@pytest.mark.usefixtures("app")
def test_without_lock_across_retries_the_attempt_releases_as_retried(store: MemoryBackend) -> None:
    run = new_run()
    key = f"job:flaky:{run}"
    assert tasks.flaky_release.delay(run, 1).get(timeout=15) == 1
    assert outcomes(store, key) == [Outcome.RETRIED, Outcome.SUCCEEDED]
    [retried, _] = reversed(store.history(key=key))
    assert retried.problem == "celery.exceptions.Retry"


@pytest.mark.usefixtures("app")
def test_retry_from_a_direct_call_raises_and_releases(store: MemoryBackend) -> None:
    run = new_run()
    with pytest.raises((ConnectionError, Retry)):
        tasks.flaky(run, 1)
    assert outcomes(store, f"job:flaky:{run}") == [Outcome.FAILED]


def test_eager_retry_continues_its_own_lock(eager: tuple[Celery, dict[str, Any]]) -> None:
    _, calls = eager
    order = new_run()
    assert calls["flaky"].delay(order).get() == 2
    fences = [run[2] for run in calls["runs"] if run[1] == order]
    assert len(fences) == 3 and fences == sorted(set(fences))
    store = MemoryBackend.from_url("memory://eager-tests")
    outcomes = [r.outcome for r in reversed(store.history(key=f"job:flaky:{order}"))]
    assert outcomes == [Outcome.RETRIED, Outcome.RETRIED, Outcome.SUCCEEDED]
    assert store.get(f"job:flaky:{order}") is None


@pytest.mark.slow
def test_warm_shutdown_releases_a_lease_kept_for_a_retry(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:later:{order}"
    with running(tmp_path, redis_url, lock_url) as short_lived:
        short_lived.tasks.later.delay(order)
        # Kept: the attempt ended and its lease got a backstop expiry for the retry's wait.
        kept: Lease = eventually(
            lambda: (lease := short_lived.store.get(key)) and lease.expires_at and lease,
            "the lease kept for the retry",
        )
        assert short_lived.store.try_acquire(key, Holder.current(), None) is None
    # The worker stopped (warm shutdown): what it kept is released and recorded.
    store = backend_from_url(lock_url)
    try:
        assert store.get(key) is None
        [record] = [r for r in store.history(key=key) if r.lease.token == kept.token]
        assert record.outcome is Outcome.RETRIED and record.problem == "WorkerShutdown"
    finally:
        store.close()


def test_a_revoked_retry_releases_the_lease_kept_for_it(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    """A retry revoked while it waits for its countdown will not run: the lease its attempt
    kept for it goes at once, by the token in the retry's header, recorded ``revoked`` (it
    stayed for countdown + 5 minutes, the key busy for every other run)."""
    order = uuid.uuid4().hex[:8]
    key = f"job:later:{order}"
    with running(tmp_path, redis_url, lock_url) as worker:
        result = worker.tasks.later.delay(order)
        kept: Lease = eventually(
            lambda: (lease := worker.store.get(key)) and lease.expires_at and lease,
            "the lease kept for the retry",
        )
        result.revoke()
        [record] = eventually(
            lambda: [r for r in worker.store.history(key=key) if r.lease.token == kept.token],
            "the kept lease's record",
        )
        assert record.outcome is Outcome.REVOKED, record
        assert "retry" in (record.details or "")
        assert worker.store.get(key) is None
        lease = worker.store.try_acquire(key, Holder.current(), None)  # the key is free
        assert lease is not None
        worker.store.release(lease, Outcome.SUCCEEDED)
