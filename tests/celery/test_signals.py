"""The parent-side handlers, driven with a real dead holder process."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery import Celery
from celery.exceptions import TimeLimitExceeded

from celery_dlock import LockedTask, Outcome, install
from celery_dlock.backends.file import FileBackend
from celery_dlock.celery.signals import _task_failed, _task_revoked
from celery_dlock.records import Holder, Lease

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
