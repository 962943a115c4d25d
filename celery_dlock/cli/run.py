"""``celery-dlock run KEY -- COMMAND ARGS...``: a command under the lock, as ``flock(1)`` does
for a crontab line, with the locks, fences and history of every other way in.

The runner takes the lease (waiting up to ``--wait``), renews it while the command runs
(with ``--ttl``), passes SIGTERM, SIGINT and SIGHUP on to the command, and releases as soon
as the command exits, on every way out, recorded with the outcome: ``succeeded`` for exit
0, ``failed`` with ``exit N`` or ``signal NAME`` and the tail of the command's stderr,
``revoked`` when the runner was told to stop (whatever the command's exit status). A runner
that is SIGKILLed releases nothing: the store's liveness frees the key (its session or process
ends, or its ttl runs out) and the janitor records it; on Linux its command is SIGKILLed with
it (``PR_SET_PDEATHSIG``), so that the next run cannot overlap a command whose lock is gone.
A lease lost while the command runs (its Postgres session ended, a renewal found it expired
or force-released) stops the command for the same reason: SIGTERM at once, SIGKILL
``--lost-grace`` seconds later (:data:`LOST_GRACE` by default; 0 kills at once); the release
is recorded ``lost``, naming how it ended. The runner learns of it from the store (a renewal
that finds the lease gone, the Postgres lock session's watcher) or from its own reads of the
lease while the command runs, every ``--watch`` seconds: once a second, every 10 s on S3 and
GCS, none where the store notices as soon (:func:`~celery_dlock.cli.lost.watch_every`).
The command finds the key and the lease's fence in ``DLOCK_KEY`` and ``DLOCK_FENCE``.

Ctrl-C on a terminal signals the whole foreground process group, the command included (it
runs in the runner's group, as under ``flock(1)``): the runner then passes no second SIGINT,
which a command that takes a second Ctrl-C for "force quit" would obey. A SIGINT sent to
the runner alone (``kill -INT``) while it runs in its terminal's foreground is therefore not
passed on either: send SIGTERM to stop it from elsewhere.

Exit codes: the command's own (128 + N when a signal N ended it); 75 (EX_TEMPFAIL) when the
key stayed busy (recorded ``skipped``, problem ``locked``, as a task's ``on_locked="skip"``);
69 (EX_UNAVAILABLE) when the store failed before the command started; 127 when the command
was not found, 126 when it could not be started otherwise (both recorded ``failed``); 130
when Ctrl-C stopped the wait for the key (the command is not run, nothing is held); 2 for
bad usage. With ``--once``, a key whose command succeeded before exits 0 at once without
running it again.

The command's stderr is copied to ours until the command exits: a background process it
leaves holding that stderr does not keep the key (what it writes later has no reader).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import selectors
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import click

from celery_dlock.cli.env import EXIT_INTERRUPTED, Env, UsageFailure, guarded_creating
from celery_dlock.cli.lost import LOST_GRACE, WATCH_LEAST, Guard, Watch, say, watch_every
from celery_dlock.cli.render import DURATION, DurationType
from celery_dlock.errors import (
    ConfigurationError,
    DLockError,
    LockNotAcquiredError,
    LockTimeoutError,
)
from celery_dlock.keys import validate_key
from celery_dlock.lock import Lock
from celery_dlock.records import Holder, Lease, Outcome

__all__ = ["EXIT_BUSY", "EXIT_STORE", "LOST_GRACE", "RUN_TASK", "run"]

#: Exit code when the key stayed busy (sysexits' EX_TEMPFAIL: try again later).
EXIT_BUSY = 75
#: Exit code when the store failed before the command started (EX_UNAVAILABLE).
EXIT_STORE = 69
#: The task name of the runner's leases, under which ``--once`` keeps a success.
RUN_TASK = "celery-dlock run"
#: Bytes of the command's stderr kept for the record of a failure.
STDERR_TAIL = 4096
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: prctl(2): the signal a process gets when its parent thread dies.
_PR_SET_PDEATHSIG = 1


class _WaitType(DurationType):
    """``--wait``: a duration, or ``forever`` (no limit)."""

    name = "duration|forever"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("forever", "inf"):
            return None
        return super().convert(value, param, ctx)


WAIT = _WaitType()


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("key")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option(
    "--ttl", type=DURATION, help="Lease seconds (or 10m, 1h), renewed while the command runs."
)
@click.option(
    "--wait",
    type=WAIT,
    default="0",
    show_default=True,
    help="Seconds (or 10m) to wait for the key; 'forever' waits without limit.",
)
@click.option("--once", is_flag=True, help="Run at most one success of this key, ever.")
@click.option(
    "--lost-grace",
    # A duration (not any float): nan killed at once and inf never (the timer's thread
    # died with an OverflowError), leaving a command that ignores SIGTERM beside the next.
    type=DURATION,
    default=LOST_GRACE,
    show_default=True,
    help="Seconds from the SIGTERM to the SIGKILL of a command whose lease was lost.",
)
@click.option(
    "--watch",
    type=DURATION,
    help="Seconds between reads of the lease while the command runs: a forced release stops "
    "the command within that time (plus one read). Default 1 s; 10 s on S3 and GCS, which "
    "bill each read (8,640 a day). No reads where the store notices as soon: Postgres "
    "without --ttl (its session watcher, within about 1 s), or a renewal (every ttl/3) "
    "due as often.",
)
@guarded_creating
def run(
    env: Env,
    key: str,
    command: tuple[str, ...],
    *,
    ttl: float | None,
    wait: float | None,
    once: bool,
    lost_grace: float,
    watch: float | None,
) -> None:
    """Run COMMAND holding the lock KEY (given in full, e.g. job:backup:nightly)."""
    words = _words(key, command)
    if watch is not None and watch < WATCH_LEAST:
        raise UsageFailure(f"--watch takes at least {WATCH_LEAST:g} s, not {watch:g}")
    backend = env.backend
    if ttl is None and backend.capabilities.liveness == "lease" and backend.default_ttl is None:
        raise UsageFailure(
            f"the {backend.name} store frees a dead holder's key only when its lease "
            "expires: give --ttl SECONDS (renewed while the command runs)"
        )
    holder = Holder.current(task_name=RUN_TASK)
    guard = Guard(lost_grace)
    try:
        lock = Lock(backend, key, ttl, wait, holder=holder, on_lost=guard.lost)
    except ConfigurationError as exc:  # a --ttl or --wait out of range
        option = "--ttl" if "ttl" in str(exc) else "--wait"
        raise UsageFailure(f"{option}: {exc}") from None
    lease = _take(env, lock, once)
    if lease is not None:
        every = watch_every(lock, watch)
        raise click.exceptions.Exit(_run_holding(lock, lease, words, once, guard, every=every))


def _words(key: str, command: tuple[str, ...]) -> list[str]:
    """The command to run, once KEY and it are known to be usable."""
    try:
        validate_key(key)
    except DLockError as exc:
        raise UsageFailure(str(exc)) from None
    if command[0] != "--" and command[0].startswith("-"):  # a mistyped option, not a program
        raise UsageFailure(f"no such option: {command[0]} (put -- before the command)")
    words = command[1:] if command[:1] == ("--",) else command
    if not words:
        raise UsageFailure("no command: celery-dlock run KEY -- COMMAND ARGS...")
    return list(words)


def _take(env: Env, lock: Lock, once: bool) -> Lease | None:
    """The lease to run the command under; None when ``--once`` finds a success before.

    Raises:
        click.exceptions.Exit: the key stayed busy, Ctrl-C came, or the store failed.
    """
    key = lock.key
    try:
        if once and lock.last_success(RUN_TASK) is not None:
            env.echo(f"{key}: the command succeeded before (--once): not run again")
            return None
        lease = lock.acquire()
        if once and lock.last_success(RUN_TASK) is not None:  # succeeded while we waited
            lock.release(Outcome.SKIPPED, "once", "the command succeeded before (--once)")
            env.echo(f"{key}: the command succeeded before (--once): not run again")
            return None
    except LockNotAcquiredError as exc:
        waited = f" after {exc.wait:g} s" if isinstance(exc, LockTimeoutError) else ""
        held = f", held by {exc.holder}" if exc.holder else ""
        env.echo(f"{key} is busy{waited}{held}: the command was not run", err=True)
        with contextlib.suppress(DLockError):  # the history is a courtesy: 75 says it all
            lock.record_skip("locked", f"the command was not run: {exc}")
        raise click.exceptions.Exit(EXIT_BUSY) from None
    except KeyboardInterrupt:
        if lock.lease is not None:  # taken just as Ctrl-C came: given back at once
            with contextlib.suppress(DLockError):
                lock.release(Outcome.REVOKED, "SIGINT", "Ctrl-C before the command started")
        env.echo(f"{key}: interrupted before the command started; it was not run", err=True)
        raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
    except DLockError as exc:
        env.echo(f"the lock store failed: {exc}", err=True)
        raise click.exceptions.Exit(EXIT_STORE) from None
    return lease


def _run_holding(
    lock: Lock, lease: Lease, words: list[str], once: bool, guard: Guard, *, every: float | None
) -> int:
    """Run the command under ``lease``, reading it back every ``every`` seconds (None:
    never); release with its outcome; its exit code."""
    stopping: list[int] = []
    started: list[subprocess.Popen[bytes]] = []
    with _forwarding(lease.key, stopping, started):
        try:
            process = subprocess.Popen(
                words,
                stderr=subprocess.PIPE,
                env={**os.environ, "DLOCK_KEY": lease.key, "DLOCK_FENCE": str(lease.fence)},
                preexec_fn=_die_with(os.getpid()),  # noqa: PLW1509 - async-signal-safe calls
            )
        except OSError as exc:
            lock.release(Outcome.FAILED, type(exc).__name__, f"could not start {words[0]}: {exc}")
            click.echo(f"cannot run {shlex.join(words)}: {exc}", err=True)
            return 127 if isinstance(exc, FileNotFoundError) else 126  # as sh(1) does
        started.append(process)
        if stopping:  # came before the command existed: even a terminal's missed it
            process.send_signal(stopping[0])
        guard.started(process)
        tail = _Tail(process.stderr)  # type: ignore[arg-type]
        watch = Watch(lock.backend, lease, guard.lost, every)
        try:
            status = process.wait()
        finally:
            watch.stop()
            guard.ended()
            tail.finish()
    if guard.stopped:
        stopping.append(signal.SIGTERM)
    outcome, problem, details = _ending(status, stopping, tail.text(), guard.stopped)
    result = {"exit": status} if once and outcome is Outcome.SUCCEEDED else None
    try:
        lock.release(outcome, problem, details, result)
    except DLockError as exc:
        click.echo(f"could not record the end of {lease.key}: {exc}", err=True)
    return status if status >= 0 else 128 - status


@contextlib.contextmanager
def _forwarding(
    key: str, stopping: list[int], started: list[subprocess.Popen[bytes]]
) -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP noted in ``stopping`` and passed to the command once
    ``started`` holds it (not when the terminal sent them to its whole group)."""

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        name = signal.Signals(signum).name
        if _from_terminal(signum):
            say(f"{key}: {name} from the terminal: the command got it too")
        elif started:
            started[0].send_signal(signum)
            say(f"{key}: {name} passed to the command")

    # Installed before the command starts: a signal in between is not lost (nor a traceback).
    # One we were started ignoring stays ignored, for the command too (`nohup` ignores SIGHUP).
    previous = {
        number: signal.signal(number, forward)
        for number in _FORWARDED
        if signal.getsignal(number) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _from_terminal(signum: int) -> bool:
    """True for a SIGINT while we run in the foreground process group of our controlling
    terminal: a Ctrl-C there went to the whole group, the command included (it runs in
    ours), and passing it on would make it a second one."""
    if signum != signal.SIGINT:
        return False
    try:
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)  # fails without a terminal
    except OSError:
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(tty)


def _die_with(runner: int) -> Callable[[], None] | None:
    """What the command's child process runs before its ``exec`` (Linux): ask for SIGKILL
    when the runner dies, and die now if it already has. None elsewhere."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child
    except (OSError, AttributeError):
        return None

    def tie() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != runner:  # the runner died before the request took effect
            os._exit(1)

    return tie


def _ending(
    status: int, stopping: list[int], stderr: str, lost: bool = False
) -> tuple[Outcome, str | None, str]:
    why = "the runner lost its lease" if lost else ""
    # Stopped because its lease was lost: failed (no one told the runner to stop: revoked).
    told_to = Outcome.FAILED if lost else Outcome.REVOKED
    if stopping and status >= 0:  # it stopped on its own terms when told to: not a success
        told = why or f"the runner got {signal.Signals(stopping[0]).name}"
        return told_to, f"exit {status}", f"exit {status} ({told})"
    if status == 0:
        return Outcome.SUCCEEDED, None, "exit 0"
    if status < 0:
        name = signal.Signals(-status).name
        told = why or (f"the runner got {signal.Signals(stopping[0]).name}" if stopping else "")
        told = f" ({told})" if told else ""
        outcome = told_to if stopping or lost else Outcome.FAILED
        return outcome, f"signal {name}", f"ended by {name}{told}\n{stderr}".rstrip()
    return Outcome.FAILED, f"exit {status}", f"exit {status}\n{stderr}".rstrip()


class _Tail:
    """Copies the command's stderr to ours as it comes, keeping its last bytes, until the
    command exits; then what it wrote is in the pipe, and is read without waiting for the
    pipe's end (which a background child of the command may hold open for long)."""

    #: Reads after the command exits: a background child writing on does not hold us.
    DRAIN = 64

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._kept: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._copying = True
        self._wake, self._waker = os.pipe()
        self._thread = threading.Thread(target=self._copy, name="dlock-run-stderr", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        fd = self._stream.fileno()
        if os.name == "nt":  # no select() on pipes: read to the end (finish waits 5 s at most)
            for chunk in iter(lambda: os.read(fd, 65536), b""):
                self._keep(chunk)
            return
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            selector.register(self._wake, selectors.EVENT_READ)
            while True:
                ready = {key.fd for key, _ in selector.select()}
                if self._wake in ready:  # the command exited (checked first: see DRAIN)
                    self._drain(fd)
                    return
                chunk = os.read(fd, 65536)
                if not chunk:
                    return
                self._keep(chunk)

    def _drain(self, fd: int) -> None:
        os.set_blocking(fd, False)
        for _ in range(self.DRAIN):
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            self._keep(chunk)

    def _keep(self, chunk: bytes) -> None:
        if self._copying:
            try:
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()
            except OSError:  # our stderr's reader went away: keep reading, or the command blocks
                self._copying = False
        self._kept.append(chunk)
        self._size += len(chunk)
        while self._size - len(self._kept[0]) >= STDERR_TAIL:
            self._size -= len(self._kept.popleft())

    def finish(self) -> None:
        """Once the command has exited: copy what it wrote, and stop."""
        os.write(self._waker, b"x")
        self._thread.join(timeout=5 if os.name == "nt" else None)
        for fd in (self._wake, self._waker):
            os.close(fd)
        self._stream.close()

    def text(self) -> str:
        data = b"".join(self._kept)[-STDERR_TAIL:]
        return data.decode("utf-8", "replace")
