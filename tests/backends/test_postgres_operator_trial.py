"""The Postgres store as its operator meets it: a role without rights, a schema
the role owns but may not create, a server schema name, tables made from the SQLAlchemy
metadata, a pooler in session mode, and an upgrade from the first version of the schema
with a process of that version still running. Real server, real PgBouncer, real old code
(a git worktree of the first Postgres commit, run as a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.records import Holder
from tests.support.doctor import by_name
from tests.support.pgbouncer import pgbouncer
from tests.support.releases import commit_tree
from tests.support.services import POSTGRES_URL, with_options

#: The first commit whose Postgres store works (its schema is the one upgraded from).
FIRST_POSTGRES = "cfd5c464dc616ac832a3c34bb4526c1234d0e53b"


def as_role(url: str, role: str) -> str:
    """``url`` with its user replaced by ``role`` (trust authentication, no password)."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


@pytest.fixture
def role(admin: Any) -> Iterator[str]:
    """A fresh login role with no rights of its own, dropped afterwards."""
    name = f"h4_ro_{os.urandom(4).hex()}"
    admin.execute(f'CREATE ROLE "{name}" LOGIN')
    yield name
    admin.execute(f'DROP OWNED BY "{name}" CASCADE')
    admin.execute(f'DROP ROLE "{name}"')


@pytest.fixture
def migrated(schema: str) -> str:
    """``schema``, migrated by the superuser."""
    store = PostgresBackend.from_url(with_options(POSTGRES_URL, schema=schema))
    try:
        store.migrate()
    finally:
        store.close()
    return schema


def test_doctor_names_each_grant_a_role_lacks_and_those_grants_are_enough(
    migrated: str, role: str, admin: Any
) -> None:
    # A read-only role (as a reporting user would get): the doctor said "all checks
    # passed" while every acquire failed with permission denied (prepare checks no rights).
    admin.execute(f'GRANT USAGE ON SCHEMA "{migrated}" TO "{role}"')
    admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{migrated}" TO "{role}"')
    store = PostgresBackend.from_url(as_role(with_options(POSTGRES_URL, schema=migrated), role))
    try:
        check = by_name(store.diagnose())["schema"]
        assert not check.ok, check
        assert check.detail.startswith(f"role {role!r} lacks rights the backend uses: GRANT ")
        grants = check.detail.split(": ", 1)[1].split("; ")
        assert f'GRANT INSERT, UPDATE, DELETE ON TABLE "{migrated}"."locks" TO "{role}"' in (grants)
        assert f'GRANT USAGE, SELECT, UPDATE ON SEQUENCE "{migrated}"."fence" TO "{role}"' in (
            grants
        )

        for grant in grants:
            admin.execute(grant)
        assert by_name(store.diagnose())["schema"].ok
        lease = store.try_acquire("job:h4:grants", Holder.current(), None)
        assert lease is not None
        assert store.release(lease, "succeeded") is not None
    finally:
        store.close()


def test_doctor_names_the_schema_usage_a_role_lacks_instead_of_failing(
    migrated: str, role: str
) -> None:
    # diagnose() raised BackendError (permission denied for schema) and showed no check.
    store = PostgresBackend.from_url(as_role(with_options(POSTGRES_URL, schema=migrated), role))
    try:
        checks = by_name(store.diagnose())
    finally:
        store.close()

    assert not checks["schema"].ok
    assert checks["schema"].detail == (
        f"role {role!r} may not use schema {migrated!r}: "
        f'GRANT USAGE ON SCHEMA "{migrated}" TO "{role}"'
    )
    assert checks["postgres version"].ok


def test_an_acquire_refused_for_rights_says_which_rights_and_grants_nothing(
    migrated: str, role: str, admin: Any
) -> None:
    admin.execute(f'GRANT USAGE ON SCHEMA "{migrated}" TO "{role}"')
    admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{migrated}" TO "{role}"')
    url = with_options(POSTGRES_URL, schema=migrated)
    store = PostgresBackend.from_url(as_role(url, role))
    try:
        # A BackendError (not a ConfigurationError): a Celery task is retried, never run
        # unlocked, and a DBA can grant the rights while the workers run.
        with pytest.raises(BackendError) as raised:
            store.try_acquire("job:h4:rights", Holder.current(), None)
    finally:
        store.close()

    assert "SQLSTATE 42501" in str(raised.value)
    assert "the role needs USAGE on the store's schema, SELECT, INSERT, UPDATE, DELETE" in (
        str(raised.value)
    )
    owner = PostgresBackend.from_url(url)
    try:
        assert owner.get("job:h4:rights") is None
    finally:
        owner.close()


@pytest.mark.parametrize("where", ["role", "url"])
def test_doctor_fails_a_store_whose_transactions_are_read_only(
    migrated: str, role: str, admin: Any, where: str
) -> None:
    # As on a standby (a URL pointing at a replica): the doctor passed every check, and
    # every acquire failed with SQLSTATE 25006 (prepare checks no read-only transaction).
    for grant in (
        f'GRANT USAGE ON SCHEMA "{migrated}" TO "{role}"',
        f'GRANT ALL ON ALL TABLES IN SCHEMA "{migrated}" TO "{role}"',
        f'GRANT ALL ON ALL SEQUENCES IN SCHEMA "{migrated}" TO "{role}"',
    ):
        admin.execute(grant)
    url = as_role(with_options(POSTGRES_URL, schema=migrated), role)
    if where == "role":
        admin.execute(f'ALTER ROLE "{role}" SET default_transaction_read_only = on')
    else:
        url = with_options(url, options="-c%20default_transaction_read_only%3Don")
    store = PostgresBackend.from_url(url)
    try:
        check = by_name(store.diagnose())["schema"]
        with pytest.raises(BackendError, match="SQLSTATE 25006"):
            store.try_acquire("job:h4:read-only", Holder.current(), None)
    finally:
        store.close()

    assert not check.ok
    assert check.detail.startswith(f"transactions of role {role!r} are read-only here ")


#: Tables an application may already have in the schema given to the store (schema=public):
#: the store's columns under another primary key, and the store's own without one.
FOREIGN = {
    "locks": "id serial PRIMARY KEY, key text, token text, fence bigint, holder json, "
    "acquired_at timestamptz, expires_at timestamptz, backend_pid int",
    "successes": "key text, task_name text, token text, fence bigint, holder json, "
    "acquired_at timestamptz, expires_at timestamptz, released_at timestamptz, outcome text, "
    "problem text, details text, result json, ordered int",
}


@pytest.mark.parametrize("table", sorted(FOREIGN))
def test_doctor_names_another_application_s_table_that_migrate_passed_over(
    schema: str, admin: Any, table: str
) -> None:
    # migrate() said "up to date" (CREATE TABLE IF NOT EXISTS passed the table over) and the
    # doctor "current" (locks: its serial key's index is named locks_pkey too) or "missing
    # successes_pkey: run migrate" (which changes nothing); every acquire failed.
    # The state migrate() left (it made the rest around the application's table), made
    # here the other way round so that it does not hang on what migrate() does about it.
    store = PostgresBackend.from_url(with_options(POSTGRES_URL, schema=schema))
    try:
        store.migrate()
        admin.execute(f'DROP TABLE "{schema}".{table}')
        admin.execute(f'CREATE TABLE "{schema}".{table} ({FOREIGN[table]})')
        check = by_name(store.diagnose())["schema"]
    finally:
        store.close()

    assert not check.ok
    assert check.detail.startswith(f'table "{schema}"."{table}" has columns (')
    assert check.detail.endswith(
        ": not as migrate() makes it (another application's table, or one changed by hand), "
        "which migrate() leaves alone: give the store a schema or table_prefix of its own"
    )
    assert "run `celery-dlock migrate`" not in check.detail


def test_migrate_refuses_another_application_s_table_and_leaves_it_alone(
    schema: str, admin: Any
) -> None:
    admin.execute(f'CREATE SCHEMA "{schema}"')
    admin.execute(f'CREATE TABLE "{schema}".locks ({FOREIGN["locks"]})')
    admin.execute(f"COMMENT ON TABLE \"{schema}\".locks IS 'the doors of the warehouse'")
    store = PostgresBackend.from_url(with_options(POSTGRES_URL, schema=schema))
    try:
        with pytest.raises(ConfigurationError, match=rf'table "{schema}"."locks" has columns'):
            store.migrate()
    finally:
        store.close()
        comment = admin.execute(
            "SELECT obj_description(to_regclass(%s), 'pg_class')", (f'"{schema}".locks',)
        ).fetchone()[0]
        assert comment == "the doors of the warehouse"


def test_migrate_of_a_current_schema_never_waits_for_writers_of_history(
    migrated: str, admin: Any
) -> None:
    # A deploy that runs `celery dlock migrate` while a transaction that wrote history is
    # open (a psql session's dlock.release() before its COMMIT; an anti-wraparound vacuum
    # likewise): migrate() waited for it, and every acquire and release, which write
    # history, queued behind migrate(): the lock service stood still until that COMMIT.
    # lock_timeout bounds the wait of this test instead of a clock.
    url = with_options(POSTGRES_URL, schema=migrated, options="-c%20lock_timeout%3D2000")
    admin.execute("BEGIN")
    try:
        admin.execute(f'DELETE FROM "{migrated}".history WHERE false')
        store = PostgresBackend.from_url(url)
        try:
            store.migrate()
        finally:
            store.close()
    finally:
        admin.execute("ROLLBACK")


@pytest.mark.parametrize("name", ["pg_h4", "pg_catalog", "information_schema"])
def test_a_schema_of_the_server_is_refused_when_the_url_is_read(name: str, admin: Any) -> None:
    # pg_* failed only at migrate() (SQLSTATE 42939); a superuser's migrate() created the
    # tables and functions inside information_schema.
    with pytest.raises(ConfigurationError, match=rf"schema '{name}' is the server's own"):
        PostgresBackend.from_url(with_options(POSTGRES_URL, schema=name, auto_migrate=1))

    assert admin.execute("SELECT to_regclass('information_schema.locks')").fetchone()[0] is None


def test_migrate_by_a_role_that_may_not_create_says_who_may(schema: str, role: str) -> None:
    # The hint of a refused acquire (grant the tables) is wrong for migrate(), which creates.
    store = PostgresBackend.from_url(as_role(with_options(POSTGRES_URL, schema=schema), role))
    try:
        with pytest.raises(BackendError) as raised:
            store.migrate()
    finally:
        store.close()

    assert "postgres migrate failed (SQLSTATE 42501)" in str(raised.value)
    assert "run it as the schema's owner (or a role with CREATE on the database)" in str(
        raised.value
    )


def test_migrate_into_a_schema_the_role_owns_needs_no_create_on_the_database(
    schema: str, role: str, admin: Any
) -> None:
    # The usual setup of a DBA: the schema made for the application's role, which owns it
    # and may create nothing else in the database.
    admin.execute(f'CREATE SCHEMA "{schema}" AUTHORIZATION "{role}"')
    store = PostgresBackend.from_url(as_role(with_options(POSTGRES_URL, schema=schema), role))
    try:
        store.migrate()
        lease = store.try_acquire("job:h4:owned", Holder.current(), None)
        assert lease is not None
        store.release(lease, "succeeded")
    finally:
        store.close()


def test_doctor_passes_tables_made_from_the_sqlalchemy_metadata(schema: str, admin: Any) -> None:
    # The README's Alembic route makes no SQL functions ("from migrate() only"): the doctor
    # failed such a schema for ever ("SQL functions ... differ"), though Python needs none.
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from celery_dlock.backends.postgres.schema import metadata

    admin.execute(f'CREATE SCHEMA "{schema}"')
    engine = sqlalchemy.create_engine(
        POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://")
    )
    try:
        metadata(schema=schema).create_all(engine)
    finally:
        engine.dispose()
    store = PostgresBackend.from_url(with_options(POSTGRES_URL, schema=schema))
    try:
        check = by_name(store.diagnose())["schema"]
        assert check.ok, check
        assert check.detail.endswith(
            "; no SQL functions acquire, lease, release (for SQL clients only, migrate() adds them)"
        )
        store.migrate()
        check = by_name(store.diagnose())["schema"]
        assert check.ok and "no SQL functions" not in check.detail, check
    finally:
        store.close()


def test_doctor_says_a_session_pooler_s_keepalives_watch_the_holders(schema: str) -> None:
    # Through a pooler the server's keepalives (the URL's) watch the pooler: a holder cut
    # off from the pooler keeps its leases until the pooler drops it. The doctor called
    # session pooling "fine" and named nothing to set.
    with pgbouncer("session", pool_size=2) as url:
        store = PostgresBackend.from_url(with_options(url, schema=schema, auto_migrate=1))
        try:
            check = by_name(store.diagnose())["pooler"]
        finally:
            store.close()

    assert check.ok
    assert "a proxy or a pooler in session mode, fine" in check.detail
    assert "PgBouncer's tcp_keepalive, tcp_keepidle" in check.detail


# -- upgrading from the first schema, with a process of that version still running ---------

_FILL = """
import json, sys
import celery_dlock
assert celery_dlock.__file__.startswith(sys.argv[2]), celery_dlock.__file__  # the old code
from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.records import Holder
store = PostgresBackend.from_url(sys.argv[1])
store.migrate()
holder = Holder.current(task_name="shop.charge", task_id="t-1")
for _ in range(2):
    lease = store.try_acquire("job:h4:failing", holder, None)
    store.release(lease, "failed", "ValueError", "boom")
paid = store.try_acquire("job:h4:paid", holder, None)
store.release(paid, "succeeded", result={"charged": 42})
held = store.try_acquire("job:h4:held", holder, None)
print(json.dumps({"token": held.token, "fence": held.fence}), flush=True)
for key in sys.stdin:  # try the keys the test names, hold the lease until it closes stdin
    print(json.dumps({"took": store.try_acquire(key.strip(), holder, None) is not None}),
          flush=True)
print(json.dumps({"released": store.release(held, "succeeded") is not None}), flush=True)
store.close()
"""


@pytest.fixture
def first_version(tmp_path: Path) -> Path:
    """The tree of the first Postgres commit."""
    return commit_tree(FIRST_POSTGRES, tmp_path / "first")


def test_an_upgrade_from_the_first_schema_keeps_leases_successes_history_and_exclusion(
    first_version: Path, schema: str
) -> None:
    url = with_options(POSTGRES_URL, schema=schema)
    with subprocess.Popen(
        [sys.executable, "-c", _FILL, url, str(first_version)],
        env={**os.environ, "PYTHONPATH": str(first_version)},
        cwd=first_version,  # `python -c` puts the working directory first on sys.path
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as old:
        assert old.stdin is not None and old.stdout is not None
        try:
            _upgrade(url, old.stdin, old.stdout, old)
        finally:
            if old.poll() is None:
                old.kill()


def _upgrade(url: str, stdin: Any, stdout: Any, old: subprocess.Popen[str]) -> None:
    """The current code's migrate and calls beside the first version's process ``old``,
    which holds job:h4:held until ``stdin`` closes."""
    held = json.loads(stdout.readline())
    store = PostgresBackend.from_url(url)
    try:
        store.migrate()
        assert by_name(store.diagnose())["schema"].ok
        lease = store.get("job:h4:held")
        assert lease is not None and (lease.token, lease.fence) == (held["token"], 4)
        # The old process is alive: its lease is not taken over, by acquire or janitor.
        assert store.try_acquire("job:h4:held", Holder.current(), None) is None
        assert store.reap() == []
        success = store.last_success("job:h4:paid", "shop.charge")
        assert success is not None and success.result == {"charged": 42}
        assert [(r.key, r.outcome.value, r.lease.fence) for r in store.history()] == [
            ("job:h4:paid", "succeeded", 3),
            ("job:h4:failing", "failed", 2),
            ("job:h4:failing", "failed", 1),
        ]
        new = store.try_acquire("job:h4:new", Holder.current(), None)
        assert new is not None and new.fence > held["fence"]
        # The first version's process refuses a lease of the current one, and leaves it.
        stdin.write("job:h4:new\n")
        stdin.flush()
        assert json.loads(stdout.readline()) == {"took": False}
        assert store.get("job:h4:new") == new
        store.release(new, "succeeded")
        stdin.close()
        assert json.loads(stdout.readline()) == {"released": True}
        assert old.wait(30) == 0
        taken = store.try_acquire("job:h4:held", Holder.current(), None)
        assert taken is not None and taken.fence > new.fence
        store.release(taken, "succeeded")
    finally:
        store.close()
