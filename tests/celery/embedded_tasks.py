"""Tasks run by the embedded worker (tests/celery/conftest.py). Bodies note what they saw
in ``SEEN``, keyed by a per-test id, so tests can assert what ran."""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID

from celery import shared_task
from celery.exceptions import Ignore, Reject

from celery_dlock import Lease, LockedTask

SEEN: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)


def note(task: Any, run: str, **extra: Any) -> None:
    lease = task.lease
    SEEN[run].append(
        {
            "task": task.name,
            "retries": task.request.retries,
            "key": None if lease is None else lease.key,
            "fence": None if lease is None else lease.fence,
            "token": None if lease is None else lease.token,
            **extra,
        }
    )


@shared_task(base=LockedTask, bind=True, name="t.charge", lock_key="order:{run}", once=True)
def charge(self: Any, run: str, amount: int) -> dict[str, Any]:
    note(self, run)
    return {"run": run, "amount": amount}


@shared_task(base=LockedTask, bind=True, name="t.charge_flaky", lock_key="order:{run}", once=True)
def charge_flaky(self: Any, run: str, fail: bool) -> str:
    note(self, run)
    if fail:
        raise ValueError("card declined")
    return "charged"


@shared_task(base=LockedTask, bind=True, name="t.refund", lock_key="order:{run}")
def refund(self: Any, run: str) -> str:
    note(self, run)
    return "refunded"


@shared_task(base=LockedTask, bind=True, name="t.explode", lock_key="explode:<run>")
def explode(self: Any, run: str) -> None:
    note(self, run)
    raise KeyError(f"no such order in {run}")


@shared_task(
    base=LockedTask,
    bind=True,
    name="t.flaky",
    lock_key="flaky:{run}",
    max_retries=3,
)
def flaky(self: Any, run: str, failures: int) -> int:
    note(self, run)
    if self.request.retries < failures:
        raise self.retry(countdown=0.2, exc=ConnectionError("gateway down"))
    return int(self.request.retries)


@shared_task(
    base=LockedTask,
    bind=True,
    name="t.flaky_release",
    lock_key="flaky:{run}",
    max_retries=3,
    lock_across_retries=False,
)
def flaky_release(self: Any, run: str, failures: int) -> int:
    note(self, run)
    if self.request.retries < failures:
        raise self.retry(countdown=0.2)
    return int(self.request.retries)


@shared_task(base=LockedTask, bind=True, name="t.ignore", lock_key="ignore:{run}")
def ignore(self: Any, run: str) -> None:
    note(self, run)
    raise Ignore()


@shared_task(base=LockedTask, bind=True, name="t.reject", lock_key="reject:{run}")
def reject(self: Any, run: str) -> None:
    note(self, run)
    raise Reject("bad payload", requeue=False)


@shared_task(base=LockedTask, bind=True, name="t.skip", lock_key="busy:{run}", on_locked="skip")
def skip(self: Any, run: str) -> str:
    note(self, run)
    return "ran"


@shared_task(base=LockedTask, bind=True, name="t.fail", lock_key="busy:{run}", on_locked="fail")
def fail(self: Any, run: str) -> str:
    note(self, run)
    return "ran"


@shared_task(
    base=LockedTask,
    bind=True,
    name="t.requeue",
    lock_key="busy:{run}",
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.2,
    max_retries=0,
)
def requeue(self: Any, run: str) -> int:
    note(self, run)
    return int(self.request.retries)


def _busy_policy(task: Any, key: str, lease: Lease | None) -> dict[str, Any]:
    return {"busy": key, "fence": None if lease is None else lease.fence}


@shared_task(
    base=LockedTask, bind=True, name="t.custom", lock_key="busy:{run}", on_locked=_busy_policy
)
def custom(self: Any, run: str) -> str:
    note(self, run)
    return "ran"


@shared_task(
    base=LockedTask,
    bind=True,
    name="t.long",
    lock_key="long:{run}",
    lock_ttl=1.5,  # renewed every 0.5 s, each renewal with 1 s to spare under load
)
def long(self: Any, run: str, seconds: float) -> list[float]:
    note(self, run)
    expiries = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        lease = self.lease
        expiries.append(lease.expires_at)
        time.sleep(0.05)
    return expiries


@shared_task(
    base=LockedTask,
    bind=True,
    name="t.doomed",
    lock_key="doomed:{run}",
    lock_ttl=3.0,  # must not expire before the test takes it; the next renewal sees that
    on_lock_lost="raise",
)
def doomed(self: Any, run: str) -> str:
    note(self, run)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # pure Python: the injected error lands here
        sum(range(1000))
    return "finished without noticing"


@shared_task(
    base=LockedTask,
    bind=True,
    name="t.patient",
    lock_key="busy:{run}",
    lock_wait=30.0,
    on_locked="fail",
)
def patient(self: Any, run: str) -> str:
    note(self, run)
    return "ran"


@shared_task(
    base=LockedTask,
    bind=True,
    name="t.impatient",
    lock_key="busy:{run}",
    lock_wait=0.5,
    on_locked="fail",
)
def impatient(self: Any, run: str) -> str:
    note(self, run)
    return "ran"


def _about_the_charge(run: str, amount: int, currency: str = "EUR") -> dict[str, Any]:
    return {"amount": amount, "currency": currency}


@shared_task(
    base=LockedTask,
    bind=True,
    name="t.charge_described",
    lock_key="order:{run}",
    lock_metadata=_about_the_charge,
)
def charge_described(self: Any, run: str, amount: int, currency: str = "EUR") -> Any:
    lease = self.lease
    note(self, run, metadata=None if lease is None else lease.metadata)
    return amount


class GatewayError(Exception):
    """An exception whose ``__str__`` fails, as a custom one reading a missing field does."""

    def __str__(self) -> str:
        payload: dict[str, str] = self.args[0]
        return f"{payload['code']}: {payload['message']}"


@shared_task(base=LockedTask, bind=True, name="t.unprintable", lock_key="unprintable:{run}")
def unprintable(self: Any, run: str) -> None:
    note(self, run)
    raise GatewayError({"error": "gateway said no"})


@shared_task(base=LockedTask, bind=True, name="t.charge_typed", lock_key="typed:{run}", once=True)
def charge_typed(self: Any, run: str) -> dict[str, Any]:
    note(self, run)
    return {
        "amount": Decimal("1.50"),
        "at": datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc),
        "id": UUID(int=42),
        "receipt": b"abc",
    }


@shared_task(base=LockedTask, bind=True, name="t.charge_deep", lock_key="deep:{run}", once=True)
def charge_deep(self: Any, run: str) -> list[Any]:
    note(self, run)
    deep: list[Any] = []
    for _ in range(5000):  # deeper than json.dumps can go
        deep = [deep]
    return deep


@shared_task(base=LockedTask, bind=True, name="t.paginate", lock_key="page:{run}:{cursor}")
def paginate(self: Any, run: str, cursor: int) -> int:
    note(self, run, cursor=cursor)
    if cursor < 2:  # the next page is another key
        raise self.retry(kwargs={"run": run, "cursor": cursor + 1}, countdown=0.1)
    return cursor


@shared_task(base=LockedTask, bind=True, name="t.resume", lock_key="resume:{run}")
def resume(self: Any, run: str, step: int) -> int:
    note(self, run, step=step)
    if step < 1:  # a positional call retried with keywords: the same key
        raise self.retry(kwargs={"run": run, "step": step + 1}, countdown=0.1)
    return step


@shared_task(base=LockedTask, bind=True, name="t.retry_soon", lock_key="soon:{run}")
def retry_soon(self: Any, run: str) -> None:
    note(self, run)
    raise self.retry(countdown=1)
