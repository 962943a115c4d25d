"""``python -m celery_dlock.cli``: the same command as the ``celery-dlock`` entry point, for
a Python whose scripts directory is not on the ``PATH``."""

from __future__ import annotations

import subprocess
import sys

from tests.cli.clitools import COMMAND_TIMEOUT, CliStore, environment
from tests.cli.test_cli_commands import hold


def python_m(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery_dlock.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        env=environment(None),
        timeout=COMMAND_TIMEOUT,
    )


def test_python_m_lists_the_leases_as_the_entry_point_does(file_store: CliStore) -> None:
    lease = hold(file_store, "job:order:42")
    result = python_m("--backend", file_store.url, "leases", "--json")
    assert result.returncode == 0, result.stderr
    assert f'"token": "{lease.token}"' in result.stdout


def test_python_m_names_the_command_in_its_usage() -> None:
    result = python_m("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: celery-dlock [OPTIONS] COMMAND")
