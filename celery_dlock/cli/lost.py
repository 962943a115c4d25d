"""A lease lost while ``celery-dlock run``'s command runs: how the runner learns it
(:class:`Watch`, and the store's own reports) and stops the command (:class:`Guard`).

The runner learns of a loss from whichever comes first: the Postgres lock session's watcher
(a lease without a ttl: the session ended, or a sweep found the lease force-released, within
about a second), a renewal (every ttl/3) that finds the lease gone, or its own reads of the
lease (``--watch``). The reads are chosen per store by :func:`watch_every`: once a second
where a read is cheap (Redis, the file store, memory, Postgres with a ttl), every 10 s on an
object store (S3, GCS bill each request, and a read takes tens of ms), none where the store
reports the loss as soon as a read would.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Callable

import click

from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.objectstore import ObjectStoreBackend
from celery_dlock.errors import DLockError
from celery_dlock.lock import Lock
from celery_dlock.records import Lease

__all__ = [
    "LOST_GRACE", "WATCH_EVERY", "WATCH_LEAST", "WATCH_OBJECT_STORE", "Guard", "Watch", "say",
    "watch_every",
]  # fmt: skip

#: Seconds between the SIGTERM and the SIGKILL of a command whose lease was lost, by default.
LOST_GRACE = 10.0
#: Seconds between the runner's reads of its own lease while the command runs, by default.
WATCH_EVERY = 1.0
#: The same on an object store (S3, GCS), which bills each request: 8,640 reads a day for a
#: command that runs all day (86,400 at :data:`WATCH_EVERY`), at tens of ms each.
WATCH_OBJECT_STORE = 10.0
#: The shortest ``--watch``: shorter, the runner would keep the store busy for little.
WATCH_LEAST = 0.1


def say(text: str) -> None:
    """A line on stderr from a signal handler or a thread: it may find stderr gone or
    mid-write."""
    with contextlib.suppress(OSError, RuntimeError):
        click.echo(text, err=True)


def default_watch(backend: LockBackend) -> float:
    """Seconds between reads of a lease on ``backend`` when ``--watch`` is not given."""
    return WATCH_OBJECT_STORE if isinstance(backend, ObjectStoreBackend) else WATCH_EVERY


def watch_every(lock: Lock, watch: float | None) -> float | None:
    """Seconds between the runner's reads of its lease on ``lock`` (``watch``, or the store's
    default), or None when a read would learn of a loss no sooner than the store reports it:

    - a lease without a ttl on a store whose liveness is a session (Postgres): the lock
      session's watcher sweeps it once a second, one round trip, and reports it lost
      (``on_lost``) when it was force-released or the session ended;
    - a renewal due at least as often (every ttl/3): each renewal finds a lease gone.
    """
    backend = lock.backend
    if lock.ttl is None and backend.capabilities.liveness == "session":
        return None
    every = default_watch(backend) if watch is None else watch
    if lock.renew_in_background and lock.ttl is not None and lock.ttl / 3 <= every:
        return None
    return every


class Guard:
    """Stops the command when the lease is lost while it runs (``on_lost``, called from a
    renewal, session-watching or :class:`Watch` thread): another holder may start it now.
    SIGTERM at once, SIGKILL after ``grace`` seconds if it is still running."""

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
        say(
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


class Watch:
    """Reads ``lease`` back every ``every`` seconds (:func:`watch_every`; None: never) while
    the command runs and calls ``lost(lease)`` once the key is free or another's. A forced
    release is otherwise learnt only by a store that watches its holders (Postgres sessions)
    or at the next renewal (every ttl/3: 20 s on Redis's default 60 s), and on the file store
    without a ttl never: the command ran on beside the next holder. A store that fails to
    answer is asked again; its renewal, if any, reports a lease that ran out."""

    def __init__(
        self,
        backend: LockBackend,
        lease: Lease,
        lost: Callable[[Lease], None],
        every: float | None,
    ) -> None:
        self._backend = backend
        self._lease = lease
        self._lost = lost
        self._stopped = threading.Event()
        if every is not None:
            thread = threading.Thread(
                target=self._watch, args=(every,), name="dlock-run-watch", daemon=True
            )
            thread.start()

    def _watch(self, every: float) -> None:
        token = self._lease.token
        while not self._stopped.wait(every):
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
