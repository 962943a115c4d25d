"""``once`` beyond the store's own memory: ``record_success`` in the app's own transaction
(a refused second success replays the first), and ``idempotency_key`` for effects outside
any database we reach. Eager runs of real tasks on a real Postgres store."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dlock import (
    ConfigurationError,
    Holder,
    Lease,
    LockedTask,
    Outcome,
    Record,
    backend_from_url,
    install,
)
from celery_dlock.backends.base import LockBackend
from tests.support.services import POSTGRES_URL, drop_schema, postgres_admin, with_options

psycopg = pytest.importorskip("psycopg")


@pytest.fixture(scope="module")
def pg() -> Iterator[tuple[Celery, dict[str, Any], LockBackend, str]]:
    admin = postgres_admin()
    schema = f"dlock_once_{os.urandom(4).hex()}"
    url = with_options(POSTGRES_URL, schema=schema)
    store = backend_from_url(url)
    store.migrate()  # type: ignore[attr-defined]
    admin.execute(f'CREATE TABLE "{schema}".charges (key text, token text)')
    app = Celery("once-tests", set_as_current=False)
    app.conf.update(task_always_eager=True, dlock_backend=url)
    install(app, janitor=False)
    seen: dict[str, Any] = {"keys": [], "before_commit": None}

    @app.task(
        shared=False,
        base=LockedTask,
        bind=True,
        name="o.charge",
        lock_key="order:{order}",
        once=True,
    )
    def charge(self: Any, order: str, attempts: int = 1, fail: bool = False) -> dict[str, Any]:
        seen["keys"].append((self.name, order, self.idempotency_key, self.request.retries))
        if fail:
            raise ZeroDivisionError("the gateway timed out")
        if self.request.retries < attempts - 1:
            raise self.retry(countdown=0)
        result = {"order": order, "fence": self.lease.fence}
        with psycopg.connect(POSTGRES_URL) as conn:
            conn.execute(
                f'INSERT INTO "{schema}".charges VALUES (%s, %s)',
                (self.lease.key, self.lease.token),
            )
            if seen["before_commit"] is not None:
                seen["before_commit"](self.lease)
            self.record_success(conn, result)
        return result

    @app.task(shared=False, base=LockedTask, bind=True, name="o.refund", lock_key="order:{order}")
    def refund(self: Any, order: str) -> str:
        seen["keys"].append((self.name, order, self.idempotency_key, self.request.retries))
        with psycopg.connect(POSTGRES_URL) as conn:
            self.record_success(conn, "refunded")
        return "refunded"

    seen.update(charge=charge, refund=refund)
    try:
        yield app, seen, store, schema
    finally:
        store.close()
        drop_schema(admin, schema)
        admin.close()


def charged(schema: str, key: str) -> list[str]:
    with psycopg.connect(POSTGRES_URL) as conn:
        rows = conn.execute(f'SELECT token FROM "{schema}".charges WHERE key = %s', (key,))
        return [str(row[0]) for row in rows.fetchall()]


def test_record_success_commits_with_the_charge_and_the_duplicate_replays_it(
    pg: tuple[Celery, dict[str, Any], LockBackend, str],
) -> None:
    _, seen, store, schema = pg
    order = uuid.uuid4().hex[:8]
    first = seen["charge"].apply((order,)).get()
    again = seen["charge"].apply((order,)).get()
    assert again == first
    key = f"job:order:{order}"
    kept = store.last_success(key, "o.charge")
    assert kept is not None and kept.result == {"value": first}
    assert len(charged(schema, key)) == 1


def test_a_success_kept_meanwhile_rolls_the_charge_back_and_is_replayed(
    pg: tuple[Celery, dict[str, Any], LockBackend, str],
) -> None:
    """Another run's success commits between this run's once check and its own commit (its
    lease was lost and a duplicate ran): this run's transaction is refused, its charge
    rolled back, and it returns the winner's result."""
    _, seen, store, schema = pg
    order = uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    winner = Holder.current(task_name="o.charge", task_id="the-winner")
    winning = Record(
        Lease(key, uuid.uuid4().hex, 1, winner, 1.0, None),
        2.0,
        Outcome.SUCCEEDED,
        None,
        None,
        {"value": {"order": order, "fence": 1}},
    )
    seen["before_commit"] = lambda lease: store.remember(winning)
    try:
        answer = seen["charge"].apply((order,)).get()
    finally:
        seen["before_commit"] = None
    assert answer == {"order": order, "fence": 1}  # the winner's result, replayed
    assert charged(schema, key) == []  # this run's charge rolled back with its success
    kept = store.last_success(key, "o.charge")
    assert kept is not None and kept.lease.token == winning.lease.token
    [mine] = store.history(key=key)
    assert mine.outcome is Outcome.SKIPPED and mine.problem == "once"


def test_record_success_is_refused_outside_a_once_task(
    pg: tuple[Celery, dict[str, Any], LockBackend, str],
) -> None:
    _, seen, _, _ = pg
    with pytest.raises(ConfigurationError, match="record_success is for once=True tasks"):
        seen["refund"].apply((uuid.uuid4().hex[:8],)).get()


def test_the_idempotency_key_is_one_per_logical_operation(
    pg: tuple[Celery, dict[str, Any], LockBackend, str],
) -> None:
    _, seen, _, _ = pg
    seen["keys"].clear()
    order, other = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    with pytest.raises(ZeroDivisionError):
        seen["charge"].apply((order,), {"fail": True}).get()  # a failed first submission
    seen["charge"].apply((order,), {"attempts": 3}).get()  # a duplicate: two retries, a success
    seen["charge"].apply((other,)).get()
    with pytest.raises(ConfigurationError):
        seen["refund"].apply((order,)).get()  # another task on the same key

    charges = [(key, r) for name, o, key, r in seen["keys"] if name == "o.charge" and o == order]
    charge_keys = [key for key, _ in charges]
    assert [retries for _, retries in charges] == [0, 0, 1, 2]
    assert len(set(charge_keys)) == 1  # every submission and every retry of the charge
    [other_key] = [key for _, o, key, _ in seen["keys"] if o == other]
    [refund_key] = [key for name, _, key, _ in seen["keys"] if name == "o.refund"]
    assert len({charge_keys[0], other_key, refund_key}) == 3
    for key in (charge_keys[0], other_key, refund_key):
        assert key.startswith("dlock-") and order not in key and other not in key
