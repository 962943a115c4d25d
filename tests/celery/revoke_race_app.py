"""The app of tests/celery/test_revoke_queued_race.py's prefork worker: ``dedupe`` tasks whose
worker can be held at a chosen point of starting a message, so that a ``revoke_queued``
lands exactly there rather than when timing allows.

Configured by environment as ``workerapp`` is (:func:`tests.support.workerapps.worker_app`).
The pauses are files beside the ledger, named for the task's ``customer`` argument: with
``pause-taken-<customer>``, the child that took the message stops before its body lock
(``before_start``); with ``pause-held-<customer>``, once it holds its body lock, before the
body may start. Each writes a ``paused`` event to the ledger, then waits for ``go-<customer>``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from celery_dlock import LockedTask

if not __package__:
    # A top-level module of a worker run in tests/celery: the tree's root goes first on
    # sys.path, as pytest's `pythonpath = ["."]` puts it, for `tests.support`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.workerapps import beside_ledger, ledger, locked_task, worker_app

app = worker_app("revoke_race_app")


def _pause(task: Any, where: str, customer: str) -> None:
    """Wait for ``go-<customer>`` if ``pause-<where>-<customer>`` lies beside the ledger."""
    if not beside_ledger(f"pause-{where}-{customer}").exists():
        return
    ledger("paused", task, where=where)
    while not beside_ledger(f"go-{customer}").exists():
        time.sleep(0.01)


class Pausing(LockedTask):
    """A LockedTask whose start can be held (see the module's docstring)."""

    abstract = True

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        _pause(self, "taken", kwargs.get("customer", args[0] if args else ""))

    def _started(self, request: Any) -> None:
        _pause(self, "held", dict(request.kwargs or {}).get("customer", (request.args or [""])[0]))
        super()._started(request)


def _body(task: Any, seconds: float) -> dict[str, Any]:
    ledger("start", task)
    time.sleep(seconds)
    ledger("end", task)
    return {"fence": task.lease.fence}


@locked_task(app, "r.finished", base=Pausing, lock_key="race:{customer}", dedupe="until_finished")
def finished(self: Any, customer: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)


@locked_task(app, "r.started", base=Pausing, lock_key="race:{customer}", dedupe="until_started")
def started(self: Any, customer: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)
