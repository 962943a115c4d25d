"""The Postgres store's own doctor checks (``diagnose()``, ``server_time()``) against the real
test server: a migrated schema passes; a missing schema, a dropped index, a function or a
column of another version are named with their fix; a real PgBouncer in transaction mode is
detected and refused for session liveness, one in session mode is not."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_dlock.backends import backend_from_url
from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.records import Holder
from tests.support.doctor import by_name
from tests.support.pgbouncer import pgbouncer
from tests.support.services import POSTGRES_URL, with_options


@pytest.fixture
def backend(schema: str) -> Iterator[PostgresBackend]:
    """A backend on ``schema``, migrated."""
    store = PostgresBackend.from_url(with_options(POSTGRES_URL, schema=schema))
    store.migrate()
    yield store
    store.close()


def test_a_migrated_schema_passes_every_check(backend: PostgresBackend, schema: str) -> None:
    checks = by_name(backend.diagnose())

    assert list(checks) == ["postgres version", "schema", "pooler", "connections"]
    assert all(check.ok for check in checks.values()), checks
    assert checks["schema"].detail.startswith(f"{schema!r} is current: ")
    assert "no transaction pooling" in checks["pooler"].detail


def test_connections_counts_the_sessions_holding_leases_of_the_schema(
    backend: PostgresBackend, schema: str
) -> None:
    def holding() -> int:
        detail = by_name(backend.diagnose())["connections"].detail
        found = re.search(rf"(\d+) sessions holding leases of '{schema}'", detail)
        assert found is not None, detail
        return int(found.group(1))

    assert holding() == 0
    lease = backend.try_acquire("job:doctor", Holder.current(), None)
    assert lease is not None
    assert holding() == 1
    backend.release(lease, "succeeded")
    assert holding() == 0


def test_server_time_is_the_servers_clock(backend: PostgresBackend, admin: Any) -> None:
    now = "SELECT extract(epoch FROM clock_timestamp())::float8"
    before = admin.execute(now).fetchone()[0]
    server = backend.server_time()
    after = admin.execute(now).fetchone()[0]

    assert before <= server <= after
    assert abs(server - time.time()) < 1.0  # the test server shares this host's clock


def test_a_schema_never_migrated_fails_and_names_migrate(schema: str) -> None:
    store = PostgresBackend.from_url(with_options(POSTGRES_URL, schema=schema))
    try:
        checks = by_name(store.diagnose())
    finally:
        store.close()

    assert not checks["schema"].ok
    assert f"schema {schema!r} has none of the celery_dlock tables" in checks["schema"].detail
    assert "run `celery-dlock migrate`" in checks["schema"].detail
    assert "auto_migrate=1" in checks["schema"].detail
    assert checks["postgres version"].ok and checks["pooler"].ok


def test_a_dropped_index_is_named_and_migrate_restores_it(
    backend: PostgresBackend, schema: str, admin: Any
) -> None:
    admin.execute(f'DROP INDEX "{schema}".history_released_at')

    check = by_name(backend.diagnose())["schema"]
    assert not check.ok
    assert check.detail.startswith(f'missing "{schema}"."history_released_at": run `celery')

    backend.migrate()
    assert by_name(backend.diagnose())["schema"].ok


def test_a_function_of_another_version_is_named_and_migrate_replaces_it(
    backend: PostgresBackend, schema: str, admin: Any
) -> None:
    admin.execute(
        f'CREATE OR REPLACE FUNCTION "{schema}".lease(p_key text) RETURNS TABLE (token text, '
        "fence bigint, holder json, acquired_at timestamptz, expires_at timestamptz, "
        "alive boolean) LANGUAGE plpgsql AS $$ BEGIN RETURN; END $$"
    )

    check = by_name(backend.diagnose())["schema"]
    assert not check.ok
    assert check.detail.startswith("SQL functions lease differ from this version's")

    backend.migrate()
    assert by_name(backend.diagnose())["schema"].ok


def test_a_column_of_another_version_is_named(
    backend: PostgresBackend, schema: str, admin: Any
) -> None:
    admin.execute(f'ALTER TABLE "{schema}".history RENAME COLUMN problem TO problem_was')

    check = by_name(backend.diagnose())["schema"]

    assert not check.ok
    assert 'column "problem" of relation "history" does not exist (SQLSTATE 42703)' in (
        check.detail
    )


# -- a real pooler in the way -------------------------------------------------------------


@pytest.fixture
def transaction_pooler() -> Iterator[str]:
    with pgbouncer("transaction", pool_size=2) as url:
        yield url


@pytest.fixture
def session_pooler() -> Iterator[str]:
    with pgbouncer("session", pool_size=2) as url:
        yield url


def test_a_transaction_pooler_is_refused_for_session_liveness(
    transaction_pooler: str, backend: PostgresBackend, schema: str
) -> None:
    # A stock PgBouncer refuses the lock session (its startup parameter ``options``); the
    # checks connect without it and say why.
    store = PostgresBackend.from_url(with_options(transaction_pooler, schema=schema))
    try:
        checks = by_name(store.diagnose())
    finally:
        store.close()

    pooler = checks["pooler"]
    assert not pooler.ok
    assert pooler.detail.startswith("transaction pooling (")
    assert "the server listens on 5432" in pooler.detail
    assert "add liveness=ttl&ttl=SECONDS to the URL" in pooler.detail
    assert checks["schema"].ok


def test_liveness_ttl_passes_through_a_transaction_pooler(
    transaction_pooler: str, schema: str
) -> None:
    url = with_options(transaction_pooler, schema=schema, liveness="ttl", ttl=30)
    store = backend_from_url(url)
    try:
        assert isinstance(store, PostgresBackend)
        store.migrate()
        checks = by_name(store.diagnose())
    finally:
        store.close()

    assert all(check.ok for check in checks.values()), checks
    assert checks["pooler"].detail.startswith("transaction pooling (")
    assert "liveness=ttl keeps no session state, so it works through it" in (
        checks["pooler"].detail
    )


def test_a_session_pooler_passes(
    session_pooler: str, backend: PostgresBackend, schema: str
) -> None:
    store = PostgresBackend.from_url(with_options(session_pooler, schema=schema))
    try:
        pooler = by_name(store.diagnose())["pooler"]
    finally:
        store.close()

    assert pooler.ok
    assert pooler.detail.startswith("no transaction pooling: one backend pid")
    assert "a proxy or a pooler in session mode" in pooler.detail
