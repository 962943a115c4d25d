"""The CLI's commands, run for real (``celery-dlock ...`` and ``celery -A app dlock ...``)
against real stores; each test asserts the store's state after the command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from celery_dlock.cli.env import EXIT_PIPE
from celery_dlock.records import Holder, Lease, Outcome, Record
from tests.cli.clitools import (
    BIN,
    COMMAND_TIMEOUT,
    CliStore,
    environment,
    history_keys,
    popen_cli,
    run_celery,
    run_cli,
)
from tests.support.holders import kill, spawn_holder


def hold(store: CliStore, key: str, ttl: float | None = None, task_id: str = "t-1") -> Lease:
    holder = Holder.current(worker="celery@w1", task_id=task_id, task_name="tests.charge")
    lease = store.backend.try_acquire(key, holder, ttl)
    assert lease is not None
    return lease


def output_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def forced_records(store: CliStore, key: str) -> list[Record]:
    return store.backend.history(key=key, outcome=Outcome.FORCED)


# -- leases -----------------------------------------------------------------------------------


def test_leases_lists_held_lock_with_holder_and_fence(store: CliStore) -> None:
    lease = hold(store, "job:order:42")
    hold(store, "other:order:1", task_id="t-2")

    result = run_cli("--backend", store.url, "leases")

    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()
    assert header.split() == ["KEY", "HOLDER", "AGE", "FENCE", "EXPIRES"]
    assert row.startswith("job:order:42 ")
    assert lease.holder.describe() in row
    assert f"  {lease.fence}  " in row
    # held with no ttl: for ever, or the store's own ttl where a lease lives by it (Redis)
    expires = "never" if store.backend.default_ttl is None else r"in \d+s"
    assert re.search(f"  {expires}$", row), row
    assert "other:order:1" not in result.stdout  # outside the namespace


def test_leases_json_has_every_lease_with_token_and_computed_fields(store: CliStore) -> None:
    first = hold(store, "job:a", ttl=300)
    second = hold(store, "other:b", task_id="t-2")

    data = output_json(run_cli("--backend", store.url, "leases", "--all", "--json"))

    assert data["prefix"] == ""
    by_key = {entry["key"]: entry for entry in data["leases"]}
    assert set(by_key) == {"job:a", "other:b"}
    assert by_key["job:a"]["token"] == first.token
    assert by_key["job:a"]["fence"] == first.fence
    assert 0 < by_key["job:a"]["expires_in"] <= 300
    no_ttl = store.backend.default_ttl  # the store's own ttl where a lease lives by it
    expires_in = by_key["other:b"]["expires_in"]
    assert expires_in is None if no_ttl is None else 0 < expires_in <= no_ttl
    assert by_key["other:b"]["holder"] == second.holder.to_dict()
    assert by_key["other:b"]["holder_text"] == second.holder.describe()
    assert by_key["other:b"]["holder_gone"] is False


def test_leases_with_no_lease_says_so(file_store: CliStore) -> None:
    result = run_cli("--backend", file_store.url, "leases")
    assert result.returncode == 0
    assert (
        result.stdout.strip() == f"no leases under 'job:' in {file_store.url} (--all for every key)"
    )


def test_leases_under_celery_use_the_apps_store_and_namespace(store: CliStore) -> None:
    lease = hold(store, "shop:order:7")
    hold(store, "job:order:8", task_id="t-2")

    result = run_celery(store.url, "leases", "--json", env={"DLOCK_CLI_NAMESPACE": "shop"})
    data = output_json(result)

    assert data["prefix"] == "shop:"
    assert [(e["key"], e["token"]) for e in data["leases"]] == [("shop:order:7", lease.token)]


def test_celery_backend_option_overrides_the_apps_setting(
    file_store: CliStore, tmp_path: Path
) -> None:
    lease = hold(file_store, "job:x")
    elsewhere = f"file://{tmp_path}/elsewhere"

    data = output_json(run_celery(elsewhere, "--backend", file_store.url, "leases", "--json"))

    assert [e["token"] for e in data["leases"]] == [lease.token]


# -- history ----------------------------------------------------------------------------------


def test_history_filters_by_key_outcome_problems_and_since(store: CliStore) -> None:
    two_hours_ago = time.time() - 7200
    # The old record goes first: Redis orders its history by the time records arrive.
    old = Lease("job:a", "0" * 32, 0, Holder.current(task_name="tests.old"), two_hours_ago - 5)
    store.backend.add_record(Record(old, two_hours_ago, Outcome.FAILED, "KeyError", "'x'"))
    for key, outcome, problem in [
        ("job:a", Outcome.SUCCEEDED, None),
        ("job:b", Outcome.FAILED, "ValueError"),
        ("job:c", Outcome.RETRIED, None),
        ("job:d", Outcome.DISCONNECTED, "disconnected"),
        ("job:e", Outcome.ABANDONED, None),  # a problem too (it was left out)
    ]:
        assert store.backend.release(hold(store, key), outcome, problem, f"{key} ended") is not None

    assert history_keys(store) == [
        ("job:e", "abandoned"),
        ("job:d", "disconnected"),
        ("job:c", "retried"),
        ("job:b", "failed"),
        ("job:a", "succeeded"),
        ("job:a", "failed"),
    ]
    assert history_keys(store, "--key", "job:a") == [("job:a", "succeeded"), ("job:a", "failed")]
    assert history_keys(store, "--outcome", "failed") == [("job:b", "failed"), ("job:a", "failed")]
    assert history_keys(store, "--problems") == [
        ("job:e", "abandoned"),
        ("job:d", "disconnected"),
        ("job:b", "failed"),
        ("job:a", "failed"),
    ]
    assert history_keys(store, "--problems", "--limit", "2") == [
        ("job:e", "abandoned"),
        ("job:d", "disconnected"),
    ]
    assert ("job:a", "failed") not in history_keys(store, "--since", "1h")
    an_hour_ago = datetime.fromtimestamp(time.time() - 3600).isoformat(timespec="seconds")
    assert history_keys(store, "--problems", "--since", an_hour_ago) == [
        ("job:e", "abandoned"),
        ("job:d", "disconnected"),
        ("job:b", "failed"),
    ]


def test_history_table_shows_columns_and_details_under_each_row(file_store: CliStore) -> None:
    lease = hold(file_store, "job:b")
    file_store.backend.release(lease, Outcome.FAILED, "ValueError", "bad amount\nTraceback: ...")

    result = run_cli("--backend", file_store.url, "history", "--problems", "--details")

    assert result.returncode == 0, result.stderr
    header, row, *details = result.stdout.splitlines()
    assert header.split() == [
        "RELEASED",
        "KEY",
        "OUTCOME",
        "PROBLEM",
        "FENCE",
        "HOLDER",
        "DURATION",
    ]
    assert row.split()[2:6] == ["job:b", "failed", "ValueError", str(lease.fence)]
    assert details == ["    bad amount", "    Traceback: ..."]


def test_history_with_no_match_says_so_and_hints_the_full_key(file_store: CliStore) -> None:
    hold(file_store, "job:order:1")
    result = run_cli("--backend", file_store.url, "history", "--key", "order:1")
    assert result.returncode == 0
    assert "no history records match" in result.stdout
    assert "did you mean 'job:order:1'?" in result.stdout


def test_history_hints_the_full_key_of_a_key_with_records_only(store: CliStore) -> None:
    store.backend.release(hold(store, "job:order:2"), Outcome.SUCCEEDED)  # no lease left
    result = run_cli("--backend", store.url, "history", "--key", "order:2")
    assert result.returncode == 0 and "no history records match" in result.stdout
    assert "did you mean 'job:order:2'?" in result.stdout


def test_history_rejects_a_bad_since_with_a_usage_error(file_store: CliStore) -> None:
    result = run_cli("--backend", file_store.url, "history", "--since", "yesterday")
    assert result.returncode == 2
    assert "'yesterday' is neither a duration" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [  # found by trying the CLI: tracebacks, OverflowError exit 1, or a silent full listing
        (["history", "--since", "0001-01-01"], "neither a duration"),
        (["history", "--since", "99999999999999999999d"], "before 1970"),
        (["history", "--limit", "99999999999999999999"], "not in the range"),
        (["reap", "--retention", "99999999999999999999d"], "longer than 100 years"),
        (["timeline", "--since", "0001-01-01", "-o", "x.svg"], "neither a duration"),
    ],
)
def test_out_of_range_times_and_limits_are_usage_errors(
    pg_store: CliStore, args: list[str], message: str
) -> None:
    result = run_cli("--backend", pg_store.url, *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


# -- release ----------------------------------------------------------------------------------


def test_release_answered_no_changes_nothing(store: CliStore) -> None:
    lease = hold(store, "job:order:42")

    result = run_cli("--backend", store.url, "release", "job:order:42", input="n\n")

    assert result.returncode == 1
    assert lease.holder.describe() in result.stdout  # the lease was shown before asking
    assert "[y/N]" in result.stdout
    current = store.backend.get("job:order:42")
    assert current is not None and current.token == lease.token
    assert forced_records(store, "job:order:42") == []


def test_release_answered_yes_releases_and_records_forced_with_reason(store: CliStore) -> None:
    lease = hold(store, "job:order:42")

    result = run_cli(
        "--backend", store.url, "release", "job:order:42", "--reason", "stuck worker", input="y\n"
    )

    assert result.returncode == 0, result.stderr
    assert store.backend.get("job:order:42") is None
    [record] = forced_records(store, "job:order:42")
    assert record.lease.token == lease.token
    assert record.problem == "forced"
    assert record.details is not None
    assert "stuck worker" in record.details
    assert f"@{os.uname().nodename}" in record.details  # the operator, user@host


def test_release_leaves_a_lease_taken_meanwhile_untouched(store: CliStore) -> None:
    shown = hold(store, "job:order:42")
    with popen_cli("--backend", store.url, "release", "job:order:42") as process:
        assert process.stdout is not None
        _read_until(process.stdout, b"[y/N]")

        # While the operator reads the prompt, the lease ends and someone else takes the key.
        assert store.backend.release(shown, Outcome.SUCCEEDED) is not None
        newer = hold(store, "job:order:42", task_id="t-2")
        _, err = process.communicate(b"y\n", timeout=60)

    assert process.returncode == 1
    assert b"changed hands meanwhile" in err
    current = store.backend.get("job:order:42")
    assert current is not None and current.token == newer.token
    assert forced_records(store, "job:order:42") == []


def test_release_of_a_lease_that_ended_meanwhile_touches_nothing(file_store: CliStore) -> None:
    shown = hold(file_store, "job:order:42")
    with popen_cli("--backend", file_store.url, "release", "job:order:42", "--json") as process:
        assert process.stderr is not None
        _read_until(process.stderr, b"[y/N]")  # with --json, the lease and prompt go to stderr

        assert file_store.backend.release(shown, Outcome.SUCCEEDED) is not None
        out, _ = process.communicate(b"y\n", timeout=60)

    assert process.returncode == 1
    data = json.loads(out)
    assert (data["status"], data["released"], data["current"]) == ("ended", False, None)
    assert data["lease"]["token"] == shown.token
    assert forced_records(file_store, "job:order:42") == []


def test_release_force_does_not_ask(store: CliStore) -> None:
    lease = hold(store, "job:order:42")

    result = run_cli(
        "--backend", store.url, "release", "job:order:42", "--force", "--reason", "deploy", "--json"
    )

    data = output_json(result)
    assert (data["status"], data["released"]) == ("released", True)
    assert data["record"]["outcome"] == "forced"
    assert data["record"]["lease"]["token"] == lease.token
    assert store.backend.get("job:order:42") is None
    [record] = forced_records(store, "job:order:42")
    assert record.details is not None and "deploy" in record.details


def test_release_takes_the_key_exactly_as_leases_shows_it(file_store: CliStore) -> None:
    lease = hold(file_store, "job:order:42")

    result = run_cli("--backend", file_store.url, "release", "order:42", "--force")

    assert result.returncode == 1
    assert "no lease on 'order:42'" in result.stderr
    assert "did you mean 'job:order:42'?" in result.stderr
    current = file_store.backend.get("job:order:42")
    assert current is not None and current.token == lease.token


def test_release_under_celery(file_store: CliStore) -> None:
    hold(file_store, "job:order:9")
    result = run_celery(file_store.url, "release", "job:order:9", "--force")
    assert result.returncode == 0, result.stderr
    assert file_store.backend.get("job:order:9") is None
    assert len(forced_records(file_store, "job:order:9")) == 1


def _read_until(stream: Any, marker: bytes) -> bytes:
    """Bytes from ``stream`` up to and including ``marker`` (a prompt has no newline)."""
    seen = b""
    while marker not in seen:
        chunk = os.read(stream.fileno(), 4096)
        assert chunk, f"the command ended before printing {marker!r}: {seen!r}"
        seen += chunk
    return seen


# -- reap, migrate ----------------------------------------------------------------------------


def test_reap_records_a_sigkilled_holder(store: CliStore) -> None:
    # Redis has no liveness but expiry: the holder takes a short ttl and is reaped as expired.
    holder, held = spawn_holder(store.url, "job:order:42", 0.5 if store.name == "redis" else None)
    kill(holder)

    counts = _reap_until_one_reaped(store)

    expected = "expired" if store.name == "redis" else "disconnected"
    assert counts["reaped"] == 1 and counts[expected] == 1
    assert store.backend.get("job:order:42") is None
    [record] = store.backend.history(key="job:order:42")
    assert (record.outcome.value, record.lease.token, record.fence) == (
        expected,
        held.token,
        held.fence,
    )


def _reap_until_one_reaped(store: CliStore) -> dict[str, int]:
    """Run ``reap`` until it reaps: the store may notice the death (a closed session, an
    expiry) a moment after the kill."""
    for _ in range(100):
        counts: dict[str, int] = output_json(run_cli("--backend", store.url, "reap", "--json"))
        if counts["reaped"]:
            return counts
        time.sleep(0.1)
    raise AssertionError("reap never reaped the killed holder's lease")


def test_reap_prints_counts(file_store: CliStore) -> None:
    result = run_cli("--backend", file_store.url, "reap")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "leases reaped: 0 (0 disconnected, 0 expired); history not pruned"
    )


def test_migrate_creates_the_postgres_schema_idempotently() -> None:
    from tests.cli.clitools import postgres_url
    from tests.support.services import drop_schema, postgres_admin

    admin = postgres_admin()
    schema = f"dlock_cli_{os.urandom(5).hex()}"
    url = postgres_url(schema)
    try:
        before = run_cli("--backend", url, "leases")
        assert before.returncode == 2
        assert "migrate" in before.stderr

        first = run_cli("--backend", url, "migrate")
        second = run_cli("--backend", url, "migrate", "--json")

        assert first.returncode == 0, first.stderr
        assert first.stdout.rstrip().endswith(": created")  # it said "up to date" before
        assert (output_json(second)["migrated"], output_json(second)["done"]) == (
            True,
            "up to date",
        )
        tables = admin.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s", (schema,)
        ).fetchone()[0]
        assert tables >= 2
        assert run_cli("--backend", url, "leases").returncode == 0
    finally:
        drop_schema(admin, schema)
        admin.close()


def test_migrate_says_a_store_without_schema_needs_none(file_store: CliStore) -> None:
    result = run_cli("--backend", file_store.url, "migrate")
    assert result.returncode == 0
    assert result.stdout.strip() == "the file backend needs no migration"


@pytest.mark.parametrize(
    "command",
    [
        ["leases"],
        ["leases", "--all"],
        ["history"],
        ["history", "--problems", "--details"],
        ["release", "job:held", "--force"],
        ["reap"],
        ["migrate"],
        ["doctor"],
    ],
    ids=" ".join,
)
def test_every_command_prints_json_with_json(file_store: CliStore, command: list[str]) -> None:
    hold(file_store, "job:held")
    data = output_json(run_cli("--backend", file_store.url, *command, "--json"))
    assert isinstance(data, dict)
    assert data["backend"] == file_store.url


# -- metadata ---------------------------------------------------------------------------------


def test_leases_and_history_show_metadata_in_the_table_and_the_json(store: CliStore) -> None:
    holder = Holder.current(task_name="tests.charge", metadata={"order": 42, "amount": "9.50"})
    lease = store.backend.try_acquire("job:meta:42", holder, None)
    assert lease is not None

    table = run_cli("--backend", store.url, "leases")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split()[-1] == "METADATA"
    assert row.endswith('{"amount": "9.50", "order": 42}')
    [entry] = output_json(run_cli("--backend", store.url, "leases", "--json"))["leases"]
    assert entry["metadata"] == {"order": 42, "amount": "9.50"}

    store.backend.release(lease, Outcome.SUCCEEDED)
    history = run_cli("--backend", store.url, "history", "--key", "job:meta:42")
    assert history.returncode == 0, history.stderr
    header, row = history.stdout.splitlines()
    assert header.split()[-1] == "METADATA" and row.endswith('"order": 42}')
    data = output_json(run_cli("--backend", store.url, "history", "--json"))
    [record] = [r for r in data["records"] if r["key"] == "job:meta:42"]
    assert record["metadata"] == {"order": 42, "amount": "9.50"}


def test_tables_without_metadata_have_no_metadata_column(store: CliStore) -> None:
    hold(store, "job:plain")
    header = run_cli("--backend", store.url, "leases").stdout.splitlines()[0]
    assert "METADATA" not in header


# -- alignment --------------------------------------------------------------------------------


def aligned(output: str) -> None:
    """Every cell of every row starts where its header does (two spaces before it)."""
    header, *rows = output.splitlines()
    starts = [found.start() for found in re.finditer(r"\S+", header)]
    for row in rows:
        assert all(row[start - 2 : start] == "  " != row[start] for start in starts[1:]), (
            f"{row!r} is not under {header!r}"
        )


def test_tables_of_celery_task_holders_stay_aligned(file_store: CliStore) -> None:
    # A task's holder (name[uuid] on celery@host (pid N on host)) is wider than a plain cell:
    # its column widens, so that the columns after it stay aligned.
    holders = [
        Holder.current(worker="celery@vm", task_id=str(uuid.uuid4()), task_name=name)
        for name in ("shop.sync", "shop.sync2")
    ]
    holders.append(Holder.current(task_name="tests.plain", metadata={"order": 42}))
    held = [
        file_store.backend.try_acquire(f"job:sync:{n}", holder, None)
        for n, holder in enumerate(holders)
    ]
    assert all(lease is not None and len(lease.holder.describe()) > 48 for lease in held[:2])

    leases = run_cli("--backend", file_store.url, "leases")
    assert leases.returncode == 0, leases.stderr
    assert leases.stdout.splitlines()[0].split() == [
        "KEY", "HOLDER", "AGE", "FENCE", "EXPIRES", "METADATA"
    ]  # fmt: skip
    aligned(leases.stdout)

    for lease in held:
        assert lease is not None and file_store.backend.release(lease, Outcome.SUCCEEDED)
    history = run_cli("--backend", file_store.url, "history")
    assert history.returncode == 0, history.stderr
    aligned(history.stdout)


# -- output to a reader that went away ----------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["leases"], ["history"], ["history", "--details"], ["history", "--json"], ["doctor"]],
    ids=" ".join,
)
def test_output_to_a_reader_that_went_away_ends_quietly_with_141(
    file_store: CliStore, command: list[str]
) -> None:
    # `celery-dlock history | head -1`: once head has exited, the next write fails. Here the
    # reading end is closed before the command starts, so that its first write fails.
    for n in range(3):
        hold(file_store, f"job:held:{n}")
        file_store.backend.release(hold(file_store, f"job:done:{n}"), Outcome.SUCCEEDED)
    reading, writing = os.pipe()
    os.close(reading)
    try:
        result = subprocess.run(
            [str(BIN / "celery-dlock"), "--backend", file_store.url, *command],
            stdout=writing,
            stderr=subprocess.PIPE,
            env=environment(None),
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    finally:
        os.close(writing)
    assert result.returncode == EXIT_PIPE  # 128 + SIGPIPE, as the shell shows for `cat`
    assert result.stderr == b""  # no traceback, no "Error:" line
