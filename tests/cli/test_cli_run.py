"""``celery-dlock run KEY -- COMMAND``: a command under the lock, with real processes on the
file, Postgres and Redis stores: the lease while it runs, two runs on one key, the outcome of
each way a command ends (exit codes, signals, the runner told to stop), a runner SIGKILLed,
``--once``, and the documented exit codes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from celery_dlock import Outcome
from celery_dlock.cli.run import EXIT_BUSY, EXIT_STORE, RUN_TASK
from tests.cli.clitools import BIN, CliStore, environment, run_cli
from tests.support import eventually

KEY = "job:backup:nightly"
#: Lease stores need a ttl (a killed runner's key frees at expiry): every test gives one.
TTL = ["--ttl", "2"]


def run(store: CliStore, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("--backend", store.url, "run", *args)


def start(store: CliStore, *args: str) -> subprocess.Popen[bytes]:
    """A runner in the background (its output is not looked at: the store says it all)."""
    return subprocess.Popen(
        [str(BIN / "celery-dlock"), "--backend", store.url, "run", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=environment(None),
    )


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_command_runs_holding_the_key_and_its_success_is_recorded(
    store: CliStore, tmp_path: Path
) -> None:
    started, go = tmp_path / "started", tmp_path / "go"
    # The command runs until ``go`` exists: the key is held while the test looks, however
    # slow the machine.
    code = (
        f"import os, pathlib, time; pathlib.Path({str(started)!r}).touch()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)"
    )
    runner = start(store, *TTL, KEY, "--", *python(code))
    try:
        eventually(started.exists, "the command started")
        lease = store.backend.get(KEY)
        assert lease is not None and lease.holder.task_name == RUN_TASK
        assert lease.holder.pid == runner.pid  # the runner holds it, not the command
    finally:
        go.touch()
    assert runner.wait(timeout=60) == 0
    [record] = store.backend.history(key=KEY)
    assert record.outcome is Outcome.SUCCEEDED and record.lease.token == lease.token
    assert store.backend.get(KEY) is None


def test_two_runs_on_one_key_never_overlap_and_a_busy_key_exits_75(
    store: CliStore, tmp_path: Path
) -> None:
    log, go = tmp_path / "intervals", tmp_path / "go"
    # Each command runs until ``go`` exists (and 0.2 s more): the first one holds the key
    # for as long as the busy run takes to start, however slow the machine.
    code = (
        f"import os, time; a = time.time()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        f"time.sleep(0.2); open({str(log)!r}, 'a').write(f'{{a}} {{time.time()}}\\n')"
    )
    first = start(store, *TTL, KEY, "--", *python(code))
    try:
        eventually(lambda: store.backend.get(KEY), "the first run holds the key")
        busy = run(store, *TTL, KEY, "--", "true")
        assert busy.returncode == EXIT_BUSY and "is busy" in busy.stderr
        go.touch()
        second = run(store, *TTL, "--wait", "30", KEY, "--", *python(code))
    finally:
        go.touch()
        first.wait(timeout=60)
    assert second.returncode == 0 and first.returncode == 0
    earlier, later = sorted(
        tuple(map(float, line.split())) for line in log.read_text().splitlines()
    )
    assert earlier[1] <= later[0]  # one after the other


def test_a_failing_command_is_recorded_with_its_exit_code_and_stderr_tail(
    store: CliStore,
) -> None:
    result = run(store, *TTL, KEY, "--", "sh", "-c", "echo 'disk full' >&2; exit 3")
    assert result.returncode == 3
    assert "disk full" in result.stderr  # passed through as it came
    [record] = store.backend.history(key=KEY)
    assert record.outcome is Outcome.FAILED and record.problem == "exit 3"
    assert record.details is not None and "disk full" in record.details


def test_a_command_killed_by_a_signal_exits_128_plus_it_and_is_recorded_failed(
    store: CliStore,
) -> None:
    result = run(store, *TTL, KEY, "--", "sh", "-c", "kill -KILL $$")
    assert result.returncode == 128 + signal.SIGKILL
    [record] = store.backend.history(key=KEY)
    assert record.outcome is Outcome.FAILED and record.problem == "signal SIGKILL"


def test_sigterm_to_the_runner_goes_to_the_command_and_is_recorded_revoked(
    store: CliStore, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    code = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(60)"
    runner = start(store, *TTL, KEY, "--", *python(code))
    eventually(started.exists, "the command started")
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=30) == 128 + signal.SIGTERM
    [record] = store.backend.history(key=KEY)
    assert record.outcome is Outcome.REVOKED and record.problem == "signal SIGTERM"
    assert "the runner got SIGTERM" in (record.details or "")


def test_a_command_that_exits_0_when_the_runner_is_told_to_stop_is_recorded_revoked(
    store: CliStore, tmp_path: Path
) -> None:
    # A graceful stop is no success: recorded succeeded, --once would never run it again.
    started = tmp_path / "started"
    code = (
        "import pathlib, signal, sys, time; "
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
        f"pathlib.Path({str(started)!r}).touch(); time.sleep(60)"
    )
    runner = start(store, *TTL, KEY, "--", *python(code))
    eventually(started.exists, "the command started")
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=30) == 0
    [record] = store.backend.history(key=KEY)
    assert record.outcome is Outcome.REVOKED and record.problem == "exit 0"
    assert "the runner got SIGTERM" in (record.details or "")


def test_a_sigkilled_runner_takes_its_command_with_it_and_leaves_the_key_to_the_store(
    store: CliStore, tmp_path: Path
) -> None:
    # Found by trying the CLI: the command outlived its SIGKILLed runner while the store
    # freed the key, so the next cron run overlapped it.
    started = tmp_path / "started"
    pid_file = tmp_path / "command.pid"
    code = (
        f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); "
        f"pathlib.Path({str(started)!r}).write_text(os.environ['DLOCK_FENCE']); time.sleep(60)"
    )
    runner = start(store, *TTL, KEY, "--", *python(code))
    eventually(started.exists, "the command started")
    held = store.backend.get(KEY)
    assert held is not None
    eventually(started.read_text, "the fence written")
    assert started.read_text() == str(held.fence)  # the command knows its fence
    command = int(pid_file.read_text())
    runner.kill()
    runner.wait(timeout=30)
    eventually(lambda: not _alive(command), "the command killed with its runner", timeout=10)
    after = run(store, *TTL, "--wait", "30", KEY, "--", "true")
    assert after.returncode == 0
    records = store.backend.history(key=KEY)
    ended = next(r for r in records if r.lease.token == held.token)
    assert ended.outcome in (Outcome.DISCONNECTED, Outcome.EXPIRED)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, reaped by init in time, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_once_with_wait_runs_once_when_the_first_run_succeeds_meanwhile(
    store: CliStore, tmp_path: Path
) -> None:
    # Found by trying the CLI: the --once check came before the wait, so a runner waiting
    # behind a run that then succeeded ran the command again. (The first run lasts 4 s: the
    # second runner must start within it, which took over 1 s in a loaded CI run.)
    count, started = tmp_path / "count", tmp_path / "started"
    code = (
        f"import pathlib, time; open({str(count)!r}, 'a').write('ran\\n'); "
        f"pathlib.Path({str(started)!r}).touch(); time.sleep(4)"
    )
    first = start(store, *TTL, "--once", KEY, "--", *python(code))
    eventually(started.exists, "the first run started")
    second = run(store, *TTL, "--once", "--wait", "30", KEY, "--", *python(code))
    assert first.wait(timeout=30) == 0
    assert second.returncode == 0 and "succeeded before" in second.stdout
    assert count.read_text() == "ran\n"
    outcomes = [r.outcome for r in store.backend.history(key=KEY)]
    assert outcomes == [Outcome.SKIPPED, Outcome.SUCCEEDED]


def test_once_runs_a_succeeded_command_only_once(store: CliStore, tmp_path: Path) -> None:
    count = tmp_path / "count"
    code = f"open({str(count)!r}, 'a').write('ran\\n')"
    assert run(store, *TTL, "--once", KEY, "--", *python(code)).returncode == 0
    again = run(store, *TTL, "--once", KEY, "--", *python(code))
    assert again.returncode == 0 and "succeeded before" in again.stdout
    assert count.read_text() == "ran\n"


def test_without_ttl_a_lease_store_gives_its_own_and_an_unreachable_store_is_refused(
    store: CliStore,
) -> None:
    plain = run(store, KEY, "--", "true")
    assert plain.returncode == 0, plain.stderr
    [record] = store.backend.history(key=KEY)
    # Redis: the URL's ttl option (60 s by default), so a killed runner's key is freed.
    assert (record.lease.expires_at is not None) is (store.name == "redis")
    unreachable = run_cli(
        "--backend", "postgresql://nobody:s3cret@127.0.0.1:1/none?connect_timeout=2",
        "run", KEY, "--", "true",
    )  # fmt: skip
    assert unreachable.returncode == EXIT_STORE
    assert "s3cret" not in unreachable.stderr and "lock store failed" in unreachable.stderr


def test_no_command_is_a_usage_error(store: CliStore) -> None:
    result = run(store, *TTL, KEY, "--")
    assert result.returncode == 2


def test_a_mistyped_option_after_the_key_is_a_usage_error_not_a_command(store: CliStore) -> None:
    """Found by trying: ``run KEY --wiat 60 -- true`` took the key, ran ``--wiat`` as the
    command and recorded it failed (FileNotFoundError, exit 127)."""
    result = run(store, *TTL, KEY, "--wiat", "60", "--", "true")
    assert result.returncode == 2 and "--wiat" in result.stderr
    assert store.backend.history(key=KEY) == []


def test_a_command_that_cannot_start_exits_127_and_is_recorded_failed(store: CliStore) -> None:
    result = run(store, *TTL, KEY, "--", "/no/such/command")
    assert result.returncode == 127 and "/no/such/command" in result.stderr
    [record] = store.backend.history(key=KEY)
    assert record.outcome is Outcome.FAILED and record.problem == "FileNotFoundError"


def test_a_ttl_from_the_url_is_enough_on_postgres_with_liveness_ttl(pg_store: CliStore) -> None:
    # Found by trying the CLI: run demanded --ttl though the URL gave one, as Lock takes it.
    url = f"{pg_store.url}{'&' if '?' in pg_store.url else '?'}liveness=ttl&ttl=30"
    result = run_cli("--backend", url, "run", KEY, "--", "true")
    assert result.returncode == 0, result.stderr
    [record] = pg_store.backend.history(key=KEY)
    assert record.outcome is Outcome.SUCCEEDED
    assert record.lease.expires_at is not None  # it took the URL's ttl
