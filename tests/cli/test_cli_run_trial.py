"""``celery-dlock run`` tried as a demanding operator would, with real processes and stores:
a lease lost while the command runs (the command is stopped, not left running beside the
next holder), a busy key's ``skipped`` record (cron can tell it from a failure, and so can
the history), a command that cannot be executed, a command that leaves a grandchild, and
output passed through as it is."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from celery_dlock import Holder, Outcome
from celery_dlock.cli.run import EXIT_BUSY
from tests.cli.clitools import BIN, CliStore, environment, run_cli
from tests.support import eventually
from tests.support.services import postgres_admin

KEY = "job:backup:nightly"
TTL = ["--ttl", "3"]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def start(store: CliStore, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(BIN / "celery-dlock"), "--backend", store.url, "run", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=environment(None),
    )


def finish(runner: subprocess.Popen[bytes]) -> bytes:
    """Kill the runner if it still runs; its stderr."""
    runner.kill()
    return runner.communicate(timeout=60)[1]


def sleeper(started: Path) -> list[str]:
    """A command that says it started, then sleeps far longer than any test waits."""
    return python(f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(300)")


def test_a_lease_force_released_while_the_command_runs_stops_the_command(
    store: CliStore, tmp_path: Path
) -> None:
    """Found by trying: the runner only warned, so the command ran on beside the next holder
    (exit 0 after it ended, two commands under one key at once)."""
    started = tmp_path / "started"
    runner = start(store, *TTL, KEY, "--", *sleeper(started))
    try:
        eventually(started.exists, "the command started")
        held = store.backend.get(KEY)
        assert held is not None
        released = run_cli("--backend", store.url, "release", "--force", KEY)
        assert released.returncode == 0, released.stderr
        # The next renewal (every ttl/3) finds the lease gone and stops the command.
        assert runner.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        err = finish(runner)
    assert b"stopping the command" in err
    mine = [r for r in store.backend.history(key=KEY) if r.lease.token == held.token]
    assert Outcome.FORCED in {r.outcome for r in mine}
    lost = next(r for r in mine if r.outcome is Outcome.LOST)
    assert "the runner lost its lease" in (lost.details or "")
    assert (lost.details or "").startswith("failed not recorded")  # stopped, not revoked


def test_a_lock_session_that_ends_while_the_command_runs_stops_the_command(
    pg_store: CliStore, tmp_path: Path
) -> None:
    """No ttl on Postgres: the lease lives with the runner's session; when it ends, the key
    is free for the next run, so this command must not go on."""
    started = tmp_path / "started"
    runner = start(pg_store, KEY, "--", *sleeper(started))
    admin = postgres_admin()
    try:
        eventually(started.exists, "the command started")
        held = pg_store.backend.get(KEY)
        assert held is not None
        schema = pg_store.url.rsplit("schema=", 1)[1]
        [(ended,)] = admin.execute(
            f'SELECT pg_terminate_backend(backend_pid) FROM "{schema}".locks WHERE key = %s',
            (KEY,),
        ).fetchall()
        assert ended
        assert runner.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        admin.close()
        finish(runner)
    [record] = pg_store.backend.history(key=KEY)
    assert record.lease.token == held.token and record.outcome is Outcome.LOST
    assert "ended by SIGTERM (the runner lost its lease)" in (record.details or "")
    assert (record.details or "").startswith("failed not recorded")  # stopped, not revoked


def test_a_command_that_ignores_the_sigterm_of_a_lost_lease_is_killed(
    file_store: CliStore, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    code = (
        "import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(started)!r}).touch(); time.sleep(300)"
    )
    runner = start(file_store, *TTL, KEY, "--", *python(code))
    try:
        eventually(started.exists, "the command started")
        released = run_cli("--backend", file_store.url, "release", "--force", KEY)
        assert released.returncode == 0, released.stderr
        assert runner.wait(timeout=60) == 128 + signal.SIGKILL
    finally:
        finish(runner)


def test_lost_grace_gives_a_command_that_shuts_down_slowly_its_time(
    file_store: CliStore, tmp_path: Path
) -> None:
    """A command whose clean shutdown after SIGTERM outlasts the default grace (10 s; here
    until the test lets it end, 11 s after the SIGTERM) ends by itself with ``--lost-grace
    60``; it was SIGKILLed mid-shutdown before the option."""
    started, termed, go = tmp_path / "started", tmp_path / "termed", tmp_path / "go"
    code = (
        "import os, pathlib, signal, sys, time\n"
        f"def stop(*_):\n    pathlib.Path({str(termed)!r}).touch()\n"
        f"    while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"pathlib.Path({str(started)!r}).touch(); time.sleep(300)\n"
    )
    runner = start(file_store, *TTL, "--lost-grace", "60", KEY, "--", *python(code))
    try:
        eventually(started.exists, "the command started")
        released = run_cli("--backend", file_store.url, "release", "--force", KEY)
        assert released.returncode == 0, released.stderr
        eventually(termed.exists, "the command got the SIGTERM", timeout=60)
        time.sleep(11)  # past the default grace: a SIGKILL due by then would have come
        go.touch()
        assert runner.wait(timeout=60) == 3  # its own exit, not 128 + SIGKILL
    finally:
        err = finish(runner)
    assert b"SIGKILL in 60 s" in err
    [lost] = file_store.backend.history(key=KEY, outcome=Outcome.LOST)
    assert "exit 3" in (lost.details or "")


def test_a_busy_key_exits_75_and_is_recorded_skipped_with_its_holder(store: CliStore) -> None:
    """Found by trying: a busy run left no trace in the history (a task's skip does), so an
    operator could not see how often cron found the key busy."""
    other = store.backend.try_acquire(KEY, Holder.current(task_name="t.other"), 30)
    assert other is not None
    busy = run_cli("--backend", store.url, "run", *TTL, KEY, "--", "true")
    waited = run_cli("--backend", store.url, "run", *TTL, "--wait", "0.5", KEY, "--", "true")
    assert busy.returncode == EXIT_BUSY and waited.returncode == EXIT_BUSY
    skipped = store.backend.history(key=KEY, outcome=Outcome.SKIPPED)
    assert len(skipped) == 2 and {r.problem for r in skipped} == {"locked"}
    assert all("not run" in (r.details or "") for r in skipped)
    assert store.backend.get(KEY) == other  # nothing taken from the holder


def test_a_command_that_is_not_executable_exits_126_not_found_127(
    file_store: CliStore, tmp_path: Path
) -> None:
    """As sh(1): 126 when the command is there but cannot be run, 127 when it is not there."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho ran\n")  # no execute bit
    denied = run_cli("--backend", file_store.url, "run", KEY, "--", str(script))
    missing = run_cli("--backend", file_store.url, "run", KEY, "--", str(tmp_path / "nope"))
    assert (denied.returncode, missing.returncode) == (126, 127)
    problems = [r.problem for r in file_store.backend.history(key=KEY)]
    assert problems == ["FileNotFoundError", "PermissionError"]


def test_stdin_and_binary_stdout_pass_through_untouched(
    file_store: CliStore, tmp_path: Path
) -> None:
    """Pins behaviour that held: stdin and stdout are the runner's own."""
    data = bytes(range(256)) * 4096  # 1 MiB, every byte value
    result = subprocess.run(
        [str(BIN / "celery-dlock"), "--backend", file_store.url, "run", KEY, "--", "cat"],
        input=data,
        capture_output=True,
        env=environment(None),
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and result.stdout == data


def test_a_command_that_leaves_a_grandchild_releases_when_it_exits(
    file_store: CliStore, tmp_path: Path
) -> None:
    """Pins behaviour that held: the key is the command's, not its background children's."""
    code = "sleep 300 >/dev/null 2>&1 & echo $! > " + str(tmp_path / "grandchild")
    result = run_cli("--backend", file_store.url, "run", KEY, "--", "sh", "-c", code)
    grandchild = int((tmp_path / "grandchild").read_text())
    try:
        assert result.returncode == 0
        assert file_store.backend.get(KEY) is None
        [record] = file_store.backend.history(key=KEY)
        assert record.outcome is Outcome.SUCCEEDED
    finally:
        subprocess.run(["kill", "-KILL", str(grandchild)], check=False)
