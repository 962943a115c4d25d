"""Connections of the Postgres backend: this process's lock session and its waiter
connections.

The lock session is one autocommit connection per process, shared by its threads under a
mutex, never pooled: the advisory locks that keep its leases alive belong to it. ``wait()``
blocks on separate waiter connections (a small per-process set), so other threads can still
acquire and release while one waits. A thread whose wait returned keeps its waiter connection,
and with it its place at the head of the key's queue, until its next call (see ``Client``).
After ``fork`` a child never touches its parent's connections: their sockets are swapped for
``/dev/null`` in the child, so neither a close nor a garbage collection there can end the
parent's session.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from celery_dlock.backends.base import Place
from celery_dlock.backends.common import weakly
from celery_dlock.backends.postgres.config import Config, translate
from celery_dlock.backends.postgres.ended import connection_lost, end_notice, has_ended
from celery_dlock.backends.postgres.migration import migrate
from celery_dlock.backends.postgres.pooling import opened, pooled
from celery_dlock.backends.postgres.prepared import PreparedStatements
from celery_dlock.backends.postgres.statements import HANDED_OVER, Statements
from celery_dlock.errors import ConfigurationError
from celery_dlock.events import fields
from celery_dlock.records import Lease

__all__ = [
    "SWEEP_EVERY", "WATCH_EVERY", "Client", "Session", "migrate", "missing_tables", "pooled",
    "restore_guard", "tell_lost",
]  # fmt: skip

#: Seconds after a release during which a process lets waiters of the key go first.
_POLITE_FOR = 1.0
_POLITE_KEYS = 1024
#: Seconds an idle background thread of ``end_wait_later`` lingers before it ends.
_LEAVER_IDLE = 5.0
#: Seconds between two looks at the lock session by the watcher of leases without a ttl.
WATCH_EVERY = 1.0
#: Seconds between sweeps of the advisory locks a session holds (``Client.sweep``).
SWEEP_EVERY = 1.0

logger = logging.getLogger("celery_dlock.postgres")


def missing_tables(config: Config) -> ConfigurationError:
    """The error for a store whose tables are not there (and ``auto_migrate`` is off)."""
    return ConfigurationError(
        f"the celery_dlock tables are missing in schema {config.statements.names.schema!r}: "
        f"call the backend's migrate() (or `celery-dlock migrate`, `celery dlock migrate`), "
        f"or add auto_migrate=1 to the URL [{config.url}]"
    )


def tell_lost(ended: list[tuple[Lease, Callable[[Lease], None]]]) -> None:
    """Call each watcher's ``on_lost`` with its lease, which died with its session."""
    for lease, on_lost in ended:
        try:
            on_lost(lease)
        except Exception:
            extra = fields("on_lost_failed", lease)
            logger.exception("on_lost callback for %s failed", lease.key, extra=extra)


class Session:
    """One open lock session: its connection, backend pid and the fences it holds."""

    __slots__ = ("conn", "cursor", "held", "notice", "pid", "prepare", "prepared", "swept")

    def __init__(self, conn: psycopg.Connection[Any], pid: int, prepare: bool = True) -> None:
        self.conn = conn
        self.notice = end_notice(conn)  #: whether the server said it ends the session
        self.cursor = conn.cursor(binary=True)
        #: The backend pid the session's leases name: 0 (``HANDED_OVER``) with
        #: ``liveness=ttl``, whose statements may each run on another server connection.
        self.pid = pid
        #: Whether statements are prepared on the server (not through a pooler).
        self.prepare = prepare
        #: fence -> key of every lease whose advisory lock this session holds.
        self.held: dict[int, str] = {}
        #: ``time.monotonic()`` of the last sweep of ``held``.
        self.swept = 0.0
        self.prepared = PreparedStatements(conn)

    def one(self, statement: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The first row of ``statement`` (psycopg's ``%(name)s`` placeholders), or None:
        the hot path of every acquire and release (see ``prepared``)."""
        if self.prepare:
            return self.prepared.one(statement, params)
        self.cursor.execute(statement, params, prepare=False)
        return self.cursor.fetchone()


class Client:
    """This process's connections to one store. Lives as long as the backend, per process.

    Waiter connections are checked out for a wait and stay with the waiter as its place in
    the key's queue (``Queued``) until it acquires or gives up.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.mutex = threading.Lock()
        self.session: Session | None = None
        #: Fences of leases lost (session ended; watched, then swept): release, renew give None.
        self.lost: set[int] = set()
        #: key -> ``time.monotonic()`` until which this process lets the key's waiters go first.
        self.polite: dict[str, float] = {}
        self._waiter_mutex = threading.Lock()
        self._idle_waiters: list[psycopg.Connection[Any]] = []
        self._open_waiters: set[psycopg.Connection[Any]] = set()
        self._opening = 0
        self._leaving: queue.SimpleQueue[psycopg.Connection[Any]] = queue.SimpleQueue()
        self._leaver: threading.Thread | None = None
        self._watched: dict[int, tuple[Lease, Callable[[Lease], None]]] = {}
        self._watch_mutex = threading.Lock()
        self._watcher: threading.Thread | None = None

    # -- the lock session (callers hold ``mutex``) -------------------------------------

    def open(self) -> Session:
        """The lock session, opened (and checked) if there is none, or if the server ended
        it while it held nothing (a restart, a failover: what there is to read tells, with no
        round trip). One that held leases is left to fail its next statement, so that its
        callers find them lost."""
        if self.session is not None:
            if not self.session.held:
                self._look()
            if self.session is not None:
                return self.session
        config, statements = self.config, self.config.statements
        conn = config.connect("lock")
        try:
            row = conn.execute(statements.open).fetchone()
            assert row is not None
            pid, ready = opened(config, row), bool(row[1])
            if not ready:
                if not config.auto_migrate:
                    raise missing_tables(config)
                migrate(config)
            # A second transaction: on a transaction-mode pooler it may run on another
            # server connection, where our session advisory locks would not be.
            row = conn.execute(statements.check).fetchone()
            assert row is not None
            if config.liveness == "ttl":
                pid = HANDED_OVER  # no session stands for a lease
            elif int(row[0]) != pid:
                raise pooled(config, pid, int(row[0]))
            if not row[1]:
                restore_guard(conn, statements)
        except psycopg.Error as exc:
            _close_quietly(conn)
            raise translate(exc, "opening the lock session", config.url) from exc
        except BaseException:
            _close_quietly(conn)
            raise
        self.session = Session(conn, pid, prepare=config.liveness == "session")
        return self.session

    def drop(self) -> None:
        """Forget the lock session after it ended: all its leases are lost."""
        session, self.session = self.session, None
        if session is not None:
            self.lost.update(session.held)
            _close_quietly(session.conn)

    def sweep(self, session: Session) -> None:
        """Let go of the advisory locks of leases gone elsewhere (caller holds ``mutex``)."""
        params = {"fences": list(session.held), "keys": list(session.held.values())}
        session.cursor.execute(self.config.statements.sweep, params, prepare=True)
        gone = {int(row[0]) for row in session.cursor.fetchall()}
        with self._watch_mutex:  # lost if watched; others (kept for a retry) are not ours
            self.lost.update(gone.intersection(self._watched))
        session.held = {fence: key for fence, key in session.held.items() if fence not in gone}
        session.swept = time.monotonic()

    # -- watching the leases held by the lock session -----------------------------------------

    def watch(self, lease: Lease, on_lost: Callable[[Lease], None]) -> Callable[[], None]:
        """Call ``on_lost(lease)`` once if ``lease`` is lost while watched: every
        :data:`WATCH_EVERY` seconds a thread looks whether the lock session ended (no round
        trip) and sweeps it (``_sweep_watched``). Returns the function that stops watching."""
        fence = lease.fence
        with self._watch_mutex:
            self._watched[fence] = (lease, weakly(on_lost))
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=self._watch, name="celery_dlock session watcher", daemon=True
                )
                self._watcher.start()

        def stop() -> None:
            with self._watch_mutex:
                self._watched.pop(fence, None)

        return stop

    def _watch(self) -> None:
        """The watcher thread; it ends when a look finds nothing left to watch."""
        while True:
            time.sleep(WATCH_EVERY)
            with self.mutex:
                self._look()
                self._sweep_watched()
                lost = set(self.lost)
            with self._watch_mutex:
                ended = [self._watched.pop(f) for f in list(self._watched) if f in lost]
                idle = not self._watched
                if idle:
                    self._watcher = None
            tell_lost(ended)
            if idle:
                return

    def _look(self) -> None:
        """Drop the lock session if the server ended it or its socket did (caller holds
        ``mutex``, so no statement is under way and anything to read is unasked for)."""
        session = self.session
        if session is not None and has_ended(session.conn, session.notice):
            extra = fields("session_ended", backend=self.config.url)
            logger.warning("the lock session (backend pid %d) ended", session.pid, extra=extra)
            self.drop()

    def _sweep_watched(self) -> None:
        """Sweep the lock session (caller holds ``mutex``) while it holds a watched lease
        without a ttl, so that an idle holder sees it force-released or ended elsewhere: a
        round trip a second while there is one (none when an acquire just swept)."""
        session = self.session
        if session is None or time.monotonic() - session.swept < SWEEP_EVERY / 2:
            return
        with self._watch_mutex:
            untimed = [held.fence for held, _ in self._watched.values() if held.expires_at is None]
        if session.held.keys().isdisjoint(untimed):
            return
        try:
            self.sweep(session)
        except psycopg.Error as exc:
            if connection_lost(exc, session.conn):
                self.drop()  # its leases are lost, and reported so
            extra = fields("sweep_failed", backend=self.config.url)
            logger.warning("sweeping the lock session failed: %s", exc, extra=extra)

    # -- waiters ---------------------------------------------------------------------------

    def yield_to_waiters(self, key: str) -> None:
        """After releasing ``key`` while others waited for it: for a moment, acquire it only
        if no waiter is first in its queue."""
        if len(self.polite) > _POLITE_KEYS:
            self.polite.clear()
        self.polite[key] = time.monotonic() + _POLITE_FOR

    def yielding(self, key: str) -> bool:
        until = self.polite.get(key)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        self.polite.pop(key, None)
        return False

    def place(self, key: str, conn: psycopg.Connection[Any]) -> Queued:
        """A waiter's place: ``conn``, whose wait for ``key`` returned, stays in its queue."""
        return Queued(key, conn, self)

    def end_wait_later(self, conn: psycopg.Connection[Any]) -> None:
        """``end_wait`` from a background thread: the caller does not wait for the round trip
        (an acquire that came through the queue lets the next waiter move up meanwhile)."""
        with self._waiter_mutex:
            self._leaving.put(conn)
            if self._leaver is None:
                self._leaver = threading.Thread(
                    target=self._leave, name="celery_dlock waiters", daemon=True
                )
                self._leaver.start()

    def _leave(self) -> None:
        """The background thread of ``end_wait_later``; it ends when idle for a while."""
        while True:
            try:
                conn = self._leaving.get(timeout=_LEAVER_IDLE)
            except queue.Empty:
                with self._waiter_mutex:
                    if self._leaving.empty():
                        self._leaver = None
                        return
                continue
            self.end_wait(conn)

    def end_wait(self, conn: psycopg.Connection[Any]) -> None:
        """Let the next waiter in (``conn`` leaves its queue) and check ``conn`` in."""
        try:
            conn.execute(self.config.statements.leave_queue)
        except psycopg.Error:
            _close_quietly(conn)
        self.check_in(conn)

    def check_out(self) -> psycopg.Connection[Any] | None:
        """An idle waiter connection, a new one, or None when ``max_waiters`` are busy.

        Raises:
            BackendError: a new connection could not be opened.
        """
        with self._waiter_mutex:
            if self._idle_waiters:
                return self._idle_waiters.pop()
            if len(self._open_waiters) + self._opening >= self.config.max_waiters:
                return None
            self._opening += 1
        conn = None
        try:
            conn = self.config.connect("waiter")
        finally:
            with self._waiter_mutex:
                self._opening -= 1
                if conn is not None:
                    self._open_waiters.add(conn)
        return conn

    def check_in(self, conn: psycopg.Connection[Any]) -> None:
        with self._waiter_mutex:
            if conn.closed or conn.broken or conn not in self._open_waiters:
                self._open_waiters.discard(conn)
                _close_quietly(conn)
            else:
                self._idle_waiters.append(conn)

    # -- ending ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close this process's connections; leases of the lock session are lost, and
        waits under way in other threads fail."""
        with self.mutex:
            self.drop()
        with self._waiter_mutex:
            for conn in self._open_waiters:
                _close_quietly(conn)
            self._idle_waiters.clear()
            self._open_waiters.clear()

    def forget_inherited(self) -> None:
        """In a forked child, on the parent's client: let go of the parent's connections
        without touching them (the child makes its own client)."""
        conns = list(self._open_waiters)
        if self.session is not None:
            conns.append(self.session.conn)
        for conn in conns:
            _detach(conn)
        self.session = None
        self._idle_waiters = []
        self._open_waiters = set()
        self._waiter_mutex = threading.Lock()
        self._watched = {}
        self._watch_mutex = threading.Lock()
        self._watcher = None


class Queued(Place):
    """A waiter connection in the queue of ``key`` whose wait returned: its session still
    holds the key's queue lock, so the waiters behind it sleep on instead of waking with it.
    The connection holds no transaction and no table lock. Left (``leave``, or when
    collected: a caller that drops it must not keep its place for ever) it leaves the
    queue and goes back to the client's idle waiters; used up by an acquire (``hand_on``)
    it leaves from a background thread, so that the next waiter moves up to wait on the new
    holder, inside the server, while the acquirer goes on."""

    __slots__ = ("_client", "_leave", "conn", "key")

    def __init__(self, key: str, conn: psycopg.Connection[Any], client: Client) -> None:
        self.key = key
        self.conn = conn
        self._client = client
        self._leave = weakref.finalize(self, client.end_wait, conn)

    @property
    def held(self) -> bool:
        return self._leave.alive

    def leave(self) -> None:
        self._leave()

    def hand_on(self) -> None:
        """Used up by an acquire of the key: leave the queue from a background thread."""
        if self._leave.detach() is not None:
            self._client.end_wait_later(self.conn)


def restore_guard(conn: psycopg.Connection[Any], statements: Statements) -> None:
    """Move the fence sequence past fences a lost WAL may give again; mark the guard."""
    with conn.transaction():
        for statement in statements.restore_guard:
            conn.execute(statement)


def _close_quietly(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(Exception):
        conn.close()


#: Connections inherited from a parent process, kept referenced so that they are never
#: garbage collected (psycopg would warn) in the child.
_INHERITED: list[psycopg.Connection[Any]] = []


def _detach(conn: psycopg.Connection[Any]) -> None:
    """Point ``conn``'s socket descriptor at /dev/null in this (child) process only."""
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:
        fd = -1
    if fd >= 0:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.dup2(null, fd, inheritable=False)
        finally:
            os.close(null)
    _INHERITED.append(conn)
