"""The app the real prefork worker of the Celery tests runs (``tests.celery.prefork``; the
``worker`` fixture of tests/celery/conftest.py and the tests that start their own).

Configured by environment (:func:`tests.support.workerapps.worker_app`); its task bodies
append events to the ledger file DLOCK_TEST_LEDGER.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

if not __package__:
    # A top-level module of a worker or producer run in tests/celery: the tree's root goes
    # first on sys.path, as pytest's `pythonpath = ["."]` puts it, for `tests.support`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from celery.signals import task_failure, task_prerun

from tests.support.workerapps import kill_if_asked, ledger, locked_task, worker_app, write_event

app = worker_app("workerapp")


def _body(task: Any, seconds: float, **data: Any) -> dict[str, Any]:
    ledger("start", task, **data)
    time.sleep(seconds)
    ledger("end", task, **data)
    return {"fence": task.lease.fence, "pid": os.getpid()}


@locked_task(
    app,
    "w.charge",
    lock_key="order:<order_id>",
    once=True,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.3,
)
def charge(self: Any, order_id: int, amount: int) -> dict[str, Any]:
    return _body(self, 0.2, amount=amount)


@locked_task(
    app,
    "w.serial",
    lock_key="serial:{order_id}",
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.3,
)
def serial(self: Any, order_id: int, n: int) -> dict[str, Any]:
    return _body(self, 0.05, n=n)


@locked_task(app, "w.hold", lock_key="hold:{order_id}")
def hold(self: Any, order_id: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)


@locked_task(app, "w.fragile", lock_key="fragile:{order_id}", on_lock_lost="raise")
def fragile(self: Any, order_id: str) -> None:
    ledger("start", self)
    for _ in range(600):
        time.sleep(0.1)  # short sleeps: LockLostError is raised between two of them
    ledger("end", self)


@locked_task(app, "w.soft", lock_key="soft:{order_id}", soft_time_limit=0.5)
def soft(self: Any, order_id: str) -> dict[str, Any]:
    return _body(self, 5)


@locked_task(
    app, "w.soft_release", lock_key="soft-release:{order_id}", once=True, soft_time_limit=2.0
)
def soft_release(self: Any, order_id: str) -> dict[str, Any]:
    return _body(self, 1.0)  # ends before its soft limit; its release may not


@locked_task(app, "w.hard", lock_key="hard:{order_id}", time_limit=1.0)
def hard(self: Any, order_id: str) -> dict[str, Any]:
    return _body(self, 10)


@locked_task(app, "w.late", lock_key="late:{order_id}", acks_late=True, on_locked="skip")
def late(self: Any, order_id: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)


@locked_task(app, "w.later", lock_key="later:{order_id}", max_retries=1)
def later(self: Any, order_id: str) -> None:
    ledger("start", self)
    raise self.retry(countdown=3600)


def charges_table() -> tuple[str, str]:
    """The lock store's database URL and the ``charges`` table in its schema: the app's own
    data beside the store's tables, as a payments app's ledger would be."""
    base, _, query = os.environ["DLOCK_TEST_LOCKS"].partition("?")
    return base, f'"{dict(parse_qsl(query))["schema"]}".charges'


@locked_task(app, "w.pay", lock_key="pay:{order_id}", once=True)
def pay(self: Any, order_id: str, transactional: bool) -> dict[str, Any]:
    """Charge: a row in ``charges``, committed; with ``transactional`` the once success is
    written in the same transaction. If a file ``kill-<order_id>`` lies beside the ledger, the
    child removes it and SIGKILLs itself right after the commit, before the release."""
    import psycopg

    ledger("start", self)
    url, table = charges_table()
    result = {"order": order_id, "fence": self.lease.fence}
    with psycopg.connect(url) as connection:
        connection.execute(f"INSERT INTO {table} VALUES (%s, %s)", (order_id, self.lease.token))
        if transactional:
            self.record_success(connection, result)
    ledger("committed", self)
    kill_if_asked(order_id)
    return result


# -- enqueue-time de-duplication (tests/celery/test_dedupe.py) ------------------------------


@locked_task(app, "w.sync", lock_key="sync:{customer}", dedupe="until_started")
def sync(self: Any, customer: str, seconds: float) -> dict[str, Any]:
    return _body(self, seconds)


@locked_task(
    app, "w.sync_strict", lock_key="sync:{customer}", dedupe="until_started", on_duplicate="raise"
)
def sync_strict(self: Any, customer: str) -> dict[str, Any]:
    return _body(self, 0)


@locked_task(app, "w.sync_wait", lock_key="sync:{customer}", dedupe="until_started", lock_wait=60)
def sync_wait(self: Any, customer: str) -> dict[str, Any]:
    """Waits for a busy key inside its child, its mark held: a test kills it there."""
    return _body(self, 0)


@locked_task(
    app, "w.sync_wait_celery_request", lock_key="sync:{customer}", dedupe="until_started",
    lock_wait=60, Request="celery.worker.request:Request",
)  # fmt: skip
def sync_wait_celery_request(self: Any, customer: str) -> dict[str, Any]:
    """``sync_wait`` with Celery's own worker request class, not LockedTask's."""
    return _body(self, 0)


_KILLED_WAITING = ("w.sync_wait", "w.sync_wait_celery_request")


@task_prerun.connect
def _before_the_lock(sender: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) in _KILLED_WAITING:
        ledger("prerun", sender)  # key, fence and token None: no lease yet


@task_failure.connect
def _failed(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    if getattr(sender, "name", None) in _KILLED_WAITING:  # in the parent, for a dead child
        write_event("failure", sender, key=None, fence=None, token=None, failed=task_id)


@locked_task(app, "w.report", lock_key="report:{customer}", dedupe="until_finished", max_retries=1)
def report(
    self: Any, customer: str, seconds: float, fail: bool = False, retry: bool = False
) -> dict[str, Any]:
    ledger("start", self, retries=self.request.retries)
    if retry and self.request.retries == 0:
        raise self.retry(countdown=2)
    time.sleep(seconds)
    if fail:
        raise ValueError(f"report of {customer} failed")
    ledger("end", self)
    return {"fence": self.lease.fence}


@locked_task(
    app, "w.report_or_skip", lock_key="report:{customer}", dedupe="until_finished", on_locked="skip"
)
def report_or_skip(self: Any, customer: str) -> dict[str, Any]:
    return _body(self, 0)


def _coalesced(task: Any, key: str, queued_id: str | None) -> dict[str, Any]:
    """An ``on_duplicate`` callable: what a duplicate ``apply_async`` returns instead."""
    return {"task": task.name, "mark": key, "queued": queued_id}


@locked_task(
    app,
    "w.sync_custom",
    lock_key="sync:{customer}",
    dedupe="until_started",
    on_duplicate=_coalesced,
)
def sync_custom(self: Any, customer: str) -> dict[str, Any]:
    return _body(self, 0)


@locked_task(
    app,
    "w.pooled",
    lock_key="pool:{tenant}",
    lock_limit=2,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.3,
)
def pooled(self: Any, tenant: str, n: int) -> dict[str, Any]:
    return _body(self, 0.4, n=n)


@locked_task(app, "w.transfer", lock_key=["account:{source}", "account:{target}"], lock_wait=120)
def transfer(self: Any, source: str, target: str, n: int) -> list[str]:
    ledger("start", self, keys=[lease.key for lease in self.leases], n=n)
    time.sleep(0.005)
    ledger("end", self, keys=[lease.key for lease in self.leases], n=n)
    return [lease.key for lease in self.leases]


@locked_task(app, "w.invoice", lock_key="invoice:{order_id}", once=True)
def invoice(self: Any, order_id: str) -> Any:
    """Writes the invoice (the effect), then hands the mailing to another task."""
    ledger("start", self)
    ledger("end", self)
    return self.replace(mail.s(order_id))


@app.task(shared=False, bind=True, name="w.mail")
def mail(self: Any, order_id: str) -> str:
    write_event("mail", self, key=None, order_id=order_id)
    return f"mailed {order_id}"


@locked_task(app, "w.paged", lock_key="paged:{customer}", once=True)
def paged(self: Any, customer: str, page: int, last: int) -> Any:
    """Syncs one page, then replaces itself with the next page's run, on the same key."""
    ledger("start", self, page=page)
    ledger("end", self, page=page)
    if page < last:
        return self.replace(paged.s(customer, page + 1, last))
    return {"pages": page}


@locked_task(app, "w.handed", lock_key="handed:{customer}", dedupe="until_finished")
def handed(self: Any, customer: str) -> Any:
    """Queued under a dedupe mark until it ends: by handing its run to the mailing."""
    ledger("start", self)
    ledger("end", self)
    return self.replace(mail.s(customer))
