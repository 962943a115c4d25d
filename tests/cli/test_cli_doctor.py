"""``doctor``, and the CLI's failures: one clear line, the right exit code, no traceback,
and never a password, whatever the command."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import backend_from_url
from celery_dlock.reap import JANITOR_QUIET, janitor_key
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token
from tests.cli.clitools import REDIS_URL, CliStore, postgres_url, redis_client, run_celery, run_cli
from tests.support.services import drop_schema, postgres_admin

SECRET = "s3cret-pw"


def checks(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    data = json.loads(result.stdout)
    return {check["name"]: check for check in data["checks"]}


def test_doctor_passes_on_a_healthy_store_once_the_janitor_ran(store: CliStore) -> None:
    before = run_cli("--backend", store.url, "doctor", "--json")
    assert before.returncode == 0, before.stdout + before.stderr
    assert checks(before)["janitor"]["status"] == "warn"
    assert "never ran" in checks(before)["janitor"]["detail"]

    assert run_cli("--backend", store.url, "reap").returncode == 0
    result = run_cli("--backend", store.url, "doctor", "--json")

    assert result.returncode == 0, result.stdout + result.stderr
    found = checks(result)
    assert json.loads(result.stdout)["ok"] is True
    assert {"connect", "capabilities", "clock skew", "janitor"} <= set(found)
    assert all(check["status"] != "fail" for check in found.values())
    assert found["janitor"]["status"] == "ok"
    assert "last recorded run" in found["janitor"]["detail"]


def test_doctor_table_names_the_store_and_each_check(file_store: CliStore) -> None:
    result = run_cli("--backend", file_store.url, "doctor")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"backend    {file_store.url} (from --backend)"
    assert lines[1] == "namespace  job"
    assert lines[3].split() == ["STATUS", "CHECK", "DETAIL"]
    assert any(line.startswith("ok      clock skew    n/a") for line in lines)
    assert lines[-1] == "all checks passed (1 warning)"


def janitor_ran(url: str, ago: float) -> None:
    """A recorded janitor run, released ``ago`` seconds ago."""
    now = time.time()
    lease = Lease(janitor_key("job"), new_token(), 0, Holder.current(), now - ago - 0.1)
    counts = {"reaped": 0, "disconnected": 0, "expired": 0, "pruned": 0, "skipped": 0}
    backend_from_url(url).add_record(Record(lease, now - ago, Outcome.SUCCEEDED, result=counts))


def test_doctor_under_celery_warns_when_the_janitor_is_late(file_store: CliStore) -> None:
    # An interval of 1 ms, and a last run past the hour in which an idle run goes unrecorded.
    janitor_ran(file_store.url, ago=JANITOR_QUIET + 5)
    result = run_celery(file_store.url, "doctor", "--json", env={"DLOCK_CLI_JANITOR": "0.001"})

    assert result.returncode == 0, result.stderr
    janitor = checks(result)["janitor"]
    assert janitor["status"] == "warn"
    assert "is celery beat running?" in janitor["detail"]
    assert json.loads(result.stdout)["source"] == "dlock_backend"


def test_doctor_under_celery_takes_a_janitor_unrecorded_within_the_hour_for_running(
    file_store: CliStore,
) -> None:
    # Far more than 3 intervals of 1 ms, but within the hour: idle runs go unrecorded then.
    janitor_ran(file_store.url, ago=600)
    result = run_celery(file_store.url, "doctor", "--json", env={"DLOCK_CLI_JANITOR": "0.001"})

    assert result.returncode == 0, result.stderr
    janitor = checks(result)["janitor"]
    assert janitor["status"] == "ok", janitor
    assert janitor["detail"].startswith("last recorded run 10m0"), janitor


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}@127.0.0.1:1/4",
        f"postgresql://postgres:{SECRET}@127.0.0.1:1/test?connect_timeout=5",
    ],
    ids=["redis", "postgres"],
)
def test_doctor_fails_on_an_unreachable_store(url: str) -> None:
    result = run_cli("--backend", url, "doctor")

    assert result.returncode == 1
    [row] = [line for line in result.stdout.splitlines() if line.startswith("fail")]
    assert row.split()[:2] == ["fail", "connect"]
    assert "refused" in row.lower()
    assert result.stdout.splitlines()[-1] == "1 of 1 checks failed"
    assert SECRET not in result.stdout + result.stderr
    assert ":***@" in result.stdout


# -- errors and masking -----------------------------------------------------------------------

COMMANDS = [
    ["leases"],
    ["leases", "--json"],
    ["history", "--problems"],
    ["release", "job:x", "--force"],
    ["reap"],
    ["migrate"],
    ["doctor"],
    ["doctor", "--json"],
]


def _assert_masked(result: subprocess.CompletedProcess[str]) -> None:
    text = result.stdout + result.stderr
    assert SECRET not in text
    assert "Traceback" not in text


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_password_is_masked_when_the_host_is_unreachable(command: list[str]) -> None:
    result = run_cli("--backend", f"redis://:{SECRET}@127.0.0.1:1/4", *command)
    _assert_masked(result)
    if command == ["migrate"]:  # a store with no schema: nothing to connect for
        assert result.returncode == 0
        return
    assert result.returncode == 1
    assert ":***@127.0.0.1:1/4" in result.stdout + result.stderr


@pytest.fixture
def postgres_with_password() -> Iterator[str]:
    """A migrated schema of the test server, reached by a URL with a password (which the
    server's trust authentication ignores)."""
    admin = postgres_admin()
    schema = f"dlock_cli_{os.urandom(5).hex()}"
    url = postgres_url(schema).replace("postgres@", f"postgres:{SECRET}@", 1)
    assert SECRET in url
    try:
        with backend_from_url(url) as backend:
            backend.migrate()  # type: ignore[attr-defined]
        yield url
    finally:
        drop_schema(admin, schema)
        admin.close()


def test_password_is_masked_when_the_store_answers(postgres_with_password: str) -> None:
    for command in COMMANDS:
        result = run_cli("--backend", postgres_with_password, *command)
        _assert_masked(result)
        expected = 1 if command[0] == "release" else 0  # nothing to release
        assert result.returncode == expected, result.stderr
        if command[0] == "doctor":
            assert ":***@127.0.0.1" in result.stdout


def test_password_is_masked_by_a_real_redis() -> None:
    # This Redis sets no password: whatever it answers to the AUTH, no output shows it.
    client = redis_client()
    prefix = f"dlock-cli-{os.urandom(5).hex()}"
    url = REDIS_URL.replace("redis://", f"redis://:{SECRET}@") + f"?prefix={prefix}"
    try:
        for command in COMMANDS:
            result = run_cli("--backend", url, *command)
            _assert_masked(result)
            assert result.returncode in (0, 1)
    finally:
        for name in client.scan_iter(match=f"*{prefix}*", count=1000):
            client.delete(name)
        client.close()


def test_password_is_masked_under_celery() -> None:
    result = run_celery(f"redis://:{SECRET}@127.0.0.1:1/4", "leases")
    _assert_masked(result)
    assert result.returncode == 1
    assert result.stderr.startswith("Error: ")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redsi://127.0.0.1/4", "no lock backend for URL scheme 'redsi'; did you mean 'redis'?"),
        ("127.0.0.1:6379", "a lock backend URL looks like 'scheme://...'"),
        (f"file://u:{SECRET}@host/x", "file backend URL 'file://u:***@host/x' has a host part"),
        ("redis://127.0.0.1:6379/4?colour=blue", "unknown option 'colour'"),
    ],
    ids=["unknown-scheme", "no-scheme", "file-host", "unknown-option"],
)
def test_a_bad_url_is_one_line_and_exit_code_2(url: str, message: str) -> None:
    result = run_cli("--backend", url, "leases")
    assert result.returncode == 2
    assert result.stderr.startswith("Error: ")
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    _assert_masked(result)


def test_a_missing_driver_names_the_extra(tmp_path: Path) -> None:
    # A stand-in that fails to import as if redis-py were not installed.
    (tmp_path / "redis.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'redis'\", name='redis')\n"
    )
    result = run_cli(
        "--backend", "redis://127.0.0.1:6379/4", "leases", env={"PYTHONPATH": str(tmp_path)}
    )
    assert result.returncode == 2
    assert "pip install 'celery-dlock[redis]'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_no_backend_is_a_usage_error_and_dlock_backend_env_is_read(file_store: CliStore) -> None:
    missing = run_cli("leases")
    assert missing.returncode == 2
    assert missing.stderr.strip() == "Error: no lock store: pass --backend URL or set DLOCK_BACKEND"

    lease = file_store.backend.try_acquire("job:k", Holder.current(), None)
    assert lease is not None
    result = run_cli("doctor", "--json", env={"DLOCK_BACKEND": file_store.url})
    assert json.loads(result.stdout)["source"] == "DLOCK_BACKEND"
    listed = run_cli("leases", "--json", env={"DLOCK_BACKEND": file_store.url})
    assert [entry["token"] for entry in json.loads(listed.stdout)["leases"]] == [lease.token]


def test_celery_lists_the_dlock_command() -> None:
    result = run_celery(None, "--help")
    assert result.returncode == 0, result.stderr
    for command in ("leases", "history", "release", "reap", "migrate", "doctor"):
        assert f"  {command} " in result.stdout


def test_standalone_needs_no_celery(file_store: CliStore, tmp_path: Path) -> None:
    # A stand-in that fails to import as if Celery were not installed.
    (tmp_path / "celery.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'celery'\", name='celery')\n"
    )
    hold = file_store.backend.try_acquire("job:k", Holder.current(), None)
    assert hold is not None
    for command in (["leases"], ["history"], ["reap"], ["doctor"], ["release", "job:k", "--force"]):
        result = run_cli("--backend", file_store.url, *command, env={"PYTHONPATH": str(tmp_path)})
        assert result.returncode == 0, result.stderr
    assert file_store.backend.get("job:k") is None
