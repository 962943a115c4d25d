"""A ``once`` payment whose lookup of the kept success fails after its lease was taken (the
lock store fails between two calls): the attempt, which ran nothing, is re-queued as for any
store failure (the work is kept) and its lease released, not left held by the worker. An
embedded worker on a queue of its own and a real Postgres store in a schema of its own; the
failure is a real one (a column of the store's successes table is renamed away, then back)."""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_dlock import LockedTask, Outcome, backend_from_url, install
from tests.celery.support import embedded_app, embedded_worker
from tests.support import eventually, unavailable

BASE = "postgresql://postgres@127.0.0.1:5432/test"
RUNS: list[str] = []


@pytest.fixture
def schema() -> Iterator[str]:
    if importlib.util.find_spec("psycopg") is None:
        unavailable("psycopg is not installed: pip install 'celery-dlock[postgres]'")
    import psycopg

    name = f"dlock_probe_{uuid.uuid4().hex[:8]}"
    try:
        psycopg.connect(BASE, connect_timeout=3).close()
    except psycopg.Error as exc:
        unavailable(f"PostgreSQL is not reachable on 127.0.0.1:5432 ({exc})")
    backend = backend_from_url(f"{BASE}?schema={name}")
    backend.migrate()  # type: ignore[attr-defined]
    backend.close()
    yield name
    with psycopg.connect(BASE, autocommit=True) as connection:
        connection.execute(f'drop schema if exists "{name}" cascade')


@pytest.fixture
def charge(schema: str) -> Iterator[Any]:
    app = embedded_app("probe-once", f"{BASE}?schema={schema}")
    install(app, janitor=False)

    @app.task(
        shared=False,
        base=LockedTask,
        bind=True,
        name="probe.charge",
        lock_key="order:{order_id}",
        once=True,
        lock_retry_backoff=0.2,
        lock_retry_backoff_max=0.2,
    )
    def task(self: Any, order_id: str) -> str:
        RUNS.append(order_id)
        return f"receipt-{order_id}"

    with embedded_worker(app, pool="solo", shutdown_timeout=10):
        yield task


def test_a_once_lookup_the_store_fails_requeues_the_payment_and_frees_its_key(
    charge: Any, schema: str
) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    backend = backend_from_url(f"{BASE}?schema={schema}")
    try:
        _fails_then_comes_back(charge, backend, schema, order, key)
    finally:
        backend.close()  # not left to the garbage collector, which warns in another test


def _fails_then_comes_back(charge: Any, backend: Any, schema: str, order: str, key: str) -> None:
    import psycopg

    successes = f'"{schema}".successes'
    with psycopg.connect(BASE, autocommit=True) as connection:
        connection.execute(f"alter table {successes} rename column task_name to away")
        result = charge.delay(order)
        # The first attempt took its lease, then failed to read the kept success.
        first = eventually(lambda: backend.history(key=key), "a record of the first attempt", 10)
        held = backend.get(key)  # its lease was released, not left held (a retry may hold it)
        assert held is None or held.token != first[0].lease.token
        connection.execute(f"alter table {successes} rename column away to task_name")
    assert result.get(timeout=30) == f"receipt-{order}"  # re-queued, not failed: work kept
    assert RUNS.count(order) == 1
    [record] = first
    assert (record.outcome, record.problem) == (Outcome.RETRIED, "celery_dlock.errors.BackendError")
    assert record.details is not None and "SQLSTATE 42703" in record.details
    ended = sorted(backend.history(key=key), key=lambda r: r.lease.fence)
    # A retry that ran before the column came back failed its lookup too, and was retried.
    assert [r.outcome for r in ended] == [Outcome.RETRIED] * (len(ended) - 1) + [Outcome.SUCCEEDED]
    assert backend.get(key) is None
