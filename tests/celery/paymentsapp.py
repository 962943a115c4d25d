"""The app of the payments trial (tests/celery/test_payments_trial.py): a charge as a payments
team would write it, run by a real prefork worker.

Configured by the same environment as ``workerapp`` (DLOCK_TEST_BROKER, DLOCK_TEST_RESULTS,
DLOCK_TEST_LOCKS, DLOCK_TEST_LEDGER, DLOCK_TEST_QUEUE, DLOCK_TEST_METRICS), and
DLOCK_TEST_RETENTION (``dlock_history_retention``, seconds), DLOCK_TEST_NAMESPACE
(``dlock_namespace``).

The gateway is a file beside the ledger: one line per call, with the idempotency key it was
given; like Stripe's, it charges once per idempotency key and answers the first reference
for every call with that key.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from celery import Celery

from celery_dlock import LockedTask, install

app = Celery("paymentsapp")
app.conf.update(
    broker_url=os.environ["DLOCK_TEST_BROKER"],
    result_backend=os.environ["DLOCK_TEST_RESULTS"],
    dlock_backend=os.environ["DLOCK_TEST_LOCKS"],
    dlock_janitor_interval=3600.0,
    dlock_namespace=os.environ.get("DLOCK_TEST_NAMESPACE", "job"),
    dlock_history_retention=float(os.environ.get("DLOCK_TEST_RETENTION", str(30 * 86400))),
    dlock_metrics=os.environ.get("DLOCK_TEST_METRICS") == "1",
    task_default_queue=os.environ.get("DLOCK_TEST_QUEUE", "celery"),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 3600.0},
)
install(app)

LEDGER = Path(os.environ["DLOCK_TEST_LEDGER"])
GATEWAY = LEDGER.with_name("gateway.jsonl")


def _append(path: Path, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Append ``entry`` to ``path`` under an exclusive lock; the lines before it."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        before = [json.loads(line) for line in f.read().splitlines() if line]
        f.write(json.dumps(entry) + "\n")
    return before


def ledger(event: str, task: Any, **data: Any) -> None:
    lease = task.lease
    _append(
        LEDGER,
        {
            "event": event,
            "task": task.name,
            "id": task.request.id,
            "pid": os.getpid(),
            "key": None if lease is None else lease.key,
            "fence": None if lease is None else lease.fence,
            "token": None if lease is None else lease.token,
            **data,
        },
    )


def gateway_charge(order_id: str, amount: str, idempotency_key: str) -> str:
    """The card gateway: a reference per idempotency key, the first one for every repeat."""
    reference = f"ch_{uuid.uuid4().hex[:12]}"
    entry = {"order": order_id, "amount": amount, "key": idempotency_key, "ref": reference}
    for earlier in _append(GATEWAY, entry):
        if earlier["key"] == idempotency_key:
            return str(earlier["ref"])
    return reference


def charges_table() -> tuple[str, str]:
    base, _, query = os.environ["DLOCK_TEST_LOCKS"].partition("?")
    return base, f'"{dict(parse_qsl(query))["schema"]}".payments_ledger'


def _killed_here(order_id: str) -> None:
    """SIGKILL this child if the test left a ``kill-<order_id>`` file (removed first)."""
    hook = LEDGER.with_name(f"kill-{order_id}")
    if hook.exists():
        hook.unlink()
        os.kill(os.getpid(), signal.SIGKILL)


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    name="p.charge",
    lock_key="order:{order_id}",
    once=True,
    acks_late=True,
    reject_on_worker_lost=True,
    lock_retry_backoff=0.1,
    lock_retry_backoff_max=0.5,
)
def charge(self: Any, order_id: str, amount: str, transactional: bool = False) -> dict[str, Any]:
    """Charge the card through the gateway with the idempotency key, then write the ledger
    (Postgres, with the success in its transaction when ``transactional``); a child told
    to die is SIGKILLed after both, before the release."""
    ledger("start", self, idempotency_key=self.idempotency_key, retries=self.request.retries)
    reference = gateway_charge(order_id, amount, self.idempotency_key)
    result = {"order": order_id, "reference": reference}
    if transactional:
        import psycopg

        url, table = charges_table()
        with psycopg.connect(url) as connection:
            connection.execute(f"INSERT INTO {table} VALUES (%s, %s)", (order_id, reference))
            self.record_success(connection, result)
    ledger("charged", self, reference=reference)
    _killed_here(order_id)
    return result


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    name="p.gated",
    lock_key="order:{order_id}",
    once=True,
    lock_retry_backoff=0.1,
    lock_retry_backoff_max=0.5,
)
def gated(self: Any, order_id: str, amount: str) -> dict[str, Any]:
    """A charge that waits, after the gateway, for the test's ``go-<order_id>-<n>`` file
    (n: the bodies of this order started before it), so that a test orders the ends of
    two overlapping bodies."""
    n = sum(
        1
        for line in LEDGER.read_text().splitlines()
        if json.loads(line)["key"] == f"job:order:{order_id}"
        and json.loads(line)["event"] == "start"
    )
    ledger("start", self, idempotency_key=self.idempotency_key, n=n)
    reference = gateway_charge(order_id, amount, self.idempotency_key)
    gate = LEDGER.with_name(f"go-{order_id}-{n}")
    deadline = time.monotonic() + 120
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    ledger("charged", self, reference=reference, n=n)
    return {"order": order_id, "reference": reference, "n": n}


@app.task(
    shared=False,
    base=LockedTask,
    bind=True,
    name="p.quote",
    lock_key="quote:{order_id}",
    once=True,
    lock_retry_backoff=0.1,
    lock_retry_backoff_max=0.5,
)
def quote(self: Any, order_id: str, rate: float) -> dict[str, Any]:
    """A once task whose result holds a float the caller chose (NaN, inf: not strict JSON)."""
    ledger("start", self)
    return {"order": order_id, "rate": rate}
