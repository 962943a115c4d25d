"""The app of tests/celery/test_limit_trial.py's prefork workers: tasks that lock one of a
key's slots (``lock_limit=2``), configured by environment as ``workerapp`` is
(:func:`tests.support.workerapps.worker_app`).

A body writes ``start`` and ``end`` events with its lease to the ledger, and SIGKILLs its own
child when a file ``kill-<run>`` lies beside the ledger (removed first, so a redelivery runs
to its end). It holds its slot until ``seconds`` pass or a file ``go-<run>`` appears.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

if not __package__:
    # A top-level module of a worker run in tests/celery: the tree's root goes first on
    # sys.path, as pytest's `pythonpath = ["."]` puts it, for `tests.support`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.workerapps import beside_ledger, kill_if_asked, ledger, locked_task, worker_app

app = worker_app("limit_trial_app")

#: Short re-queue delays for a busy key: the tests do not wait for the default backoff.
QUICK = {"lock_retry_backoff": 0.05, "lock_retry_backoff_max": 0.3}


def _body(task: Any, run: str, seconds: float) -> dict[str, Any]:
    ledger("start", task, run=run, retries=task.request.retries)
    kill_if_asked(run)
    gate = beside_ledger(f"go-{run}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not gate.exists():
        time.sleep(0.02)
    lease = task.lease
    ledger("end", task, run=run, retries=task.request.retries)
    return {"key": lease.key, "token": lease.token, "fence": lease.fence}


@locked_task(app, "lt.skip", lock_key="export:{run}", lock_limit=2, on_locked="skip")
def skip(self: Any, run: str, seconds: float) -> dict[str, Any]:
    """Two at once per run; a third is skipped."""
    return _body(self, run, seconds)


@locked_task(app, "lt.queue", lock_key="export:{run}", lock_limit=2, **QUICK)
def queue(self: Any, run: str, seconds: float) -> dict[str, Any]:
    """Two at once per run; a third is re-queued until a slot is free."""
    return _body(self, run, seconds)


@locked_task(
    app,
    "lt.late",
    lock_key="late:{run}",
    lock_limit=2,
    on_locked="skip",
    acks_late=True,
    reject_on_worker_lost=True,
)
def late(self: Any, run: str, seconds: float) -> dict[str, Any]:
    """acks_late: a child killed in the body has its message redelivered; a busy key (both
    slots held by others) is skipped."""
    return _body(self, run, seconds)


@locked_task(app, "lt.retrying", lock_key="export:{run}", lock_limit=2, max_retries=1)
def retrying(self: Any, run: str, seconds: float) -> dict[str, Any]:
    """Retries once in ``seconds``, keeping its slot for the retry, then returns."""
    ledger("start", self, run=run, retries=self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=seconds)
    lease = self.lease
    ledger("end", self, run=run, retries=self.request.retries)
    return {"key": lease.key, "token": lease.token, "fence": lease.fence}


@locked_task(app, "lt.slow", lock_key="export:{run}", lock_limit=2, on_locked="skip", time_limit=1)
def slow(self: Any, run: str, seconds: float) -> dict[str, Any]:
    """A hard time limit of 1 s: a body longer than that has its child killed."""
    return _body(self, run, seconds)
