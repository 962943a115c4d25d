"""The Postgres backend's implementation, shared by both ways a lease stays alive: see
:mod:`celery_dlock.backends.postgres` for the URL, the options and the guarantees, and
``PostgresBackend`` (session liveness) and ``PostgresTTLBackend`` (``liveness=ttl``) there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.types.numeric import Int8

from celery_dlock.backends.base import (
    Check,
    LockBackend,
    Place,
    hand_over_ttl,
    remembered,
    success_task,
    validate_ttl,
)
from celery_dlock.backends.common import ProcessLocal, retried_details
from celery_dlock.backends.postgres import doctor, rows, transactional, waiting
from celery_dlock.backends.postgres.aio import AsyncPostgres
from celery_dlock.backends.postgres.calls import Release
from celery_dlock.backends.postgres.config import parse_url
from celery_dlock.backends.postgres.recovery import (
    SessionEnded,
    refuse,
    resolve_release,
    undo_acquire,
    using_session,
)
from celery_dlock.backends.postgres.session import (
    SWEEP_EVERY,
    Client,
    Queued,
    Session,
    migrate,
    restore_guard,
)
from celery_dlock.errors import AlreadySucceededError
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token

__all__ = ["PostgresStore"]

_PRUNE_BATCH = 10_000


class PostgresStore(LockBackend):
    """Locks in a PostgreSQL table; how a lease stays alive is the subclass's
    (``capabilities.liveness``) and the URL's ``liveness``. Makes no connection until
    first used."""

    name = "postgres"

    def __init__(self, url: str, **options: Any) -> None:
        self._config = parse_url(url, options)
        self.url = self._config.url
        self.schema = self._config.statements.names.schema
        self._sql = self._config.statements
        self._clients: ProcessLocal[Client] = ProcessLocal(
            lambda: Client(self._config), forget=Client.forget_inherited
        )
        self._holder_cache: tuple[Holder, str] | None = None
        self._async: AsyncPostgres | None = None
        self._async_made = threading.Lock()  # two loops' threads may ask at once

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresStore:
        return cls(url, **options)

    def migrate(self) -> str:
        """Create the schema, sequence, tables and indexes if missing (idempotent; safe to
        run from several processes at once). Needs CREATE rights on the database. Returns
        what it did: ``created``, ``upgraded from schema version N``, ``completed`` (parts
        were missing) or ``up to date``.

        Raises:
            BackendError: the server failed or refused.
        """
        return migrate(self._config)

    # -- acquire and release -------------------------------------------------------------

    def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None:
        ttl = validate_ttl(ttl)
        params: dict[str, Any] = {"key": key, "token": new_token(), "ttl": ttl}
        params |= {"holder": self._holder_json(holder), "replace": replace}
        client = self._clients.get()
        queued = Queued.of(place, key)
        # A process that has just released a key for which others wait lets the first of
        # them have it, instead of taking it straight back (see ``release``).
        polite = queued is None and replace is None and client.yielding(key)
        try:
            with client.mutex:
                row = self._acquire(client, holder, params, polite=polite)
        except BaseException:
            if queued is not None:
                queued.leave()
            raise
        if queued is not None and row is not None:
            queued.hand_on()  # the next waiter now queues on us, server-side
        if row is None:
            return None
        return Lease(key, params["token"], row[0], holder, row[1], row[2])

    def _acquire(
        self, client: Client, holder: Holder, params: dict[str, Any], *, polite: bool
    ) -> Any:
        """One attempt under the session mutex: (fence, acquired_at, expires_at) or None."""
        try:
            with using_session(client, self.url, "acquire") as session:
                if session.held and time.monotonic() - session.swept > SWEEP_EVERY:
                    client.sweep(session)
                try:
                    row = self._grant(session, holder, params, polite=polite)
                except psycopg.errors.NotNullViolation:
                    # No fence while the guard is gone (``Statements.next_fence``): a crash,
                    # or a failover to a standby, whose sequence may be behind fences given
                    # out, under a session that outlived it (behind a pooler). Move the
                    # sequence past them, as a new session does, and try again.
                    restore_guard(session.conn, self._sql)
                    row = self._grant(session, holder, params, polite=polite)
        except SessionEnded as ended:
            raise undo_acquire(client, params, ended, self.url) from ended.__cause__
        if row is None:
            return None
        fence = int(row[0])
        if not row[3] or row[4] != session.pid:
            raise refuse(client, params, fence, session.pid, int(row[4]))
        if self.capabilities.liveness == "session":
            session.held[fence] = params["key"]  # its advisory lock is the session's
        return (fence, row[1], row[2])

    def _grant(
        self, session: Session, holder: Holder, params: dict[str, Any], *, polite: bool
    ) -> Any:
        statement = self._sql.acquire_politely if polite else self._sql.acquire
        row = session.one(statement, params)
        if row is None and not polite:  # held: take over if its holder is gone or replaced
            row = self._take_over(session, holder, params)
        return row  # None: held, or (polite) left to a waiter: either way, not now

    def _take_over(self, session: Session, holder: Holder, params: dict[str, Any]) -> Any:
        """Take the key from a holder that is gone, expired or being replaced by its retry,
        recording the old lease in the same statement; None while its holder lives."""
        params["retried"] = retried_details(holder)
        params["held"] = list(session.held)
        return rows.took_over(session.one(self._sql.take_over, params), session.held)

    def watch(self, lease: Lease, on_lost: Callable[[Lease], None]) -> Callable[[], None] | None:
        """Report ``lease`` lost within about a second if the lock session that holds it (this
        process's, or a loop's asyncio one) ends while it is held (server restart,
        ``pg_terminate_backend``, a broken connection)."""
        if self._async is not None and self._async.holds(lease.fence):
            return self._async.watch(lease, on_lost)
        return self._clients.get().watch(lease, on_lost)

    def async_store(self) -> AsyncPostgres | None:
        """The asyncio client of this backend: a lock session per event loop, on psycopg's
        ``AsyncConnection``, with this backend's statements and liveness."""
        with self._async_made:
            if self._async is None:
                self._async = AsyncPostgres(self._config, self._clients, self._holder_json)
        return self._async

    def release(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None:
        call = Release(self._sql, lease, outcome, problem=problem, details=details, result=result)
        client = self._clients.get()
        with client.mutex:
            row = self._release(client, lease, call)
        if row is None or isinstance(row, Record):
            return row
        if row[5]:
            client.yield_to_waiters(lease.key)
        return call.record(row)

    def _release(self, client: Client, lease: Lease, call: Release) -> Any:
        """The release statement under the session mutex: its row, a record read back after
        the session ended under it, or None."""
        if lease.fence in client.lost:
            client.lost.discard(lease.fence)
            return None
        try:
            with using_session(client, self.url, "release") as session:
                call.params["unlock"] = unlock = lease.fence in session.held
                row = session.one(call.statement, call.params)
                if row is None and unlock:  # not ours any more, but its lock still is
                    session.one(self._sql.unlock, {"fence": lease.fence})
        except SessionEnded as ended:
            return resolve_release(client, lease, call.outcome, ended, call)
        if unlock:
            session.held.pop(lease.fence, None)
        return row

    def add_record(self, record: Record) -> None:
        outcome = Outcome(record.outcome)
        success = remembered(outcome, record.result, record.lease.holder.task_name) is not None
        statement = self._sql.add_record_success if success else self._sql.add_record
        self._write(
            statement,
            self._params(record),
            "add_record",
        )

    def remember(self, record: Record) -> bool:
        params = self._params(record)
        params["task_name"] = success_task(record)
        return self._write(self._sql.remember, params, "remember") == 1

    def record_success(self, connection: Any, record: Record) -> None:
        """Keep ``record`` as the ``once`` success of its key and task inside the caller's
        own transaction on ``connection`` (psycopg 3 or psycopg2 connection or cursor, or a
        SQLAlchemy ``Session``/``Connection``), so that it commits or rolls back with the
        caller's writes. Nothing is committed here.

        Raises:
            AlreadySucceededError: a success is kept already (the caller's transaction must
                roll back: its effect would be a second one).
            ConfigurationError: ``connection`` does not reach this store's tables.
        """
        params = self._params(record)
        params["task_name"] = success_task(record)
        params["fence"] = record.lease.fence
        tables = f"the tables of schema {self.schema!r} of the lock store [{self.url}]"
        kept = transactional.execute(connection, self._sql.record_success, params, tables)
        if not kept:
            winner = self.last_success(record.key, params["task_name"])
            fence = -1 if winner is None else winner.lease.fence
            task_id = None if winner is None else winner.lease.holder.task_id
            raise AlreadySucceededError(record.key, params["task_name"], fence, task_id)

    def _params(self, record: Record) -> dict[str, Any]:
        return rows.record_params(record, self._holder_json(record.lease.holder))

    def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        ttl = validate_ttl(ttl)
        params = {"key": lease.key, "token": lease.token, "ttl": ttl}
        client = self._clients.get()
        with client.mutex:
            if lease.fence in client.lost:
                return None
            try:
                with using_session(client, self.url, "renew") as session:
                    row = session.one(self._sql.renew, params)
            except SessionEnded:
                if self._config.liveness == "session":
                    return None  # whatever landed, the lease died with the session
                raise  # a ttl lease lives on, renewed or not: the renewer tries again
        if row is None:
            return None
        return Lease(lease.key, lease.token, lease.fence, lease.holder, row[0], row[1])

    def hand_over(self, lease: Lease, ttl: float, if_unchanged: bool = False) -> Lease | None:
        """Keep ``lease`` alive by its ttl alone: its row no longer names a session and this
        session lets go of its advisory lock, so the lease outlives this process."""
        seconds = hand_over_ttl(ttl)
        params = {
            "key": lease.key,
            "token": lease.token,
            "ttl": seconds,
            "if_unchanged": if_unchanged,
            "seen": lease.expires_at,
        }
        client = self._clients.get()
        with client.mutex:
            if lease.fence in client.lost:
                return None
            try:
                with using_session(client, self.url, "hand_over") as session:
                    params["unlock"] = unlock = lease.fence in session.held
                    row = session.one(self._sql.hand_over, params)
                    if row is None and unlock:  # not ours any more, but its lock still is
                        session.one(self._sql.unlock, {"fence": lease.fence})
            except SessionEnded:
                if self._config.liveness == "session":
                    return None  # the lease died with the session
                with using_session(client, self.url, "hand_over") as session:  # it lives on
                    row = session.one(self._sql.hand_over, {**params, "unlock": False})
            session.held.pop(lease.fence, None)
        if row is None:
            return None
        return Lease(lease.key, lease.token, lease.fence, lease.holder, row[0], row[1])

    # -- reading -----------------------------------------------------------------------------

    def get(self, key: str) -> Lease | None:
        found = self._read(self._sql.get, {"key": key}, "get")
        return rows.lease(found[0]) if found else None

    def leases(self, prefix: str = "") -> list[Lease]:
        return [rows.lease(r) for r in self._read(self._sql.leases, {"prefix": prefix}, "leases")]

    def history(
        self,
        key: str | None = None,
        outcome: Outcome | None = None,
        since: float | None = None,
        limit: int | None = 100,
    ) -> list[Record]:
        since_at = None if since is None else rows.timestamp(since)
        outcome_text = None if outcome is None else Outcome(outcome).value
        statement, params = self._sql.history_of(key, outcome_text, since_at, limit)
        return [rows.record(r) for r in self._read(statement, params, "history")]

    def last_success(self, key: str, task_name: str) -> Record | None:
        params = {"key": key, "task_name": task_name}
        found = self._read(self._sql.last_success, params, "last_success")
        return rows.record(found[0]) if found else None

    # -- janitor and operator ------------------------------------------------------------------

    def forget_success(self, key: str, task_name: str, token: str) -> bool:
        params = {"key": key, "task_name": task_name, "token": token}
        return self._write(self._sql.forget_success, params, "forget_success") == 1

    def reap(self, limit: int = 100) -> list[Record]:
        return self._clear(self._sql.reap, {"limit": Int8(limit)}, "reap")

    def _clear(self, statement: str, params: dict[str, Any], what: str) -> list[Record]:
        """Run a statement that clears leases and returns their records (+ an unlock column)."""
        client = self._clients.get()
        with client.mutex, using_session(client, self.url, what) as session:
            params["held"] = list(session.held)
            session.cursor.execute(statement, params, prepare=session.prepare)
            found = session.cursor.fetchall()
            for row in found:
                if row[-1] is not None:
                    session.held.pop(int(row[2]), None)
        return [rows.record(row) for row in found]

    def prune_history(self, before: float) -> int:
        if before <= 0:  # nothing was released before 1970 (and year 1 is a timestamp's end)
            return 0
        params = {"before": rows.timestamp(before), "batch": Int8(_PRUNE_BATCH)}
        pruned = 0
        while True:
            deleted = self._write(self._sql.prune, params, "prune_history")
            pruned += deleted
            if deleted < _PRUNE_BATCH:
                return pruned

    def _write(self, statement: str, params: dict[str, Any], what: str) -> int:
        """Run a statement on the lock session; the number of rows it changed."""
        client = self._clients.get()
        with client.mutex, using_session(client, self.url, what) as session:
            session.cursor.execute(statement, params, prepare=session.prepare)
            return session.cursor.rowcount

    # -- waiting -------------------------------------------------------------------------

    def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None:
        """Block until ``key``'s holder lets go (or is gone, or its lease expires), at most
        ``timeout`` seconds, woken by the server; see :func:`waiting.wait`."""
        client = self._clients.get()
        return waiting.wait(client, self._sql, self.url, key=key, timeout=timeout, place=place)

    def wait_any(self, keys: Sequence[str], timeout: float) -> None:
        """Wait for any of ``keys``, at most ``timeout`` seconds: the keys take turns of
        ``waiting.ANY_SLICE`` each; see :func:`waiting.wait_any`."""
        waiting.wait_any(self.wait, keys, timeout)

    # -- the process's connections -------------------------------------------------------

    def close(self) -> None:
        """Close this process's connections (the asyncio client's by a task of each loop).
        Leases held through them are lost."""
        self._clients.get().close()
        if self._async is not None:
            self._async.close()

    def server_time(self) -> float:
        return float(self._read(doctor.SERVER_TIME, {}, "server_time")[0][0])

    def diagnose(self) -> list[Check]:
        """Version, schema, pooler, connections: see :mod:`.doctor`."""
        return doctor.checks(self._config, self.capabilities.liveness)

    def session_info(self) -> dict[str, Any]:
        """The lock session's backend pid and settings (keepalives, commit mode, timeouts),
        for ``celery dlock doctor`` and tests."""
        names = [
            "lock_timeout",
            "statement_timeout",
            "synchronous_commit",
            "idle_session_timeout",
            "idle_in_transaction_session_timeout",
            "tcp_keepalives_idle",
            "tcp_keepalives_interval",
            "tcp_keepalives_count",
            "tcp_user_timeout",
            "server_version_num",
        ]
        found = self._read(self._sql.settings, {"names": names}, "session_info")
        return {str(row[0]): row[1] for row in found}

    def _read(self, statement: str, params: dict[str, Any], what: str) -> list[Any]:
        """Rows of a read-only statement; tried again on a new session if the old one ended."""
        client = self._clients.get()
        with client.mutex:
            for attempt in (1, 2):
                try:
                    with using_session(client, self.url, what) as session:
                        session.cursor.execute(statement, params, prepare=session.prepare)
                        return session.cursor.fetchall()
                except SessionEnded:
                    if attempt == 2:
                        raise
        raise AssertionError("unreachable")

    def _holder_json(self, holder: Holder) -> str:
        cached = self._holder_cache
        if cached is not None and cached[0] is holder:
            return cached[1]
        text = holder.to_json()
        self._holder_cache = (holder, text)
        return text
