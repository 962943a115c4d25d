"""``doctor`` on Postgres shows the store's own checks (version, schema, pooler, connections)
beside the common ones, and still shows them when the lock session is refused."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.cli.clitools import CliStore, postgres_url, run_cli
from tests.support.services import drop_schema, postgres_admin

STORE_CHECKS = ["postgres version", "schema", "pooler", "connections"]


def test_doctor_shows_the_postgres_checks(pg_store: CliStore) -> None:
    result = run_cli("--backend", pg_store.url, "doctor", "--json")

    assert result.returncode == 0, result.stdout + result.stderr
    found = {check["name"]: check for check in json.loads(result.stdout)["checks"]}
    assert [name for name in found if name in STORE_CHECKS] == STORE_CHECKS
    assert all(found[name]["status"] == "ok" for name in STORE_CHECKS), found
    assert found["clock skew"]["status"] == "ok"
    assert found["clock skew"]["detail"].startswith("the store's clock is ")


@pytest.fixture
def unmigrated_url() -> Iterator[str]:
    admin = postgres_admin()
    schema = f"dlock_cli_{os.urandom(5).hex()}"
    yield postgres_url(schema)
    drop_schema(admin, schema)
    admin.close()


def test_doctor_on_a_schema_never_migrated_fails_and_names_migrate(unmigrated_url: str) -> None:
    result = run_cli("--backend", unmigrated_url, "doctor")

    assert result.returncode == 1
    rows = {
        line.split()[1]: line for line in result.stdout.splitlines() if line[:4] in ("ok  ", "fail")
    }
    assert rows["connect"].startswith("fail")
    assert rows["schema"].startswith("fail")
    assert "has none of the celery_dlock tables: run `celery-dlock migrate`" in rows["schema"]
    assert rows["pooler"].startswith("ok")
    assert result.stdout.splitlines()[-1] == "2 of 5 checks failed"
