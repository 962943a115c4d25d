"""A body that does not end by itself: a SIGKILLed child, time limits, revoke with
terminate, a lease lost while the body runs (``on_lock_lost``), in a real prefork worker;
and the parent-side signal handlers driven with a real dead holder process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
from billiard.exceptions import WorkerLostError
from celery import Celery
from celery.exceptions import TimeLimitExceeded

from celery_dlock import (
    Holder,
    LockedTask,
    LockLostError,
    Outcome,
    backend_from_url,
    install,
)
from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.celery.signals import _task_failed, _task_revoked
from celery_dlock.records import Lease
from tests.backends.stores.redis import URL as REDIS_STORE
from tests.backends.stores.redis import delete_prefix, store_url
from tests.celery import embedded_tasks as tasks
from tests.celery.prefork import Worker, running, settled
from tests.celery.support import new_run, outcomes
from tests.support import eventually, force_release
from tests.support.countingproxy import CountingProxy
from tests.support.services import lease_session_pids, postgres_admin


def started_body(worker: Worker, key: str) -> dict[str, Any]:
    return eventually(
        lambda: next((e for e in worker.events() if e["key"] == key), None), f"body of {key}"
    )


@pytest.mark.slow
def test_a_sigkilled_child_is_released_and_recorded_disconnected(worker: Worker) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:hold:{order}"
    result = worker.tasks.hold.delay(order, 60)
    body = started_body(worker, key)
    killed_at = time.time()
    os.kill(body["pid"], signal.SIGKILL)
    record = eventually(lambda: next(iter(worker.history(key)), None), "a record of the dead child")
    assert record.outcome is Outcome.DISCONNECTED
    assert record.lease.token == body["token"]
    assert record.lease.holder.pid == body["pid"]
    assert record.problem == "WorkerLostError"
    assert worker.store.get(key) is None
    with pytest.raises(Exception, match=r"WorkerLostError|Worker exited"):
        result.get(timeout=30)
    print(f"\nkill → disconnected record: {record.released_at - killed_at:.3f} s")


@pytest.mark.slow
def test_a_release_the_store_refused_lands_at_the_worker_childs_shutdown(
    tmp_path: Path, redis_url: str
) -> None:
    """A child's release that Redis refused, with no later release in that child to settle
    it: the worker's warm shutdown does (a prefork child skips exit handlers)."""
    server = urlsplit(REDIS_STORE)
    prefix = f"shutdown-{uuid.uuid4().hex[:8]}"
    order = uuid.uuid4().hex[:8]
    key = f"job:hold:{order}"
    with CountingProxy(server.hostname or "127.0.0.1", server.port or 6379) as proxy:
        through = f"redis://127.0.0.1:{proxy.port}{server.path}"
        with running(tmp_path, redis_url, store_url(prefix, through, retries=0)) as worker:
            # The body holds for 5 s: the store must be cut off before it ends, however
            # long the test takes to see it start (1 s was not always enough under load).
            worker.tasks.hold.delay(order, 5.0)
            body = started_body(worker, key)
            proxy.refuse()  # the body ends while Redis cannot be reached
            eventually(lambda: "could not release" in worker.log.read_text(), "refused")
            proxy.accept()
            assert worker.store.get(key) is not None  # nothing released it yet
        store = backend_from_url(store_url(prefix, REDIS_STORE))
        try:
            assert store.get(key) is None
            [record] = store.history(key=key)
            assert (record.lease.token, record.outcome) == (body["token"], Outcome.SUCCEEDED)
        finally:
            store.close()
            delete_prefix(REDIS_STORE, prefix)


@pytest.mark.slow
def test_a_body_whose_lock_session_ends_is_stopped_with_on_lock_lost_raise(
    worker: Worker, lock_url: str
) -> None:
    if not lock_url.startswith("postgresql"):
        pytest.skip("not applicable: a file lease lives as long as its process")
    order = uuid.uuid4().hex[:8]
    key = f"job:fragile:{order}"
    result = worker.tasks.fragile.delay(order)
    body = started_body(worker, key)
    with postgres_admin() as admin:
        [pid] = lease_session_pids(admin, lock_url.split("schema=")[1], body["fence"])
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(LockLostError) as info:
        result.get(timeout=30)
    assert info.value.key == key and info.value.fence == body["fence"]
    assert [e["event"] for e in worker.events() if e["key"] == key] == ["start"]  # stopped
    taken = worker.store.try_acquire(key, Holder.current(), None)
    assert taken is not None  # free for the next holder, whose takeover records the old one
    ended = {r.outcome: r for r in worker.history(key) if r.lease.token == body["token"]}
    # The takeover records the dead session's lease; the body's own end is recorded lost.
    assert set(ended) == {Outcome.DISCONNECTED, Outcome.LOST}
    assert str(ended[Outcome.LOST].details).startswith("failed not recorded")
    assert worker.store.release(taken, Outcome.SUCCEEDED) is not None


@pytest.mark.slow
def test_a_hard_time_limit_is_recorded_once(worker: Worker) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:hard:{order}"
    result = worker.tasks.hard.delay(order)
    body = started_body(worker, key)
    with pytest.raises(Exception, match="TimeLimitExceeded"):
        result.get(timeout=60)
    # task_failure fires twice for a hard time limit, both before billiard SIGKILLs the
    # child; each firing waits for the child to be gone, then releases by its token.
    killed = f"pid:{body['pid']} exited with 'signal 9"
    eventually(lambda: killed in worker.log.read_text(), "the child killed by the time limit")
    records = eventually(lambda: worker.history(key), "a record after the time limit")
    assert [r.lease.token for r in records] == [body["token"]]
    assert records[0].outcome in (Outcome.DISCONNECTED, Outcome.REVOKED)
    assert worker.store.get(key) is None


@pytest.mark.slow
def test_a_soft_time_limit_is_recorded_failed(worker: Worker) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:soft:{order}"
    with pytest.raises(Exception, match="SoftTimeLimitExceeded"):
        worker.tasks.soft.delay(order).get(timeout=60)
    [record] = worker.history(key)
    assert record.outcome is Outcome.FAILED
    assert record.problem == "billiard.exceptions.SoftTimeLimitExceeded"
    assert record.details is not None and "Traceback" in record.details
    settled(worker)  # the soft-limited job read by the worker before any shutdown: see settled


@pytest.mark.slow
def test_revoke_with_terminate_releases_as_revoked(worker: Worker) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:hold:{order}"
    result = worker.tasks.hold.delay(order, 60)
    body = started_body(worker, key)
    result.revoke(terminate=True)
    record = eventually(lambda: next(iter(worker.history(key)), None), "a record of the revoke")
    assert record.outcome is Outcome.REVOKED
    assert record.lease.token == body["token"]
    assert worker.store.get(key) is None


@pytest.mark.usefixtures("app")
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
    details = str(store.history(key=key)[0].details)
    assert details.startswith("failed not recorded")
    assert f"lease on {key!r} with fence {fence} was lost" in details  # not '' and -1
    # One error line of ours for one lost lease, naming the key, its fence and the task;
    # the release that finds it gone then says so as a warning.
    ours = [r for r in caplog.records if r.name.startswith("celery_dlock")]
    [lost] = [r.getMessage() for r in ours if r.levelno >= logging.ERROR]
    assert key in lost and f"(fence {fence})" in lost and "t.doomed[" in lost
    [late] = [r.getMessage() for r in ours if r.levelno == logging.WARNING]
    assert key in late and "(outcome lost): failed not recorded" in late


CHILD = (
    "import json, sys\n"
    "from celery_dlock import backend_from_url\n"
    "from celery_dlock.records import Holder\n"
    "backend = backend_from_url(sys.argv[1])\n"
    "lease = backend.try_acquire(sys.argv[2], Holder.current(task_id=sys.argv[3],"
    " task_name='s.charge', worker='w1@host'), None)\n"
    "print(json.dumps(lease.to_dict()), flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Any, FileBackend, str]:
    url = f"file://{tmp_path}/locks"
    app = Celery(f"signals-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.dlock_backend = url
    install(app, janitor=False)

    @app.task(shared=False, base=LockedTask, name="s.charge", lock_key="order:{order_id}")
    def charge(order_id: int) -> None:
        pass

    return charge, FileBackend(str(tmp_path / "locks")), url


def child_lease(url: str, key: str, task_id: str, *, kill: bool) -> tuple[Lease, Any]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, key, task_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    lease = Lease.from_dict(json.loads(child.stdout.readline()))
    if kill:
        end(child)
    return lease, child


def end(child: Any) -> None:
    child.kill()
    child.wait()
    child.stdin.close()
    child.stdout.close()


def test_worker_lost_releases_the_dead_childs_lease_once(setup: Any) -> None:
    task, store, url = setup
    lease, _ = child_lease(url, "job:order:1", "task-1", kill=True)
    for _ in range(2):  # a hard time limit fires task_failure twice
        _task_failed(
            sender=task, task_id="task-1", exception=WorkerLostError("gone"), args=[1], kwargs={}
        )
    [record] = store.history(key="job:order:1")
    assert record.outcome is Outcome.DISCONNECTED and record.problem == "WorkerLostError"
    assert record.lease.token == lease.token
    assert store.get("job:order:1") is None


def test_time_limit_releases_too(setup: Any) -> None:
    task, store, url = setup
    child_lease(url, "job:order:2", "task-2", kill=True)
    _task_failed(
        sender=task,
        task_id="task-2",
        exception=TimeLimitExceeded(1.0),
        args=(),
        kwargs={"order_id": 2},
    )
    [record] = store.history(key="job:order:2")
    assert record.problem == "TimeLimitExceeded"


def test_an_ordinary_failure_is_not_touched(setup: Any) -> None:
    task, store, url = setup
    child_lease(url, "job:order:3", "task-3", kill=True)
    _task_failed(sender=task, task_id="task-3", exception=ValueError("x"), args=[3], kwargs={})
    assert store.get("job:order:3") is not None


def test_a_live_attempt_with_the_same_task_id_is_left_alone(setup: Any) -> None:
    # A redelivered copy of the task (same id) still runs in another child: not ours to free.
    task, store, url = setup
    lease, child = child_lease(url, "job:order:4", "task-4", kill=False)
    try:
        from celery_dlock.celery import signals

        result = signals.release_dead_attempt(
            task, "task-4", args=[4], kwargs={}, outcome=Outcome.DISCONNECTED,
            cause=WorkerLostError("x"), wait=0.0,
        )  # fmt: skip
        assert result is signals._WAITING
        held = store.get("job:order:4")
        assert held is not None and held.token == lease.token
    finally:
        end(child)


def test_another_tasks_lease_on_the_key_is_left_alone(setup: Any) -> None:
    task, store, _ = setup
    other = store.try_acquire("job:order:5", Holder.current(task_id="someone-else"), None)
    assert other is not None
    _task_failed(sender=task, task_id="task-5", exception=WorkerLostError("x"), args=[5], kwargs={})
    held = store.get("job:order:5")
    assert held is not None and held.token == other.token


def test_revoke_with_terminate_releases_as_revoked_when_the_child_is_gone(setup: Any) -> None:
    task, store, url = setup
    child_lease(url, "job:order:6", "task-6", kill=True)

    request = SimpleNamespace(id="task-6", args=[6], kwargs={})
    _task_revoked(sender=task, request=request, terminated=True, signum=15)
    [record] = store.history(key="job:order:6")
    assert record.outcome is Outcome.REVOKED
