"""The app of tests/celery/test_several_keys_trial.py's prefork workers: tasks that lock
several keys (``lock_key`` as a list of templates) or a key's slots (``lock_limit``).

Configured by environment as ``workerapp`` is (:func:`tests.support.workerapps.worker_app`).
A body SIGKILLs its own child when a file ``kill-<src>`` lies beside the ledger (the file is
removed first, so a redelivery runs to its end).
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

from tests.support.workerapps import kill_if_asked, locked_task, worker_app, write_event

app = worker_app("several_keys_trial_app")
#: The keys of a move: its source and destination accounts.
ACCOUNTS = ["account:{src}", "account:{dst}"]


def ledger(event: str, task: Any, **data: Any) -> None:
    """Append one event, with every lease the request holds, to the shared ledger file."""
    keys = [lease.key for lease in task.leases]
    write_event(event, task, keys=keys, tokens=[lease.token for lease in task.leases], **data)


def _move(task: Any, src: str, seconds: float) -> list[str]:
    ledger("start", task)
    kill_if_asked(src)
    time.sleep(seconds)
    ledger("end", task)
    return [lease.key for lease in task.leases]


@locked_task(app, "t.move", lock_key=ACCOUNTS, on_locked="skip")
def move(self: Any, src: str, dst: str, seconds: float) -> list[str]:
    return _move(self, src, seconds)


@locked_task(app, "t.move_late", lock_key=ACCOUNTS, acks_late=True, reject_on_worker_lost=True)
def move_late(self: Any, src: str, dst: str, seconds: float) -> list[str]:
    return _move(self, src, seconds)


@locked_task(app, "t.move_careful", lock_key=ACCOUNTS, lock_ttl=1.5, on_lock_lost="raise")
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


@locked_task(app, "t.move_queued", lock_key=ACCOUNTS, dedupe="until_finished")
def move_queued(self: Any, src: str, dst: str, seconds: float) -> list[str]:
    return _move(self, src, seconds)


@locked_task(
    app, "t.export", lock_key="export:{tenant}", lock_limit=2, on_locked="skip", max_retries=1
)
def export(self: Any, tenant: str, seconds: float, retry: bool = False) -> str:
    """Holds one of the tenant's two slots; ``retry``: retries in an hour, keeping it."""
    ledger("start", self, retries=self.request.retries)
    kill_if_asked(tenant)
    if retry:
        raise self.retry(countdown=3600)
    time.sleep(seconds)
    ledger("end", self)
    return self.lease.key
