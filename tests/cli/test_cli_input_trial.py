"""Bad store URLs given to the commands: exit 2 ("bad URL, option or setting", as the README
says) with one line naming the problem and no piece of the password; a password the URL
holds as written reaches the server.

Found by trying (each failed before its fix): a Postgres port that is no number failed as a
store error (exit 1) after trying to connect; a space after the URL (an env file's) made
``run`` create and lock a store of another name; a password holding an ``@`` never
connected, and the error showed the part after the ``@``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.cli.clitools import run_cli
from tests.support import unavailable
from tests.support.services import POSTGRES_URL, drop_schema, postgres_admin


@pytest.fixture
def schema() -> Iterator[str]:
    admin = postgres_admin()
    name = f"dlock_t_{os.urandom(6).hex()}"
    try:
        yield name
    finally:
        drop_schema(admin, name)
        admin.close()


def _server() -> str:
    """``host:port/dbname`` of the test server, whose URL must give no password (the test
    writes its own, which the test server's trust rule ignores)."""
    parts = urlsplit(POSTGRES_URL)
    if parts.password or parts.username != "postgres":
        unavailable("this test needs the default DLOCK_POSTGRES_URL (user postgres, trust)")
    return f"{parts.hostname}:{parts.port or 5432}{parts.path}"


def test_a_port_that_is_no_number_is_a_bad_url_exit_2_naming_it() -> None:
    result = run_cli("--backend", "postgresql://app:hunter22@127.0.0.1:54x2/test", "leases")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "Error: postgres URL 'postgresql://app:***@127.0.0.1:54x2/test' has the port '54x2': "
        "a number from 1 to 65535"
    ]
    assert result.stdout == ""


def test_a_url_with_a_space_after_it_creates_no_store_of_another_name(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store "
    result = run_cli("run", "job:input:space", "--", "true", env={"DLOCK_BACKEND": url})
    assert result.returncode == 2, result.stderr
    assert "has white space around it" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_password_holding_an_at_reaches_the_server_and_shows_nowhere(schema: str) -> None:
    url = f"postgresql://postgres:p@ss-w0rd@{_server()}?schema={schema}"
    migrated = run_cli("--backend", url, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    result = run_cli("--backend", url, "leases", "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["leases"] == []
    assert shown["backend"] == f"postgresql://postgres:***@{_server()}?schema={schema}"
    for output in (migrated, result):
        assert "w0rd" not in output.stdout + output.stderr
