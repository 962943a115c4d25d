"""The Celery app of the soak (``soak.py``): one ``charge`` task, configured by environment.

    DLOCK_SOAK_BROKER     redis://127.0.0.1:PORT/7 (a private redis-server)
    DLOCK_SOAK_LOCKS      the lock store: a private PostgreSQL
    DLOCK_SOAK_LEDGER     postgresql://...#table: the fenced ledger (``ledger.py``), in the
                          lock store's own database, so each charge keeps its ``once``
                          success in the ledger's transaction (``record_success``)
    DLOCK_SOAK_NAMESPACE  the lock keys' namespace (fresh per run: ``once`` remembers)
    DLOCK_SOAK_LOGS       the directory of the bodies' logs, one file per pool process
    DLOCK_SOAK_VISIBILITY the broker's visibility timeout, seconds (short: redeliveries)
    DLOCK_SOAK_HOLD       the longest pause between the ledger's read and write, seconds
    DLOCK_SOAK_BROKEN     1: no ``once`` (and no kept success), to show the checker fails

``acks_late`` with the worker's defaults otherwise: a SIGKILLed child's message is acked
as failed (``WorkerLostError``), its lease released by the parent's handler or the store's
liveness, and the order charged by one of its duplicates.

Each body logs one JSON line per ``write`` (whole, or absent after a SIGKILL) to
``body-<pid>.jsonl``: ``{"e": "start", "order", "key", "token", "fence", "task", "t"}`` once
its lease is held, ``{"e": "end", "token", "read", "accepted", "t"}`` at its end (``accepted``
null if the ledger's server failed, ``"kept"`` if the success was kept already). ``t`` is
``time.monotonic()``, one clock for every process of the host.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_dlock import AlreadySucceededError, LockedTask, install

from .common import append_jsonl, soak_config
from .ledger import Ledger, LedgerError, open_ledger

ENV = os.environ.get
LOGS = Path(ENV("DLOCK_SOAK_LOGS", "."))
HOLD = float(ENV("DLOCK_SOAK_HOLD", "0.005"))
VISIBILITY = float(ENV("DLOCK_SOAK_VISIBILITY", "10"))
BROKEN = ENV("DLOCK_SOAK_BROKEN") == "1"

app = Celery("dlock_soak")
app.conf.update(
    soak_config(
        ENV("DLOCK_SOAK_BROKER", "redis://127.0.0.1:6379/7"),
        ENV("DLOCK_SOAK_LOCKS", "memory://"),
        ENV("DLOCK_SOAK_NAMESPACE", "soak"),
        VISIBILITY,
    )
)
install(app)


class StaleWriteError(RuntimeError):
    """The ledger refused this body's write: its fence is not the newest."""


_ledger: dict[int, Ledger] = {}


def ledger() -> Ledger:
    """This process's ledger client (made after the fork)."""
    pid = os.getpid()
    if pid not in _ledger:
        _ledger[pid] = open_ledger(ENV("DLOCK_SOAK_LEDGER", ""))
    return _ledger[pid]


def log(**entry: Any) -> None:
    """One line of this process's body log."""
    append_jsonl(LOGS / f"body-{os.getpid()}.jsonl", entry)


@app.task(
    base=LockedTask,
    bind=True,
    name="soak.charge",
    lock_key="order:{order_id}",
    once=not BROKEN,
    lock_retry_backoff=0.2,
    lock_retry_backoff_max=2.0,
    max_retries=None,
)
def charge(self: Any, order_id: int) -> int:
    """Charge an order: read its counter, write counter + 1 under the lease's fence, and keep
    the success in the same transaction."""
    lease = self.lease
    log(
        e="start", order=order_id, key=lease.key, token=lease.token, fence=lease.fence,
        task=self.request.id, t=time.monotonic(),
    )  # fmt: skip
    read: int | None = None
    accepted: bool | str | None = None
    try:
        read = ledger().read(lease.key, lease.fence)  # the fence registered first
        time.sleep(random.uniform(0, HOLD))
        keep = None if BROKEN else lambda cursor: self.record_success(cursor, 1)
        accepted = ledger().write(lease.key, lease.fence, read + 1, then=keep)
    except AlreadySucceededError:
        accepted = "kept"
        raise
    except LedgerError as exc:  # the store's server restarts: try again
        raise self.retry(countdown=0.5, exc=exc) from exc
    finally:
        log(e="end", token=lease.token, read=read, accepted=accepted, t=time.monotonic())
    if not accepted:  # a newer holder charged: this run must not be kept as the success
        raise StaleWriteError(f"{lease.key}: fence {lease.fence} refused by the ledger")
    return 1
