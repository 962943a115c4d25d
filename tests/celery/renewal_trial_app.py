"""The app of tests/celery/test_renewal_trial.py's prefork worker: a ``once`` task with
``on_lock_lost="raise"`` and a short ttl, configured by environment as ``workerapp`` is
(:func:`tests.support.workerapps.worker_app`).

The body writes ``start`` with its lease to the ledger, then ``renewed`` once its lease
was renewed twice (saying whether ``self.lease`` kept its key, token and fence), and holds
its key until a file ``go-<run>`` appears; ``lost`` if LockLostError reached it, else
``end``.
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

from celery_dlock import LockLostError
from tests.support.workerapps import beside_ledger, ledger, locked_task, worker_app

app = worker_app("renewal_trial_app")


@locked_task(app, "rt.sync", lock_key="sync:{run}", lock_ttl=0.6, on_lock_lost="raise", once=True)
def sync(self: Any, run: str) -> dict[str, Any]:
    first = self.lease
    ledger("start", self, run=run)
    gate = beside_ledger(f"go-{run}")
    renewals, last, said = 0, first.expires_at, False
    deadline = time.monotonic() + 30
    try:
        while not gate.exists() and time.monotonic() < deadline:
            lease = self.lease
            if lease.expires_at != last:
                renewals, last = renewals + 1, lease.expires_at
            if renewals >= 2 and not said:
                same = (lease.key, lease.token, lease.fence) == (
                    first.key,
                    first.token,
                    first.fence,
                )
                ledger("renewed", self, run=run, same=same)
                said = True
            time.sleep(0.02)
    except LockLostError:
        ledger("lost", self, run=run)
        raise
    ledger("end", self, run=run)
    return {"run": run, "fence": first.fence}
