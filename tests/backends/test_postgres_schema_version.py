"""The Postgres schema carries its version: ``migrate()`` records it (the locks table's
comment), refuses a schema of a newer version and changes nothing there, upgrades a schema
that records none (an earlier release's) as before; the doctor names the version and says
which side to upgrade. A release from before the record, run for real (``git archive`` of
its commit), still downgrades on its ``migrate()``, and the record it overwrites shows it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.backends.postgres.functions import functions
from celery_dlock.backends.postgres.migration import SCHEMA_VERSION, locks_comment
from celery_dlock.backends.postgres.sql import COMMENTS, Names, ddl
from celery_dlock.backends.postgres.statements import Statements
from celery_dlock.errors import ConfigurationError
from tests.support.doctor import by_name
from tests.support.releases import commit_tree
from tests.support.services import POSTGRES_URL, with_options

#: The last commit before the schema recorded its version: its migrate() puts back its own
#: SQL functions over any schema.
UNRECORDED = "85af273ac06d0ea7212fbbc1bfb9b0c0802c1057"
#: Schema version -> digest of its ``ddl()`` and ``functions()`` (the last test).
DIGESTS = {1: "4899dd35bb55ceb5"}


@pytest.fixture
def store(postgres_backend: PostgresBackend) -> PostgresBackend:
    """A backend on ``schema``, migrated by this code (``tests/backends/conftest.py``)."""
    return postgres_backend


def comment(admin: Any, schema: str) -> str:
    row = admin.execute(
        "SELECT obj_description(to_regclass(%s), 'pg_class')", (f'"{schema}"."locks"',)
    ).fetchone()
    return str(row[0])


def functions_of(admin: Any, schema: str) -> list[tuple[str, str]]:
    return admin.execute(
        "SELECT proname, prosrc FROM pg_proc WHERE pronamespace = to_regnamespace(%s) "
        "ORDER BY proname",
        (f'"{schema}"',),
    ).fetchall()


def set_comment(admin: Any, schema: str, text: str) -> None:
    admin.execute(f'COMMENT ON TABLE "{schema}"."locks" IS \'{text}\'')


def test_migrate_records_the_schema_version_and_the_doctor_reports_it(
    store: PostgresBackend, schema: str, admin: Any
) -> None:
    assert comment(admin, schema) == f"{COMMENTS['locks']}; schema version {SCHEMA_VERSION}"
    check = by_name(store.diagnose())["schema"]
    assert check.ok, check
    assert check.detail.startswith(f"{schema!r} is current: schema version {SCHEMA_VERSION}, ")


def test_migrate_refuses_a_schema_of_a_newer_version_and_changes_nothing(
    store: PostgresBackend, schema: str, admin: Any
) -> None:
    # A newer version that dropped an index and a function, and recorded its version.
    newer = locks_comment(SCHEMA_VERSION + 1)
    set_comment(admin, schema, newer)
    admin.execute(f'DROP INDEX "{schema}".history_released_at')
    admin.execute(f'DROP FUNCTION "{schema}".lease(text)')
    before = functions_of(admin, schema)

    with pytest.raises(ConfigurationError) as refused:
        store.migrate()

    message = str(refused.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in message
    assert f"knows schema version {SCHEMA_VERSION}" in message
    assert "upgrade this process" in message and "nothing was changed" in message
    assert comment(admin, schema) == newer
    assert functions_of(admin, schema) == before
    found = admin.execute("SELECT to_regclass(%s)", (f'"{schema}".history_released_at',)).fetchone()
    assert found == (None,)


def test_the_doctor_says_to_upgrade_this_process_for_a_newer_schema(
    store: PostgresBackend, schema: str, admin: Any
) -> None:
    set_comment(admin, schema, locks_comment(SCHEMA_VERSION + 1))

    check = by_name(store.diagnose())["schema"]

    assert not check.ok
    assert check.detail.startswith(
        f"schema version {SCHEMA_VERSION + 1}, newer than this process's {SCHEMA_VERSION}: "
    )
    assert "upgrade this process" in check.detail and "run `celery" not in check.detail


def test_a_schema_recording_no_version_is_the_oldest_and_migrate_upgrades_it(
    store: PostgresBackend, schema: str, admin: Any
) -> None:
    # As an earlier release leaves it: its own comment, and here its functions missing.
    set_comment(admin, schema, COMMENTS["locks"])
    admin.execute(f'DROP FUNCTION "{schema}".lease(text)')

    check = by_name(store.diagnose())["schema"]
    assert not check.ok
    assert check.detail.startswith(
        f"schema version 0 (none recorded: made, or last migrated, by a release from before "
        f"schema versions), older than this process's {SCHEMA_VERSION}: run `celery-dlock migrate`"
    )

    assert store.migrate() == "upgraded from schema version 0"
    assert comment(admin, schema) == locks_comment()
    assert [name for name, _ in functions_of(admin, schema)] == ["acquire", "lease", "release"]
    assert by_name(store.diagnose())["schema"].ok
    assert store.migrate() == "up to date"


def test_migrate_says_what_it_made_when_a_part_was_missing(
    store: PostgresBackend, schema: str, admin: Any
) -> None:
    [(index,)] = admin.execute(
        "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND tablename = 'history' "
        "AND indexname <> 'history_pkey' ORDER BY indexname LIMIT 1",
        (schema,),
    ).fetchall()
    admin.execute(f'DROP INDEX "{schema}"."{index}"')
    assert store.migrate() == "completed"
    assert by_name(store.diagnose())["schema"].ok


@pytest.fixture
def unrecorded_release(tmp_path: Path) -> Path:
    """The tree of :data:`UNRECORDED`."""
    return commit_tree(UNRECORDED, tmp_path / "unrecorded")


_MIGRATE = """
import sys
import celery_dlock
from celery_dlock.backends.postgres import PostgresBackend
assert celery_dlock.__file__.startswith(sys.argv[2]), celery_dlock.__file__
store = PostgresBackend.from_url(sys.argv[1])
store.migrate()
store.close()
"""


def test_a_release_from_before_the_record_still_migrates_over_it_and_that_shows(
    unrecorded_release: Path, store: PostgresBackend, schema: str, admin: Any
) -> None:
    url = with_options(POSTGRES_URL, schema=schema)
    # A later version's functions: the earlier release puts back its own.
    admin.execute(
        f'CREATE OR REPLACE FUNCTION "{schema}".lease(p_key text) RETURNS TABLE (token text, '
        "fence bigint, holder json, acquired_at timestamptz, expires_at timestamptz, "
        "alive boolean) LANGUAGE plpgsql AS $$ BEGIN RETURN; END $$"
    )
    set_comment(admin, schema, locks_comment(SCHEMA_VERSION + 1))

    subprocess.run(
        [sys.executable, "-c", _MIGRATE, url, str(unrecorded_release)],
        env={**os.environ, "PYTHONPATH": str(unrecorded_release)},
        # python -c puts the working directory first on sys.path: a checkout's own package
        # would be imported instead of the release's.
        cwd=unrecorded_release,
        check=True,
        timeout=120,
    )

    # It cannot be stopped (it is released), but it leaves no version behind: no process
    # takes the downgraded schema for a newer one.
    assert comment(admin, schema) == COMMENTS["locks"]
    assert "$$ BEGIN RETURN; END $$" not in str(functions_of(admin, schema))
    check = by_name(store.diagnose())["schema"]
    assert not check.ok and check.detail.startswith("schema version 0 (none recorded")
    store.migrate()
    assert by_name(store.diagnose())["schema"].ok


def test_the_schema_version_is_bumped_with_the_ddl_and_functions() -> None:
    names = Names("dlock", "")
    made = "\n".join([*ddl(names), *functions(Statements(names))])
    digest = hashlib.sha256(made.encode()).hexdigest()[:16]
    assert DIGESTS.get(SCHEMA_VERSION) == digest, (
        f"ddl() or functions() changed ({digest}): once the release recording schema "
        f"version {SCHEMA_VERSION} is out, bump SCHEMA_VERSION in postgres/migration.py; "
        "then pin this digest for it"
    )
