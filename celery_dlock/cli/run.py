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
is recorded ``lost``, naming how it ended.
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

from celery_dlock.backends.base import LockBackend
from celery_dlock.cli.env import EXIT_INTERRUPTED, Env, UsageFailure, guarded_creating
from celery_dlock.cli.render import DURATION
from celery_dlock.errors import DLockError, LockNotAcquiredError
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
#: Seconds between the SIGTERM and the SIGKILL of a command whose lease was lost, by default.
LOST_GRACE = 10.0
#: Seconds between the runner's reads of its own lease while the command runs.
WATCH_EVERY = 1.0
#: Bytes of the command's stderr kept for the record of a failure.
STDERR_TAIL = 4096
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: prctl(2): the signal a process gets when its parent thread dies.
_PR_SET_PDEATHSIG = 1


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("key")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--ttl", type=float, help="Lease seconds, renewed while the command runs.")
@click.option(
    "--wait", type=float, default=0.0, show_default=True, help="Seconds to wait for the key."
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
@guarded_creating
def run(
    env: Env,
    key: str,
    command: tuple[str, ...],
    *,
    ttl: float | None,
    wait: float,
    once: bool,
    lost_grace: float,
) -> None:
    """Run COMMAND holding the lock KEY (given in full, e.g. job:backup:nightly)."""
    words = _words(key, command)
    backend = env.backend
    if ttl is None and backend.capabilities.liveness == "lease" and backend.default_ttl is None:
        raise UsageFailure(
            f"the {backend.name} store frees a dead holder's key only when its lease "
            "expires: give --ttl SECONDS (renewed while the command runs)"
        )
    holder = Holder.current(task_name=RUN_TASK)
    guard = _Guard(lost_grace)
    lock = Lock(backend, key, ttl, wait, holder=holder, on_lost=guard.lost)
    lease = _take(env, lock, once)
    if lease is not None:
        raise click.exceptions.Exit(_run_holding(lock, lease, words, once, guard))


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
        env.echo(f"{key} is busy: {exc}", err=True)
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


def _run_holding(lock: Lock, lease: Lease, words: list[str], once: bool, guard: _Guard) -> int:
    """Run the command under ``lease``; release with its outcome; its exit code."""
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
        watch = _Watch(lock.backend, lease, guard.lost)
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
            _say(f"{key}: {name} from the terminal: the command got it too")
        elif started:
            started[0].send_signal(signum)
            _say(f"{key}: {name} passed to the command")

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


def _say(text: str) -> None:
    """A line on stderr from a signal handler: it may find stderr gone or mid-write."""
    with contextlib.suppress(OSError, RuntimeError):
        click.echo(text, err=True)


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
    if stopping and status >= 0:  # it stopped on its own terms when told to: not a success
        told = why or f"the runner got {signal.Signals(stopping[0]).name}"
        return Outcome.REVOKED, f"exit {status}", f"exit {status} ({told})"
    if status == 0:
        return Outcome.SUCCEEDED, None, "exit 0"
    if status < 0:
        name = signal.Signals(-status).name
        told = why or (f"the runner got {signal.Signals(stopping[0]).name}" if stopping else "")
        told = f" ({told})" if told else ""
        outcome = Outcome.REVOKED if stopping else Outcome.FAILED
        return outcome, f"signal {name}", f"ended by {name}{told}\n{stderr}".rstrip()
    return Outcome.FAILED, f"exit {status}", f"exit {status}\n{stderr}".rstrip()


class _Guard:
    """Stops the command when the lease is lost while it runs (``on_lost``, called from a
    renewal or session-watching thread): another holder may start it now. SIGTERM at once,
    SIGKILL after ``grace`` seconds if it is still running."""

    def __init__(self, grace: float = LOST_GRACE) -> None:
        self._grace = grace
        self._mutex = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._lost: Lease | None = None
        self._kill: threading.Timer | None = None
        #: True once the command was told to stop because the lease was lost.
        self.stopped = False

    def lost(self, lease: Lease) -> None:
        with self._mutex:
            self._lost = lease
            process = self._process
        if process is not None:
            self._stop(process, lease)

    def started(self, process: subprocess.Popen[bytes]) -> None:
        with self._mutex:
            self._process = process
            lease = self._lost
        if lease is not None:  # lost between the acquire and the start
            self._stop(process, lease)

    def _stop(self, process: subprocess.Popen[bytes], lease: Lease) -> None:
        with self._mutex:
            if self.stopped or process.returncode is not None:
                return
            self.stopped = True
            # Popen.send_signal does nothing once the command is reaped: the timer never
            # kills a pid reused by another process.
            kill = self._kill = threading.Timer(self._grace, process.send_signal, (signal.SIGKILL,))
            kill.daemon = True
        _say(
            f"error: the lease on {lease.key} (fence {lease.fence}) was lost while the command "
            f"runs: another holder may run now; stopping the command (SIGTERM, SIGKILL in "
            f"{self._grace:g} s)"
        )
        process.send_signal(signal.SIGTERM)
        kill.start()

    def ended(self) -> None:
        """The command exited: no SIGKILL after all (its pid may be another's soon)."""
        with self._mutex:
            self._process = None
            kill = self._kill
        if kill is not None:
            kill.cancel()


class _Watch:
    """Reads ``lease`` back every :data:`WATCH_EVERY` seconds while the command runs and
    calls ``lost(lease)`` once the key is free or another's. A forced release is otherwise
    learnt only by a store that watches its holders (Postgres sessions) or at the next
    renewal (every ttl/3: 20 s on Redis's default 60 s), and on the file store without a
    ttl never: the command ran on beside the next holder. A store that fails to answer is
    asked again; its renewal, if any, reports a lease that ran out."""

    def __init__(self, backend: LockBackend, lease: Lease, lost: Callable[[Lease], None]) -> None:
        self._backend = backend
        self._lease = lease
        self._lost = lost
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dlock-run-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        token = self._lease.token
        while not self._stopped.wait(WATCH_EVERY):
            try:
                current = self._backend.get(self._lease.key)
            except DLockError:
                continue
            if current is None or current.token != token:
                if not self._stopped.is_set():  # not the runner's own release
                    self._lost(self._lease)
                return

    def stop(self) -> None:
        """The command exited: stop watching before the lease is released. Not joined: a
        read under way may wait for a slow store, and what it finds then is ignored (the
        guard stops no command that has exited)."""
        self._stopped.set()


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
