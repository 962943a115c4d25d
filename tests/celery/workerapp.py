"""The app a real prefork worker runs in tests/celery/test_prefork.py.

Configured by environment: DLOCK_TEST_BROKER, DLOCK_TEST_RESULTS, DLOCK_TEST_LOCKS (lock
store URL), DLOCK_TEST_LEDGER (a file the task bodies append events to), and optionally
DLOCK_TEST_VISIBILITY (Redis visibility timeout, s) and DLOCK_TEST_JANITOR (interval, s).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from typing import Any

from celery import Celery

from celery_dlock import LockedTask, install

app = Celery("workerapp")
app.conf.update(
    broker_url=os.environ["DLOCK_TEST_BROKER"],
    result_backend=os.environ["DLOCK_TEST_RESULTS"],
    dlock_backend=os.environ["DLOCK_TEST_LOCKS"],
    dlock_janitor_interval=float(os.environ.get("DLOCK_TEST_JANITOR", "3600")),
    task_default_queue=os.environ.get("DLOCK_TEST_QUEUE", "celery"),
    worker_prefetch_multiplier=1,
    task_track_started=True,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("DLOCK_TEST_VISIBILITY", "3600")),
        "unacked_restore_interval": 0.5,
        "unacked_restore_throttle": 1,
    },
)
install(app)


def ledger(event: str, task: Any, **data: Any) -> None:
    """Append one event, in order, to the shared ledger file."""
    lease = task.lease
    entry = {
        "event": event,
        "task": task.name,
        "id": task.request.id,
        "pid": os.getpid(),
        "key": None if lease is None else lease.key,
        "fence": None if lease is None else lease.fence,
        "token": None if lease is None else lease.token,
        **data,
    }
    with open(os.environ["DLOCK_TEST_LEDGER"], "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(entry) + "\n")


def _body(task: Any, seconds: float, **data: Any) -> dict[str, Any]:
    ledger("start", task, **data)
    time.sleep(seconds)
    ledger("end", task, **data)
    return {"fence": task.lease.fence, "pid": os.getpid()}


@app.task(
    base=LockedTask,
    bind=True,
    name="w.charge",
    lock_key="order:<order_id>",
    once=True,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.3,
)
def charge(self: Any, order_id: int, amount: int) -> dict[str, Any]:
    return _body(self, 0.2, amount=amount)


@app.task(
    base=LockedTask,
    bind=True,
    name="w.serial",
    lock_key="serial:{order_id}",
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.3,
)
def serial(self: Any, order_id: int, n: int) -> dict[str, Any]:
    return _body(self, 0.05, n=n)


@app.task(base=LockedTask, bind=True, name="w.hold", lock_key="hold:{order_id}")
def hold(self: Any, order_id: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)


@app.task(
    base=LockedTask,
    bind=True,
    name="w.fragile",
    lock_key="fragile:{order_id}",
    on_lock_lost="raise",
)
def fragile(self: Any, order_id: str) -> None:
    ledger("start", self)
    for _ in range(600):
        time.sleep(0.1)  # short sleeps: LockLostError is raised between two of them
    ledger("end", self)


@app.task(
    base=LockedTask,
    bind=True,
    name="w.soft",
    lock_key="soft:{order_id}",
    soft_time_limit=0.5,
)
def soft(self: Any, order_id: str) -> dict[str, Any]:
    return _body(self, 5)


@app.task(base=LockedTask, bind=True, name="w.hard", lock_key="hard:{order_id}", time_limit=1.0)
def hard(self: Any, order_id: str) -> dict[str, Any]:
    return _body(self, 10)


@app.task(
    base=LockedTask,
    bind=True,
    name="w.late",
    lock_key="late:{order_id}",
    acks_late=True,
    on_locked="skip",
)
def late(self: Any, order_id: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)


@app.task(
    base=LockedTask,
    bind=True,
    name="w.later",
    lock_key="later:{order_id}",
    max_retries=1,
)
def later(self: Any, order_id: str) -> None:
    ledger("start", self)
    raise self.retry(countdown=3600)
