"""The worker's parent, told a child died (``WorkerLostError``), releases the body leases of
that attempt's task id whose holder is gone, and only those: with a task id the caller
reused and a ``lock_limit`` above 1, another attempt with the same id may hold a slot of the
same key in a live process. Real file store, a real holder process SIGKILLed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery import Celery

from celery_dlock import Holder, LockedTask, Outcome, backend_from_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.celery.settings import forget_settings
from celery_dlock.celery.signals import release_dead_attempt
from celery_dlock.records import Lease
from tests.support.holders import kill

TASK_ID = "sync-42"  # chosen by the caller, and reused

HOLD = textwrap.dedent(
    """
    import json, sys, time
    from celery_dlock import backend_from_url
    from celery_dlock.records import Holder
    backend = backend_from_url(sys.argv[1])
    holder = Holder.current(task_id=sys.argv[3], task_name="t.report")
    lease = backend.try_acquire(sys.argv[2], holder, None)
    print(json.dumps(None if lease is None else lease.to_dict()), flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def report(tmp_path: Path) -> Iterator[tuple[Any, LockBackend, str]]:
    url = f"file://{tmp_path}/locks"
    app = Celery("dead-attempt", set_as_current=False)
    app.conf.update(broker_url="memory://", dlock_backend=url)

    @app.task(base=LockedTask, name="t.report", lock_key="report:{who}", lock_limit=2, shared=False)
    def task(who: str) -> None: ...

    with backend_from_url(url) as backend:
        yield task, backend, url
    forget_settings(app)


def hold_in_a_process(url: str, key: str) -> tuple[subprocess.Popen[str], Lease]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, url, key, TASK_ID], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    data = json.loads(process.stdout.readline() or "null")
    assert data is not None, f"the holder process did not get {key}"
    return process, Lease.from_dict(data)


@pytest.mark.parametrize("dead_slot", [0, 1])
def test_only_the_dead_holders_slot_is_released(
    report: tuple[Any, LockBackend, str], dead_slot: int
) -> None:
    task, backend, url = report
    slots = ["job:report:acme#0", "job:report:acme#1"]
    process, dead = hold_in_a_process(url, slots[dead_slot])
    live_holder = Holder.current(task_id=TASK_ID, task_name="t.report")
    live = backend.try_acquire(slots[1 - dead_slot], live_holder, None)
    assert live is not None
    kill(process)
    record = release_dead_attempt(
        task, TASK_ID, args=("acme",), kwargs={}, outcome=Outcome.DISCONNECTED,
        cause=WorkerLostError("child killed"), wait=5.0,
    )  # fmt: skip
    assert getattr(record, "lease", None) == dead and record.outcome is Outcome.DISCONNECTED  # type: ignore[union-attr]
    assert backend.get(slots[dead_slot]) is None
    current = backend.get(slots[1 - dead_slot])
    assert current is not None and current.token == live.token, "a live attempt's slot was freed"
    backend.release(live, Outcome.SUCCEEDED)
