"""A ``once`` payment when the lock store fails around the replay of a kept success, in an
embedded worker on a queue of its own, on a real Postgres store in a schema of its own; each
failure is a real server error (a column of one of the store's tables is renamed away, then
back).

- The body's own transaction is refused (another run's success was kept meanwhile) and the
  lookup of that success fails: the attempt, whose charge rolled back, is re-queued as for
  any store failure (not counted in ``lock_retry_max``), its lease released ``retried``;
  the next attempt replays the kept success.
- A duplicate finds the kept success but its own lease's release fails: the duplicate still
  returns the stored result (the order was charged), and its release is settled at the
  worker's next release that reaches the store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest

from celery_dlock import (
    AlreadySucceededError,
    Holder,
    Lease,
    LockedTask,
    Outcome,
    Record,
    backend_from_url,
    install,
)
from tests.celery.support import embedded_app, embedded_worker
from tests.support import eventually
from tests.support.services import POSTGRES_URL, migrated_schema, with_options

psycopg = pytest.importorskip("psycopg")

RUNS: list[str] = []
#: What the test does inside the body: before the charge commits, and after it was refused.
HOOKS: dict[str, Any] = {}


@pytest.fixture
def schema() -> Iterator[str]:
    with migrated_schema("dlock_replay") as (name, admin):
        admin.execute(f'CREATE TABLE "{name}".charges (key text, token text)')
        yield name


@pytest.fixture
def store(schema: str) -> Iterator[Any]:
    with closing(backend_from_url(with_options(POSTGRES_URL, schema=schema))) as backend:
        yield backend


@pytest.fixture
def charge(schema: str) -> Iterator[Any]:
    app = embedded_app("once-replay", with_options(POSTGRES_URL, schema=schema))
    install(app, janitor=False)

    @app.task(
        shared=False,
        base=LockedTask,
        bind=True,
        name="replay.charge",
        lock_key="order:{order_id}",
        once=True,
        lock_retry_max=0,  # a store failure is not a busy key: it is re-queued all the same
        lock_retry_backoff=0.2,
        lock_retry_backoff_max=0.2,
    )
    def task(self: Any, order_id: str) -> str:
        RUNS.append(order_id)
        receipt = f"receipt-{order_id}-{self.lease.fence}"
        try:
            with psycopg.connect(POSTGRES_URL) as connection:
                connection.execute(
                    f'INSERT INTO "{schema}".charges VALUES (%s, %s)',
                    (self.lease.key, self.lease.token),
                )
                HOOKS.get("before_commit", lambda lease: None)(self.lease)
                self.record_success(connection, receipt)
        except AlreadySucceededError:
            HOOKS.get("refused", lambda: None)()
            raise
        return receipt

    HOOKS.clear()
    try:
        with embedded_worker(app, pool="solo", shutdown_timeout=10):
            yield task
    finally:
        HOOKS.clear()


def rename_column(schema: str, table: str, old: str, new: str) -> None:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(f'ALTER TABLE "{schema}".{table} RENAME COLUMN {old} TO {new}')


def charged(schema: str, key: str) -> list[str]:
    with psycopg.connect(POSTGRES_URL) as connection:
        rows = connection.execute(f'SELECT token FROM "{schema}".charges WHERE key = %s', (key,))
        return [str(row[0]) for row in rows.fetchall()]


def test_a_refused_charge_whose_lookup_the_store_fails_is_requeued_and_replays_the_winner(
    charge: Any, schema: str, store: Any
) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    winner = Holder.current(task_name="replay.charge", task_id="the-winner")
    winning = Record(
        Lease(key, uuid.uuid4().hex, 1, winner, 1.0, None),
        2.0,
        Outcome.SUCCEEDED,
        None,
        None,
        {"value": "receipt-of-the-winner"},
    )
    # A lost-lease duplicate's success lands between this run's once check and its commit;
    # then, the charge refused, the store fails before the run can read that success.
    HOOKS["before_commit"] = lambda lease: store.remember(winning)
    HOOKS["refused"] = lambda: rename_column(schema, "successes", "task_name", "away")
    result = charge.delay(order)
    [record] = eventually(lambda: store.history(key=key), "a record of the first attempt", 10)
    held = store.get(key)  # None, or the lease of an attempt re-queued since
    assert held is None or held.token != record.lease.token  # released, not left held
    rename_column(schema, "successes", "away", "task_name")

    assert result.get(timeout=30) == "receipt-of-the-winner"  # re-queued, then replayed
    assert RUNS.count(order) == 1  # the re-queued attempt did not run the body again
    assert charged(schema, key) == []  # the refused charge rolled back
    assert (record.outcome, record.problem) == (Outcome.RETRIED, "celery_dlock.errors.BackendError")
    assert record.details is not None and "SQLSTATE 42703" in record.details
    ended = [r.outcome for r in sorted(store.history(key=key), key=lambda r: r.lease.fence)]
    # Attempts re-queued while the column was still away were retried again.
    assert set(ended[:-1]) == {Outcome.RETRIED} and ended[-1] is Outcome.SKIPPED
    kept = store.last_success(key, "replay.charge")
    assert kept is not None and kept.lease.token == winning.lease.token
    assert store.get(key) is None


def test_a_duplicate_whose_release_the_store_fails_returns_the_charge_and_settles_later(
    charge: Any, schema: str, store: Any
) -> None:
    order, later = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    receipt = charge.delay(order).get(timeout=30)
    [charged_once] = store.history(key=key)

    rename_column(schema, "history", "problem", "away")  # every release fails
    duplicate = charge.delay(order)
    try:
        assert duplicate.get(timeout=30) == receipt  # the order was charged: its receipt
        held = store.get(key)  # the duplicate's release is waiting for the store
        assert held is not None and held.holder.task_id == duplicate.id
    finally:
        rename_column(schema, "history", "away", "problem")
    assert RUNS.count(order) == 1

    # The worker's next release reaches the store, and settles the one it refused.
    assert charge.delay(later).get(timeout=30).startswith(f"receipt-{later}-")
    assert store.get(key) is None
    records = sorted(store.history(key=key), key=lambda r: r.lease.fence)
    assert [(r.lease.token, r.outcome) for r in records] == [
        (charged_once.lease.token, Outcome.SUCCEEDED),
        (held.token, Outcome.SKIPPED),
    ]
    assert records[1].problem == "once"
    assert len(charged(schema, key)) == 1
