"""The app of ``tests/celery/test_pools_trial.py``: LockedTask bodies run by real workers of
other pools and settings than the prefork worker of ``workerapp`` (threads, prefork
with ``--max-tasks-per-child``), configured by environment as ``workerapp`` is
(:func:`tests.support.workerapps.worker_app`); its bodies append events to the ledger.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:
    # A top-level module of a worker run in tests/celery: the tree's root goes first on
    # sys.path, as pytest's `pythonpath = ["."]` puts it, for `tests.support`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.workerapps import beside_ledger, kill_if_asked, ledger, locked_task, worker_app

app = worker_app("pools_trial_app")


def _body(
    task: Any, seconds: float, before: Callable[[], None] | None = None, **data: Any
) -> dict[str, Any]:
    """Write ``start``, wait ``seconds`` (or until the test leaves ``go-<task id>`` beside
    the ledger), write ``end``; the lease held."""
    ledger("start", task, thread=threading.get_ident(), **data)
    if before is not None:
        before()
    gate = beside_ledger(f"go-{task.request.id}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not gate.exists():
        time.sleep(0.02)
    ledger("end", task, thread=threading.get_ident(), **data)
    lease = task.lease
    return {"fence": lease.fence, "token": lease.token, "key": lease.key, "pid": os.getpid()}


@locked_task(
    app,
    "pt.hold",
    lock_key="hold:{order_id}",
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.3,
)
def hold(self: Any, order_id: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)


@locked_task(
    app,
    "pt.charge",
    lock_key="charge:{order_id}",
    once=True,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.3,
)
def charge(self: Any, order_id: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)


@locked_task(app, "pt.sync", lock_key="sync:{customer}", dedupe="until_finished")
def sync(self: Any, customer: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)


@locked_task(
    app,
    "pt.late",
    lock_key="late:{order_id}",
    once=True,
    acks_late=True,
    reject_on_worker_lost=True,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.3,
)
def late(self: Any, order_id: str, seconds: float) -> dict[str, Any]:
    """``once`` with acks_late: a redelivered message runs again unless a success is kept;
    a child told to die (``kill-<order_id>`` beside the ledger) is SIGKILLed mid-body."""
    return _body(self, seconds, before=lambda: kill_if_asked(order_id))
