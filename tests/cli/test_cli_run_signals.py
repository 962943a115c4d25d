"""``celery-dlock run``: Ctrl-C and the command's stderr, with real processes, a real pty and
real stores: Ctrl-C while waiting for the key, Ctrl-C on a terminal reaching the command once,
SIGINT sent to the runner alone passed on, and a background child of the command that holds
its stderr."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import termios
from pathlib import Path

import psutil

from celery_dlock import Holder, Outcome
from celery_dlock.cli.env import EXIT_INTERRUPTED
from tests.cli.clitools import BIN, CliStore, environment, run_cli
from tests.support import eventually
from tests.support.services import postgres_admin

KEY = "job:backup:nightly"
TTL = ["--ttl", "2"]


def runner_command(store: CliStore, *args: str) -> list[str]:
    return [str(BIN / "celery-dlock"), "--backend", store.url, "run", *args]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _waiting_in_postgres(runner: subprocess.Popen[bytes], admin: object) -> bool:
    """Whether one of the runner's connections is blocked in the store's wait statement."""
    ports = {c.laddr.port for c in psutil.Process(runner.pid).net_connections("tcp") if c.laddr}
    rows = admin.execute(  # type: ignore[attr-defined]
        "SELECT client_port FROM pg_stat_activity WHERE application_name = "
        "'celery_dlock waiter' AND state = 'active' AND wait_event_type = 'Lock'"
    ).fetchall()
    return any(port in ports for (port,) in rows)


def test_ctrl_c_while_waiting_for_the_key_exits_130_and_holds_nothing(
    pg_store: CliStore, tmp_path: Path
) -> None:
    first = pg_store.backend.try_acquire(KEY, Holder.current(task_name="t.first"), None)
    assert first is not None
    ran = tmp_path / "ran"
    runner = subprocess.Popen(
        runner_command(pg_store, "--wait", "600", KEY, "--", "touch", str(ran)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment(None),
        start_new_session=True,  # no terminal: the test's own does not matter
    )
    admin = postgres_admin()
    try:
        eventually(lambda: _waiting_in_postgres(runner, admin), "the runner waits for the key")
        runner.send_signal(signal.SIGINT)
        _, err = runner.communicate(timeout=60)
    finally:
        admin.close()
        if runner.poll() is None:
            runner.kill()
    assert runner.returncode == EXIT_INTERRUPTED
    assert b"Traceback" not in err and b"not run" in err
    assert not ran.exists()
    assert pg_store.backend.get(KEY) == first  # the first holder's, untouched
    assert pg_store.backend.release(first, Outcome.SUCCEEDED) is not None
    # Nothing of the interrupted runner is left: the key is free at once for the next run.
    after = run_cli("--backend", pg_store.url, "run", KEY, "--", "touch", str(ran))
    assert after.returncode == 0 and ran.exists()


def _sigint_counter(started: Path, count: Path, go: Path) -> list[str]:
    """A command that stops gracefully on SIGINT (the first one, as a real program would;
    a second would be its "force quit"): it counts each SIGINT, and ends with 0 once ``go``
    exists."""
    return python(
        "import os, pathlib, signal, time\n"
        f"count = pathlib.Path({str(count)!r})\n"
        "signal.signal(signal.SIGINT, lambda *_: count.open('a').write('x'))\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
    )


def _in_a_terminal(command: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    """``command`` as the foreground process group of a new pty (its controlling
    terminal), as when typed at a shell prompt; and the pty's master end."""
    master, slave = os.openpty()

    def take_the_terminal() -> None:  # after setsid: the pty becomes ours, we its foreground
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    process = subprocess.Popen(
        command,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=environment(None),
        start_new_session=True,
        preexec_fn=take_the_terminal,  # noqa: PLW1509 - one ioctl
    )
    os.close(slave)
    os.set_blocking(master, False)
    return process, master


def _read(master: int, seen: bytearray) -> bytes:
    with contextlib.suppress(OSError):  # nothing yet (EAGAIN); EIO once the pty is closed
        seen += os.read(master, 65536)
    return bytes(seen)


def test_ctrl_c_on_a_terminal_reaches_the_command_once(store: CliStore, tmp_path: Path) -> None:
    started, count, go = tmp_path / "started", tmp_path / "count", tmp_path / "go"
    command = runner_command(store, *TTL, KEY, "--", *_sigint_counter(started, count, go))
    runner, master = _in_a_terminal(command)
    seen = bytearray()
    try:
        eventually(started.exists, "the command started")
        os.write(master, b"\x03")  # Ctrl-C: the terminal signals its foreground group
        # The runner says what it did with its SIGINT; an old runner passes it on instead,
        # which the command counts.
        eventually(
            lambda: (
                b"from the terminal" in _read(master, seen)
                or (count.exists() and len(count.read_text()) >= 2)
            ),
            "the runner handled Ctrl-C",
        )
        # The runner may say so before the command's handler has written its count.
        eventually(lambda: count.exists() and count.read_text() != "", "the command got Ctrl-C")
        assert count.read_text() == "x"  # once: from the terminal, not again from the runner
    finally:
        go.touch()
        try:
            runner.wait(timeout=60)
        finally:
            os.close(master)
    assert runner.returncode == 0
    [record] = store.backend.history(key=KEY)
    assert record.outcome is Outcome.REVOKED and "the runner got SIGINT" in (record.details or "")


def test_sigint_to_the_runner_alone_is_passed_to_the_command(
    file_store: CliStore, tmp_path: Path
) -> None:
    started, count, go = tmp_path / "started", tmp_path / "count", tmp_path / "go"
    runner = subprocess.Popen(
        runner_command(file_store, KEY, "--", *_sigint_counter(started, count, go)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=environment(None),
        start_new_session=True,  # no terminal: `kill -INT` from a script or a supervisor
    )
    try:
        eventually(started.exists, "the command started")
        runner.send_signal(signal.SIGINT)
        eventually(lambda: count.exists() and count.read_text() != "", "the command got the SIGINT")
        assert count.read_text() == "x"
    finally:
        go.touch()
        runner.wait(timeout=60)
    assert runner.returncode == 0
    [record] = file_store.backend.history(key=KEY)
    assert record.outcome is Outcome.REVOKED


def test_a_background_child_holding_stderr_does_not_keep_the_key(
    store: CliStore, tmp_path: Path
) -> None:
    # The command fails (its stderr goes into the record) and leaves a background child
    # that keeps the command's stderr open. Once the command has exited, the child writes
    # "late" to that stderr when the key is free, or after 3.5 s: a runner that copies
    # stderr until its end (it used to, for up to 5 s) holds the key meanwhile and records
    # the late line as the command's.
    go, child_pid = tmp_path / "go", tmp_path / "child.pid"
    script = tmp_path / "child.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "from celery_dlock import backend_from_url\n"
        "parent = os.getppid()\n"
        f"store = backend_from_url({store.url!r})\n"
        f"pathlib.Path({str(child_pid)!r}).write_text(str(os.getpid()))\n"
        "while os.getppid() == parent: time.sleep(0.01)\n"
        "limit = time.monotonic() + 3.5\n"
        f"while store.get({KEY!r}) is not None and time.monotonic() < limit: time.sleep(0.02)\n"
        "try:\n"
        "    sys.stderr.write('late\\n'); sys.stderr.flush()\n"
        "except OSError: pass\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
    )
    shell = (
        f"echo own >&2; {sys.executable} {script} & "
        f"while [ ! -s {child_pid} ]; do sleep 0.01; done; exit 3"
    )
    runner = subprocess.Popen(
        runner_command(store, *TTL, KEY, "--", "sh", "-c", shell),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=environment(None),
    )
    try:
        assert runner.wait(timeout=60) == 3
        pid = int(child_pid.read_text())
        assert psutil.pid_exists(pid)  # it still holds the stderr the runner read
        assert store.backend.get(KEY) is None
        [record] = store.backend.history(key=KEY)
        assert record.outcome is Outcome.FAILED
        assert "own" in (record.details or "")  # the command's own stderr is kept
        assert "late" not in (record.details or "")
    finally:
        go.touch()


def test_under_nohup_a_hangup_reaches_neither_the_runner_nor_the_command(
    file_store: CliStore, tmp_path: Path
) -> None:
    # A runner started ignoring SIGHUP (by nohup) used to catch it and pass it on, killing
    # the command when the terminal closed.
    started = tmp_path / "started"
    code = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(120)"
    runner = subprocess.Popen(
        ["nohup", *runner_command(file_store, KEY, "--", *python(code))],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=environment(None),
    )
    try:
        eventually(started.exists, "the command started")
        runner.send_signal(signal.SIGHUP)  # ignored, by the kernel, at once
        runner.send_signal(signal.SIGTERM)  # the way to stop it
        assert runner.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    [record] = file_store.backend.history(key=KEY)
    assert record.outcome is Outcome.REVOKED and record.problem == "signal SIGTERM"
    assert "SIGHUP" not in (record.details or "")
