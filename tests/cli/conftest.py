"""Fixtures of the CLI tests: a real store per test, and the real commands as subprocesses.

``store`` is parametrised over the file store, PostgreSQL (a fresh schema
``dlock_cli_<random>``, migrated, dropped afterwards; ``DLOCK_POSTGRES_URL``) and Redis DB 4
(a fresh key prefix, deleted afterwards; ``DLOCK_CLI_REDIS_URL``). A server that is not
there is a visible skip (a failure under ``DLOCK_REQUIRE_ALL=1``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.services import POSTGRES_URL, drop_schema, postgres_admin, with_options
from helpers.services import redis_client as connect_redis

from celery_dlock import backend_from_url
from celery_dlock.backends.base import LockBackend

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
REDIS_URL = os.environ.get("DLOCK_CLI_REDIS_URL", "redis://127.0.0.1:6379/4")
#: Commands must not wait on anything for long; this only stops a hung test.
COMMAND_TIMEOUT = 60


@dataclass
class CliStore:
    """A store the commands are pointed at: its URL and a backend on it for the test."""

    name: str
    url: str
    backend: LockBackend


def _environment(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("DLOCK_BACKEND", "DLOCK_NAMESPACE", "DLOCK_CLI_BACKEND", "DLOCK_CLI_NAMESPACE"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(HERE)
    env.update(extra or {})
    return env


def run_cli(
    *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``celery-dlock ARGS`` as a subprocess; its exit code and output."""
    return subprocess.run(
        [str(BIN / "celery-dlock"), *args],
        input=input,
        capture_output=True,
        text=True,
        env=_environment(env),
        timeout=COMMAND_TIMEOUT,
        check=False,
    )


def run_celery(
    url: str | None, *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``celery -A celeryapp dlock ARGS`` with the test app's ``dlock_backend`` = ``url``."""
    extra = dict(env or {})
    if url is not None:
        extra["DLOCK_CLI_BACKEND"] = url
    return subprocess.run(
        [str(BIN / "celery"), "-A", "celeryapp", "dlock", *args],
        input=input,
        capture_output=True,
        text=True,
        env=_environment(extra),
        timeout=COMMAND_TIMEOUT,
        check=False,
    )


def popen_cli(*args: str) -> subprocess.Popen[bytes]:
    """``celery-dlock ARGS`` with pipes, for a test that answers a prompt itself."""
    return subprocess.Popen(
        [str(BIN / "celery-dlock"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_environment(None),
    )


# -- stores -----------------------------------------------------------------------------------


def postgres_url(schema: str) -> str:
    return with_options(POSTGRES_URL, schema=schema)


def redis_client() -> Any:
    return connect_redis(REDIS_URL)


@pytest.fixture(params=["file", "postgres", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CliStore]:
    if request.param == "file":
        url = f"file://{tmp_path}/locks"
        with backend_from_url(url) as backend:
            yield CliStore("file", url, backend)
    elif request.param == "postgres":
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
    else:
        client = redis_client()
        prefix = f"dlock-cli-{os.urandom(5).hex()}"
        url = f"{REDIS_URL}?prefix={prefix}"
        try:
            with backend_from_url(url) as backend:
                yield CliStore("redis", url, backend)
        finally:
            for name in client.scan_iter(match=f"*{prefix}*", count=1000):
                client.delete(name)
            client.close()


@pytest.fixture
def file_store(tmp_path: Path) -> Iterator[CliStore]:
    """The file store alone, for behaviour of the CLI itself that no store changes."""
    url = f"file://{tmp_path}/locks"
    with backend_from_url(url) as backend:
        yield CliStore("file", url, backend)
