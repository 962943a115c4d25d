"""What the CLI tests share, apart from fixtures: the real commands as processes of their own
(forked from a server that imported them once, :mod:`tests.support.forked`), and the test
servers' addresses. A module of its own (not conftest): test modules import it by a name
that no other test directory uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery_dlock.backends.base import LockBackend
from tests.support.forked import ForkServer, forkable
from tests.support.services import POSTGRES_URL, with_options
from tests.support.services import redis_client as connect_redis

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


def environment(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("DLOCK_BACKEND", "DLOCK_NAMESPACE", "DLOCK_CLI_BACKEND", "DLOCK_CLI_NAMESPACE"):
        env.pop(name, None)
    # The checkout the tests are in first, before the installed package: the commands then
    # run the code under test also in a worktree of another commit.
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent), str(HERE)])
    env.update(extra or {})
    return env


def run_cli(
    *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``celery-dlock ARGS`` as a process of its own; its exit code and output."""
    full = environment(env)
    if forkable(full, _FORKED.env):
        return _FORKED.run(list(args), input, full, COMMAND_TIMEOUT)
    return _run([str(BIN / "celery-dlock"), *args], input, env)


_FORKED = ForkServer(environment(None))


def run_celery(
    url: str | None, *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``celery -A celeryapp dlock ARGS`` with the test app's ``dlock_backend`` = ``url``."""
    extra = dict(env or {})
    if url is not None:
        extra["DLOCK_CLI_BACKEND"] = url
    return _run([str(BIN / "celery"), "-A", "celeryapp", "dlock", *args], input, extra)


def _run(
    command: list[str], input: str | None, env: dict[str, str] | None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        input=input,
        capture_output=True,
        text=True,
        env=environment(env),
        timeout=COMMAND_TIMEOUT,
        check=False,
    )


def history_keys(store: CliStore, *args: str) -> list[tuple[str, str]]:
    """``history --json ARGS`` on ``store``: each record's key and outcome, newest first."""
    result = run_cli("--backend", store.url, "history", "--json", *args)
    assert result.returncode == 0, result.stderr
    return [(entry["key"], entry["outcome"]) for entry in json.loads(result.stdout)["records"]]


def popen_cli(*args: str) -> subprocess.Popen[bytes]:
    """``celery-dlock ARGS`` with pipes, for a test that answers a prompt itself."""
    return subprocess.Popen(
        [str(BIN / "celery-dlock"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment(None),
    )


# -- stores -----------------------------------------------------------------------------------


def postgres_url(schema: str) -> str:
    return with_options(POSTGRES_URL, schema=schema)


def redis_client() -> Any:
    return connect_redis(REDIS_URL)
