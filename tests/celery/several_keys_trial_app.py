"""The app of tests/celery/test_several_keys_trial.py's prefork workers: tasks that lock
several keys (``lock_key`` as a list of templates) or a key's slots (``lock_limit``).

Configured by environment as ``workerapp`` is (DLOCK_TEST_BROKER, DLOCK_TEST_RESULTS,
DLOCK_TEST_LOCKS, DLOCK_TEST_LEDGER, DLOCK_TEST_QUEUE). A body SIGKILLs its own child when
a file ``kill-<src>`` lies beside the ledger (the file is removed first, so a redelivery
runs to its end).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_dlock import LockedTask, install

app = Celery("several_keys_trial_app")
app.conf.update(
    broker_url=os.environ["DLOCK_TEST_BROKER"],
    result_backend=os.environ["DLOCK_TEST_RESULTS"],
    dlock_backend=os.environ["DLOCK_TEST_LOCKS"],
    dlock_janitor_interval=3600.0,
    task_default_queue=os.environ.get("DLOCK_TEST_QUEUE", "celery"),
    worker_prefetch_multiplier=1,
    task_track_started=True,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": 3600.0,
        "unacked_restore_interval": 0.5,
        "unacked_restore_throttle": 1,
    },
)
install(app)


def ledger(event: str, task: Any, **data: Any) -> None:
    """Append one event, with every lease the request holds, to the shared ledger file."""
    entry = {
        "event": event,
        "task": task.name,
        "id": task.request.id,
        "pid": os.getpid(),
        "keys": [lease.key for lease in task.leases],
        "tokens": [lease.token for lease in task.leases],
        **data,
    }
    with open(os.environ["DLOCK_TEST_LEDGER"], "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(entry) + "\n")


def _kill_if_asked(src: str) -> None:
    hook = Path(os.environ["DLOCK_TEST_LEDGER"]).with_name(f"kill-{src}")
    if hook.exists():
        hook.unlink()
        os.kill(os.getpid(), signal.SIGKILL)


def _move(task: Any, src: str, seconds: float) -> list[str]:
    ledger("start", task)
    _kill_if_asked(src)
    time.sleep(seconds)
    ledger("end", task)
    return [lease.key for lease in task.leases]


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    name="t.move",
    lock_key=["account:{src}", "account:{dst}"],
    on_locked="skip",
)
def move(self: Any, src: str, dst: str, seconds: float) -> list[str]:
    return _move(self, src, seconds)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    name="t.move_late",
    lock_key=["account:{src}", "account:{dst}"],
    acks_late=True,
    reject_on_worker_lost=True,
)
def move_late(self: Any, src: str, dst: str, seconds: float) -> list[str]:
    return _move(self, src, seconds)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    name="t.move_careful",
    lock_key=["account:{src}", "account:{dst}"],
    lock_ttl=1.5,
    on_lock_lost="raise",
)
def move_careful(self: Any, src: str, dst: str, swallow: bool) -> str:
    """Waits (up to 60 s) for a lost lease: LockLostError, raised in the body, or caught
    by it (``swallow``, as a body with a broad ``except Exception`` does)."""
    ledger("start", self)
    try:
        for _ in range(600):
            time.sleep(0.1)
    except Exception as exc:
        if not swallow:
            raise
        ledger("caught", self, error=repr(exc))
        return "caught"
    return "never lost"


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    name="t.move_queued",
    lock_key=["account:{src}", "account:{dst}"],
    dedupe="until_finished",
)
def move_queued(self: Any, src: str, dst: str, seconds: float) -> list[str]:
    return _move(self, src, seconds)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    name="t.export",
    lock_key="export:{tenant}",
    lock_limit=2,
    on_locked="skip",
    max_retries=1,
)
def export(self: Any, tenant: str, seconds: float, retry: bool = False) -> str:
    """Holds one of the tenant's two slots; ``retry``: retries in an hour, keeping it."""
    ledger("start", self, retries=self.request.retries)
    _kill_if_asked(tenant)
    if retry:
        raise self.retry(countdown=3600)
    time.sleep(seconds)
    ledger("end", self)
    return self.lease.key
