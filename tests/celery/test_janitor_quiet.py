"""The janitor on the beat schedule does not fill the history with its idle runs: a run that
finds nothing to clear leaves no record when one was recorded within ``quiet_for`` (an hour
for the beat task), while every run that clears something is recorded, and two janitors
at once, each clearing its first batch without the janitor's lock, clear and record each
dead lease once. On the file store, PostgreSQL and Redis; the last, on S3 and GCS too."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dlock import Holder, Outcome, backend_from_url, install
from celery_dlock.backends.base import LockBackend
from celery_dlock.reap import JANITOR_TASK, janitor_key, reap
from tests.support.expiry import expired_leases
from tests.support.objectstore_servers import (  # noqa: F401 - fixtures
    Server,
    object_server,
    unique_prefix,
)
from tests.support.services import POSTGRES_URL, drop_schema, postgres_admin, redis_client

REDIS_URL = "redis://127.0.0.1:6379/1"
TTL = 0.5
Opener = Callable[[str], LockBackend]


@pytest.fixture(params=["file", "postgres", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    name = f"q{uuid.uuid4().hex[:10]}"
    if request.param == "file":
        yield f"file://{tmp_path}/locks"
    elif request.param == "postgres":
        yield f"{POSTGRES_URL}?schema=dlock_{name}&auto_migrate=1"
        admin = postgres_admin()
        try:
            drop_schema(admin, f"dlock_{name}")
        finally:
            admin.close()
    else:
        redis_client(REDIS_URL).close()
        yield f"{REDIS_URL}?prefix={name}"
        client = redis_client(REDIS_URL)
        try:
            for found in client.scan_iter(match=f"{{{name}*", count=1000):
                client.delete(found)
        finally:
            client.close()


@pytest.fixture
def opened() -> Iterator[Opener]:
    """Open a store's client for the test, closed at its end."""
    backends: list[LockBackend] = []

    def open_(url: str) -> LockBackend:
        backends.append(backend_from_url(url))
        return backends[-1]

    yield open_
    for backend in backends:
        backend.close()


def janitor_records(backend: LockBackend) -> list[Outcome]:
    return [record.outcome for record in backend.history(key=janitor_key("job"), limit=None)]


def test_idle_runs_within_the_hour_leave_no_record(url: str, opened: Opener) -> None:
    backend = opened(url)
    first = reap(backend, quiet_for=3600)  # none recorded yet: this one is
    assert first["quiet"] == 0 and janitor_records(backend) == [Outcome.SUCCEEDED]
    for _ in range(3):
        assert reap(backend, quiet_for=3600)["quiet"] == 1
    assert janitor_records(backend) == [Outcome.SUCCEEDED]
    assert backend.history(limit=None) == backend.history(key=janitor_key("job"), limit=None)
    assert backend.get(janitor_key("job")) is None  # a quiet run took no lock


def test_a_run_that_clears_is_recorded_within_the_hour_too(url: str, opened: Opener) -> None:
    backend = opened(url)
    reap(backend, quiet_for=3600)
    dead = expired_leases(backend, [f"job:dead:{n}" for n in range(3)], TTL)
    counts = reap(backend, batch=2, quiet_for=3600)  # the first batch unlocked, then locked
    assert (counts["reaped"], counts["expired"], counts["quiet"]) == (3, 3, 0)
    [latest, _] = backend.history(key=janitor_key("job"), limit=None)
    assert latest.outcome is Outcome.SUCCEEDED and latest.result == counts
    for lease in dead:
        assert [r.outcome for r in backend.history(key=lease.key)] == [Outcome.EXPIRED]
        assert backend.get(lease.key) is None


def test_an_idle_run_is_recorded_again_once_the_quiet_time_passed(url: str, opened: Opener) -> None:
    backend = opened(url)
    reap(backend, quiet_for=0.5)
    assert reap(backend, quiet_for=0.5)["quiet"] == 1
    time.sleep(0.7)
    assert reap(backend, quiet_for=0.5)["quiet"] == 0
    assert janitor_records(backend) == [Outcome.SUCCEEDED, Outcome.SUCCEEDED]


def test_a_quiet_run_does_not_prune_and_a_recorded_one_does(url: str, opened: Opener) -> None:
    backend = opened(url)
    reap(backend, quiet_for=3600)
    lease = backend.try_acquire("job:old", Holder.current(), None)
    assert lease is not None
    backend.release(lease, Outcome.SUCCEEDED)
    future = -86400.0 * 2  # a cut-off in the future: everything before now goes
    assert reap(backend, retention=future, quiet_for=3600)["pruned"] == 0
    assert [r.outcome for r in backend.history(key="job:old")] == [Outcome.SUCCEEDED]
    assert reap(backend, retention=future)["pruned"] >= 1
    assert backend.history(key="job:old") == []


def janitors_at_once(url: str, opened: Opener, dead: int, batch: int) -> None:
    """Four janitors, each of its own client (another worker process's), clear ``dead``
    expired leases at once: each lease is cleared and recorded once, none is left."""
    backend = opened(url)
    reap(backend, quiet_for=3600)
    leases = expired_leases(backend, [f"job:dead:{n}" for n in range(dead)], TTL)
    start = threading.Barrier(4)
    results: list[dict[str, int]] = []

    def janitor() -> None:
        own = opened(url)
        start.wait()
        results.append(reap(own, batch=batch, quiet_for=3600))

    threads = [threading.Thread(target=janitor) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 4
    assert sum(counts["reaped"] for counts in results) == dead
    for lease in leases:
        assert [r.outcome for r in backend.history(key=lease.key)] == [Outcome.EXPIRED]
        assert backend.get(lease.key) is None


def test_janitors_at_once_clear_and_record_each_dead_lease_once(url: str, opened: Opener) -> None:
    janitors_at_once(url, opened, dead=12, batch=5)


def test_the_beat_task_runs_quietly_and_the_cli_run_is_always_recorded(
    tmp_path: Path, opened: Opener
) -> None:
    url = f"file://{tmp_path}/locks"
    app = Celery("janitor-quiet", set_as_current=False)
    app.conf.update(dlock_backend=url, task_always_eager=True)
    install(app)
    task: Any = app.tasks[JANITOR_TASK]
    backend = opened(url)
    assert task.delay().get()["quiet"] == 0
    assert task.delay().get()["quiet"] == 1
    assert reap(backend)["quiet"] == 0  # as `celery dlock reap` runs it: no quiet_for
    assert janitor_records(backend) == [Outcome.SUCCEEDED, Outcome.SUCCEEDED]


def test_janitors_at_once_on_an_object_store_record_each_dead_lease_once(
    object_server: Server,  # noqa: F811
    opened: Opener,
) -> None:
    """S3 and GCS: a reap's write is conditional on the object it read; four janitors at
    once each clear their first batch without the lock."""
    janitors_at_once(object_server.url(unique_prefix()), opened, dead=8, batch=3)


def test_a_run_whose_batch_another_janitor_outran_clears_the_rest(
    url: str, opened: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that clears fewer leases than it asked for while more are due (what a batch
    clears when another janitor, at once, cleared some of those it found; the contract
    allows it) does not end the run: before, the run stopped at its first batch's 2 of 5,
    leaving 10 dead leases for the next run."""
    backend = opened(url)
    reap(backend, quiet_for=3600)  # a run recorded: the next may be quiet
    leases = expired_leases(backend, [f"job:outrun:{n}" for n in range(12)], TTL)
    store_reap = backend.reap
    calls: list[int] = []

    def outrun(limit: int = 100) -> list[Any]:
        calls.append(limit)
        return store_reap(limit=2 if len(calls) == 1 else limit)

    monkeypatch.setattr(backend, "reap", outrun)
    counts = reap(backend, batch=5, quiet_for=3600)
    assert (counts["reaped"], counts["expired"], counts["quiet"]) == (12, 12, 0)
    assert all(backend.get(lease.key) is None for lease in leases)
