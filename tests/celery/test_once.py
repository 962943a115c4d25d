"""``once``: the body runs once and its duplicates replay the stored result (embedded and
eager runs, twenty concurrent submissions in a real prefork worker); a failure does not
count; ``record_success`` in the app's own transaction on a real Postgres store (a refused
second success replays the first, a child SIGKILLed after its commit charges once);
``idempotency_key`` for effects outside any database we reach."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

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
from celery_dlock.backends.memory import MemoryBackend
from tests.celery import embedded_tasks as tasks
from tests.celery.prefork import Worker, assert_never_overlapping, bodies
from tests.celery.support import new_run, outcomes
from tests.support import eventually
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


@pytest.mark.usefixtures("app")
def test_once_runs_the_body_once_and_replays_the_stored_result(store: MemoryBackend) -> None:
    run = new_run()
    first = tasks.charge.delay(run, 10).get(timeout=10)
    again = [tasks.charge.delay(run, 99).get(timeout=10) for _ in range(3)]
    assert again == [first] * 3 == [{"run": run, "amount": 10}] * 3
    assert len(tasks.SEEN[run]) == 1
    key = f"job:order:{run}"
    assert outcomes(store, key) == [Outcome.SUCCEEDED] + [Outcome.SKIPPED] * 3
    replay = store.history(key=key)[0]
    assert replay.problem == "once" and replay.details is not None
    assert "already succeeded" in replay.details


@pytest.mark.usefixtures("app")
def test_once_does_not_count_a_failure(store: MemoryBackend) -> None:
    run = new_run()
    with pytest.raises(ValueError):
        tasks.charge_flaky.delay(run, True).get(timeout=10)
    assert tasks.charge_flaky.delay(run, False).get(timeout=10) == "charged"
    assert tasks.charge_flaky.delay(run, False).get(timeout=10) == "charged"
    assert len(tasks.SEEN[run]) == 2


@pytest.mark.usefixtures("app")
def test_once_does_not_block_another_task_on_the_same_key(store: MemoryBackend) -> None:
    run = new_run()
    tasks.charge.delay(run, 1).get(timeout=10)
    assert tasks.refund.delay(run).get(timeout=10) == "refunded"
    assert tasks.refund.delay(run).get(timeout=10) == "refunded"
    assert [s["task"] for s in tasks.SEEN[run]] == ["t.charge", "t.refund", "t.refund"]


def test_eager_runs_lock_and_once(eager: tuple[Celery, dict[str, Any]]) -> None:
    _, calls = eager
    order = new_run()
    assert calls["charge"].delay(order).get() == f"receipt-{order}"
    assert calls["charge"].delay(order).get() == f"receipt-{order}"
    assert [run for run in calls["runs"] if run[1] == order] == [("charge", order, 1)]
    store = MemoryBackend.from_url("memory://eager-tests")
    outcomes = [r.outcome for r in store.history(key=f"job:order:{order}")]
    assert outcomes == [Outcome.SKIPPED, Outcome.SUCCEEDED]


@pytest.mark.slow
def test_twenty_concurrent_submissions_with_once_run_the_body_once(worker: Worker) -> None:
    order = int(uuid.uuid4().int % 10**9)
    other = order + 1
    results = [worker.tasks.charge.delay(order, 10) for _ in range(20)]
    results.append(worker.tasks.charge.delay(other, 5))
    answers = [result.get(timeout=120) for result in results]
    assert len({json.dumps(a) for a in answers[:20]}) == 1  # every caller got the first result
    key = f"job:order:{order}"
    events = bodies(worker, key)
    assert len(events) == 2
    assert_never_overlapping(events)
    outcomes = [record.outcome for record in worker.history(key)]
    assert outcomes.count(Outcome.SUCCEEDED) == 1
    assert outcomes.count(Outcome.SKIPPED) == 19  # replays of the stored result
    assert len(bodies(worker, f"job:order:{other}")) == 2  # another order was not blocked


@pytest.mark.parametrize("transactional", [True, False], ids=["record_success", "at_release"])
@pytest.mark.slow
def test_a_child_killed_after_its_commit_charges_once_only_with_record_success(
    worker: Worker, lock_url: str, transactional: bool
) -> None:
    """The child commits its charge, then is SIGKILLed before its release (the hook in
    ``w.pay``); the duplicate that comes after replays the charge only when the success
    was written in the charge's own transaction. Without it the order is charged twice:
    the hole this option closes."""
    if not lock_url.startswith("postgresql"):
        pytest.skip("not applicable: record_success needs the Postgres store")
    import psycopg

    url, table = lock_url.partition("?")[0], f'"{lock_url.split("schema=")[1]}".charges'
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"CREATE TABLE IF NOT EXISTS {table} (order_id text, token text)")
    order = uuid.uuid4().hex[:8]
    key = f"job:pay:{order}"
    (worker.ledger.parent / f"kill-{order}").touch()
    first = worker.tasks.pay.delay(order, transactional)
    with pytest.raises(Exception, match=r"WorkerLostError|Worker exited"):
        first.get(timeout=60)
    eventually(lambda: worker.store.get(key) is None, "the dead child's lease released")

    duplicate = worker.tasks.pay.delay(order, transactional).get(timeout=60)

    with psycopg.connect(url) as connection:
        tokens = connection.execute(
            f"SELECT token FROM {table} WHERE order_id = %s", (order,)
        ).fetchall()
    committed = [e for e in worker.events() if e["key"] == key and e["event"] == "committed"]
    if transactional:
        assert len(tokens) == 1 and len(committed) == 1  # charged once
        assert duplicate == {"order": order, "fence": committed[0]["fence"]}  # replayed
        kept = worker.store.last_success(key, "w.pay")
        assert kept is not None and kept.lease.token == committed[0]["token"]
    else:
        assert len(tokens) == 2 and len(committed) == 2  # the double charge, shown


@pytest.mark.usefixtures("app")
def test_once_replays_a_decimal_datetime_uuid_or_bytes_as_the_first_caller_got_it(
    store: MemoryBackend,
) -> None:
    # Found by trying the API: the stored result went through plain json, so a charge that
    # returned a Decimal replayed None to every duplicate.
    run = new_run()
    first = tasks.charge_typed.delay(run).get(timeout=10)
    assert first["amount"] == Decimal("1.50")  # Celery's json serializer keeps the types
    again = [tasks.charge_typed.delay(run).get(timeout=10) for _ in range(2)]
    assert again == [first] * 2
    assert [type(value) for value in again[0].values()] == [Decimal, datetime, UUID, bytes]
    assert len(tasks.SEEN[run]) == 1
    assert outcomes(store, f"job:typed:{run}") == [Outcome.SUCCEEDED] + [Outcome.SKIPPED] * 2


@pytest.mark.usefixtures("app")
def test_once_with_a_result_too_deep_for_json_still_records_and_frees_its_key(
    store: MemoryBackend,
) -> None:
    run = new_run()
    with pytest.raises(Exception):  # noqa: B017 - Celery's own encoding fails too
        tasks.charge_deep.delay(run).get(timeout=10)
    key = f"job:deep:{run}"
    eventually(lambda: store.get(key) is None, "the key freed")
    [record] = store.history(key=key)
    assert record.outcome is Outcome.SUCCEEDED  # the body returned
    assert record.result == {"value": None, "unstored": "list"}
