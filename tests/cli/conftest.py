"""Fixtures of the CLI tests: a real store per test (the commands themselves are run by
:mod:`clitools`).

``store`` is parametrised over the file store, PostgreSQL (a fresh schema
``dlock_cli_<random>``, migrated, dropped afterwards; ``DLOCK_POSTGRES_URL``) and Redis DB 4
(a fresh key prefix, deleted afterwards; ``DLOCK_CLI_REDIS_URL``). A server that is not
there is a visible skip (a failure under ``DLOCK_REQUIRE_ALL=1``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_dlock import backend_from_url
from tests.cli.clitools import REDIS_URL, CliStore, postgres_url, redis_client
from tests.support.services import drop_schema, postgres_admin


@contextmanager
def postgres_store() -> Iterator[CliStore]:
    """A fresh, migrated schema on the test server, dropped afterwards."""
    admin = postgres_admin()
    schema = f"dlock_cli_{os.urandom(5).hex()}"
    url = postgres_url(schema)
    try:
        with backend_from_url(url) as backend:
            backend.migrate()  # type: ignore[attr-defined]
            yield CliStore("postgres", url, backend)
    finally:
        drop_schema(admin, schema)
        admin.close()


@contextmanager
def redis_store(tag: str = "cli") -> Iterator[CliStore]:
    """Redis DB 4 under a fresh key prefix ``dlock-<tag>-...``, its keys deleted afterwards."""
    client = redis_client()
    prefix = f"dlock-{tag}-{os.urandom(5).hex()}"
    url = f"{REDIS_URL}?prefix={prefix}"
    try:
        with backend_from_url(url) as backend:
            yield CliStore("redis", url, backend)
    finally:
        for name in client.scan_iter(match=f"*{prefix}*", count=1000):
            client.delete(name)
        client.close()


@pytest.fixture
def pg_store() -> Iterator[CliStore]:
    """The Postgres store alone."""
    with postgres_store() as store:
        yield store


@pytest.fixture(params=["file", "postgres", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CliStore]:
    if request.param == "file":
        url = f"file://{tmp_path}/locks"
        with backend_from_url(url) as backend:
            yield CliStore("file", url, backend)
    elif request.param == "postgres":
        with postgres_store() as store:
            yield store
    else:
        with redis_store() as store:
            yield store


@pytest.fixture
def file_store(tmp_path: Path) -> Iterator[CliStore]:
    """The file store alone, for behaviour of the CLI itself that no store changes."""
    url = f"file://{tmp_path}/locks"
    with backend_from_url(url) as backend:
        yield CliStore("file", url, backend)
