"""The payments tasks: each order's charge and refund share one lock key, ``job:order:<id>``.

- ``charge`` is guarded by ``once=True``: a second submission of the same order returns the
  first charge's result instead of charging again. Its ledger write carries the lease's
  fence, so a holder whose lease was lost (paused past it) cannot write. When the ledger is
  the lock store's own Postgres, the charge keeps its ``once`` success in the ledger's own
  transaction (``record_success``): a child killed after the commit and before the release
  cannot cause a second charge. The gateway call carries ``self.idempotency_key``, so even
  a duplicate that got past both ``once`` and the lock moves no money twice.
- ``refund`` takes the same key, so it never runs while the order is being charged.
- ``nightly_report`` is a singleton per day: a second run while one is going is skipped.
- ``sync_customer`` guards the queue (``dedupe="until_started"``): a burst of webhooks for
  one customer becomes at most one run queued behind one running.
- ``transfer`` holds both accounts (a list of ``lock_key`` templates).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import time
from typing import Any

from celery_dlock import LockedTask
from worker_example import gateway
from worker_example.app import DATA, LEDGER_URL, TRANSACTIONAL_SUCCESS, app
from worker_example.ledger import Ledger

ledger = Ledger(LEDGER_URL)


@app.task(
    base=LockedTask,
    bind=True,
    name="payments.charge",
    lock_key="order:<order_id>",
    once=True,
    lock_retry_backoff=0.2,
    lock_retry_backoff_max=1.0,
)
def charge(self: Any, order_id: int) -> dict[str, Any]:
    """Charge an order's card once, and write the charge under the lease's fence."""
    _, amount, card = ledger.order(order_id)
    reference = gateway.pay(DATA, card, amount, order_id, self.idempotency_key)
    lease = self.lease
    result: dict[str, Any] = {"order": order_id, "amount": str(amount), "reference": reference}

    def remember(cursor: Any, charge_id: int) -> None:
        result["charge"] = charge_id
        if TRANSACTIONAL_SUCCESS:
            self.record_success(cursor, result)

    ledger.charge(
        lease.key,
        lease.fence,
        order_id=order_id,
        amount=amount,
        task_id=self.request.id,
        pid=os.getpid(),
        then=remember,
    )
    return result


@app.task(base=LockedTask, bind=True, name="payments.refund", lock_key="order:<order_id>")
def refund(self: Any, order_id: int) -> dict[str, Any]:
    """Refund an order; never at the same time as its charge."""
    _, amount, _ = ledger.order(order_id)
    ledger.refund(self.lease.key, self.lease.fence, order_id, amount)
    return {"order": order_id, "refunded": str(amount)}


def _report_key(day: str | None = None) -> str:
    return f"report:{day or dt.date.today().isoformat()}"


@app.task(
    base=LockedTask,
    bind=True,
    name="payments.nightly_report",
    lock_key=_report_key,
    on_locked="skip",
    once=True,
)
def nightly_report(self: Any, day: str | None = None) -> dict[str, Any]:
    """Total the day's charges; one run per day, however often beat or a human asks."""
    day = day or dt.date.today().isoformat()
    total = ledger.report(self.lease.key, self.lease.fence, day)
    return {"day": day, "total": str(total)}


@app.task(
    base=LockedTask,
    bind=True,
    name="crm.sync_customer",
    lock_key="customer:{customer}",
    dedupe="until_started",
)
def sync_customer(self: Any, customer: str) -> dict[str, Any]:
    """Pull a customer's record from the CRM: a webhook fires it on every change, and
    ``dedupe`` keeps at most one run queued (behind at most one running)."""
    _append("syncs.jsonl", {"customer": customer, "task": self.request.id, "pid": os.getpid()})
    time.sleep(2.0)  # the CRM is slow
    return {"customer": customer}


@app.task(
    base=LockedTask,
    bind=True,
    name="payments.transfer",
    lock_key=["account:{source}", "account:{target}"],
    lock_wait=60,
)
def transfer(self: Any, source: str, target: str, amount: str) -> list[str]:
    """Move money between two accounts, holding both (all or none, in key order: opposite
    transfers never deadlock)."""
    keys = [lease.key for lease in self.leases]
    _append("transfers.jsonl", {"event": "start", "keys": keys, "at": time.monotonic()})
    time.sleep(0.05)
    _append("transfers.jsonl", {"event": "end", "keys": keys, "at": time.monotonic()})
    return keys


def _append(name: str, entry: dict[str, Any]) -> None:
    with open(os.path.join(DATA, name), "a") as log:
        fcntl.flock(log, fcntl.LOCK_EX)
        log.write(json.dumps(entry) + "\n")
