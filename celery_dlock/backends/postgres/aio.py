"""The Postgres backend's asyncio client: a lock's calls on psycopg's ``AsyncConnection``,
for :class:`~celery_dlock.AsyncLock`.

Each event loop has a lock session of its own (one autocommit connection, its statements
in turn under an ``asyncio.Lock``): the advisory locks that keep its leases alive belong to
it, as the blocking lock session's belong to that one, and the same statements, rows and
liveness apply. A waiter waits on a waiter connection of the loop (the key's queue, first
come first served, woken by the server). A watcher task reports the leases of a session
that ended, or that a sweep finds ended elsewhere. The loop's connections close with it.

What is the blocking client's is used, not repeated: statements, rows (:mod:`.calls`,
:mod:`.rows`), the checks when a session opens, the politeness to the waiters of a key
just released. A statement cancelled by the caller is cancelled on the server (psycopg);
a cancelled waiter leaves its queue before the cancel is raised (:mod:`.aplace`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import psycopg

from celery_dlock.backends.base import Place, validate_ttl
from celery_dlock.backends.common import (
    LoopLocal,
    LoopOwned,
    ProcessLocal,
    retried_details,
    weakly,
)
from celery_dlock.backends.postgres import rows, waiting
from celery_dlock.backends.postgres.aplace import AsyncPlace
from celery_dlock.backends.postgres.calls import Release
from celery_dlock.backends.postgres.config import Config, translate
from celery_dlock.backends.postgres.ended import connection_lost, end_notice, has_ended
from celery_dlock.backends.postgres.pooling import opened, pooled
from celery_dlock.backends.postgres.prepared import AsyncPreparedStatements
from celery_dlock.backends.postgres.recovery import SessionEnded, refusal
from celery_dlock.backends.postgres.session import (
    SWEEP_EVERY,
    WATCH_EVERY,
    Client,
    migrate,
    missing_tables,
    tell_lost,
)
from celery_dlock.backends.postgres.statements import Statements
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token

__all__ = ["AsyncPostgres"]

#: SQLSTATEs of a wait that ran out (lock_timeout) or was cancelled (statement_timeout).
_WAIT_ENDED = ("55P03", "57014")


async def _restore_guard(conn: psycopg.AsyncConnection[Any], statements: Statements) -> None:
    """``session.restore_guard``, on an asyncio connection."""
    async with conn.transaction():
        for statement in statements.restore_guard:
            await conn.execute(statement)


class _Session:
    """One loop's open lock session: its connection, backend pid and the fences it holds."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], pid: int) -> None:
        self.conn = conn
        self.cursor = conn.cursor(binary=True)
        self.notice = end_notice(conn)
        self.pid = pid
        #: fence -> key of every lease whose advisory lock this session holds.
        self.held: dict[int, str] = {}
        self.swept = 0.0
        self.prepared = AsyncPreparedStatements(conn)
        #: The first row of a statement, or None: the hot path, as the blocking one.
        self.one = self.prepared.one


class _Loop(LoopOwned):
    """One event loop's connections to one store, and what they know."""

    def __init__(self, config: Config) -> None:
        self.pid = os.getpid()
        self.config = config
        self.mutex = asyncio.Lock()
        self.session: _Session | None = None
        #: Fences of leases lost (session ended; watched, then swept): release, renew give None.
        self.lost: set[int] = set()
        self.idle_waiters: list[psycopg.AsyncConnection[Any]] = []
        #: Every waiter connection open, idle or not: closed with the loop.
        self.waiters: set[psycopg.AsyncConnection[Any]] = set()
        self.watched: dict[int, tuple[Lease, Callable[[Lease], None]]] = {}
        self.watcher: asyncio.Task[None] | None = None

    async def open(self) -> _Session:
        """The lock session, opened and checked as the blocking one (caller holds ``mutex``)."""
        if self.session is not None:
            if self.session.held or not has_ended(self.session.conn, self.session.notice):
                return self.session
            await self.drop()
        await self.keep()
        config, statements = self.config, self.config.statements
        conn = await config.aconnect("lock")
        try:
            row = await (await conn.execute(statements.open)).fetchone()
            assert row is not None
            pid = opened(config, row)
            if not row[1]:
                if not config.auto_migrate:
                    raise missing_tables(config)
                await asyncio.to_thread(migrate, config)
            row = await (await conn.execute(statements.check)).fetchone()
            assert row is not None
            if int(row[0]) != pid:
                raise pooled(config, pid, int(row[0]))
            if not row[1]:
                await _restore_guard(conn, statements)
        except psycopg.Error as exc:
            await conn.close()
            raise translate(exc, "opening the lock session", config.url) from exc
        except BaseException:
            await conn.close()
            raise
        self.session = _Session(conn, pid)
        return self.session

    async def drop(self) -> None:
        """Forget the lock session after it ended: all its leases are lost."""
        session, self.session = self.session, None
        if session is not None:
            self.lost.update(session.held)
            with contextlib.suppress(Exception):
                await session.conn.close()

    @contextlib.asynccontextmanager
    async def using(self, what: str) -> AsyncIterator[_Session]:
        """``recovery.using_session`` for this loop's session (caller holds ``mutex``)."""
        session = await self.open()
        try:
            yield session
        except psycopg.Error as exc:
            if not connection_lost(exc, session.conn):
                raise translate(exc, what, self.config.url) from exc
            await self.drop()
            raise SessionEnded(f"postgres {what}: the lock session ended", self.config.url) from exc

    # -- waiters -----------------------------------------------------------------------------

    async def check_out(self) -> psycopg.AsyncConnection[Any] | None:
        """An idle waiter connection, a new one, or None when ``max_waiters`` are busy."""
        if self.idle_waiters:
            return self.idle_waiters.pop()
        if len(self.waiters) >= self.config.max_waiters:
            return None
        await self.keep()
        conn = await self.config.aconnect("waiter")
        self.waiters.add(conn)
        return conn

    async def end_wait(self, conn: psycopg.AsyncConnection[Any], close: bool = False) -> None:
        """Let the next waiter in (``conn`` leaves its queue) and keep ``conn`` idle; or,
        with ``close`` or when that fails, close it (which leaves the queue as well)."""
        if not close:
            try:
                await conn.execute(self.config.statements.leave_queue)
            except psycopg.Error:
                close = True
            except BaseException:  # cancelled meanwhile (the loop ending): closed, then raised
                await self.end_wait(conn, close=True)
                raise
        if close or conn.closed or conn.broken or self.pid != os.getpid():
            self.waiters.discard(conn)
            with contextlib.suppress(Exception):
                await conn.close()
        else:
            self.idle_waiters.append(conn)

    # -- watching and ending ---------------------------------------------------------------

    async def sweep(self, session: _Session) -> None:
        """``Client.sweep`` on this loop's session (caller holds ``mutex``)."""
        params = {"fences": list(session.held), "keys": list(session.held.values())}
        await session.cursor.execute(self.config.statements.sweep, params, prepare=True)
        gone = {int(row[0]) for row in await session.cursor.fetchall()}
        self.lost.update(gone.intersection(self.watched))
        session.held = {fence: key for fence, key in session.held.items() if fence not in gone}
        session.swept = time.monotonic()

    async def watch(self) -> None:
        """The watcher task: every ``WATCH_EVERY`` a look at the session (no round trip),
        and a sweep as ``Client._sweep_watched`` (at its cost); reports the leases lost."""
        while self.watched:
            await asyncio.sleep(WATCH_EVERY)
            untimed = [f for f, (lease, _) in self.watched.items() if lease.expires_at is None]
            async with self.mutex:
                session = self.session
                if session is not None and has_ended(session.conn, session.notice):
                    await self.drop()
                elif session is not None and time.monotonic() - session.swept > SWEEP_EVERY / 2:
                    with contextlib.suppress(BackendError, ConfigurationError):  # ended: dropped
                        async with self.using("sweep"):
                            if not session.held.keys().isdisjoint(untimed):
                                await self.sweep(session)
            tell_lost([self.watched.pop(f) for f in list(self.watched) if f in self.lost])
        self.watcher = None

    async def aclose(self) -> None:
        """The lock session and the waiters closed (a leave cancelled by the shutdown too)."""
        if self.watcher is not None:
            self.watcher.cancel()
        await self.drop()
        for conn in list(self.waiters):
            with contextlib.suppress(Exception):
                await conn.close()
        self.waiters.clear()
        self.idle_waiters.clear()


class AsyncPostgres:
    """A :class:`~celery_dlock.backends.base.AsyncStore` for one ``PostgresBackend``."""

    def __init__(
        self, config: Config, clients: ProcessLocal[Client], holder_json: Callable[[Holder], str]
    ) -> None:
        self._config = config
        self._sql = config.statements
        self._url = config.url
        self._clients = clients  # the blocking client: its politeness only, no connection
        self._holder_json = holder_json
        self._loops = LoopLocal(lambda: _Loop(config))
        self._loop = self._loops.get

    def close(self) -> None:
        """Close each loop's connections, by a task of that loop: its leases are lost."""
        self._loops.close()

    def holds(self, fence: int) -> bool:
        """Whether a lock session of a live loop of this process holds ``fence``."""
        return any(
            state.session is not None and fence in state.session.held
            for state in self._loops.values()
        )

    # -- acquire -------------------------------------------------------------------------

    async def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None:
        params: dict[str, Any] = {"key": key, "token": new_token(), "ttl": validate_ttl(ttl)}
        params |= {"holder": self._holder_json(holder), "replace": replace}
        state = self._loop()
        queued = AsyncPlace.of(place, key)
        polite = queued is None and replace is None and self._clients.get().yielding(key)
        try:
            async with state.mutex:
                row = await self._acquire(state, holder, params, polite=polite)
        except BaseException:  # an error, a cancel: the place is left before it is raised
            if queued is not None:
                await queued.leave_now()
            raise
        if queued is not None and row is not None:
            queued.leave()  # used up: the next waiter now queues on us, server-side
        if row is None:
            return None
        return Lease(key, params["token"], row[0], holder, row[1], row[2])

    async def _grant(
        self, session: _Session, holder: Holder, params: dict[str, Any], *, polite: bool
    ) -> Any:
        statement = self._sql.acquire_politely if polite else self._sql.acquire
        row = await session.one(statement, params)
        if row is not None or polite:
            return row
        params["retried"] = retried_details(holder)
        params["held"] = list(session.held)
        return rows.took_over(await session.one(self._sql.take_over, params), session.held)

    async def _acquire(
        self, state: _Loop, holder: Holder, params: dict[str, Any], *, polite: bool
    ) -> Any:
        try:
            async with state.using("acquire") as session:
                if session.held and time.monotonic() - session.swept > SWEEP_EVERY:
                    await state.sweep(session)
                try:
                    row = await self._grant(session, holder, params, polite=polite)
                except psycopg.errors.NotNullViolation:  # no guard: as the blocking store
                    await _restore_guard(session.conn, self._sql)
                    row = await self._grant(session, holder, params, polite=polite)
        except SessionEnded as ended:
            raise await self._undo(state, params, ended) from ended.__cause__
        if row is None:
            return None
        fence = int(row[0])
        if not row[3] or row[4] != session.pid:
            await self._clear(state, params, "the lease's advisory lock could not be taken")
            await state.drop()
            raise refusal(self._config, fence, session.pid, int(row[4]))
        session.held[fence] = params["key"]
        return (fence, row[1], row[2])

    async def _undo(self, state: _Loop, params: dict[str, Any], ended: SessionEnded) -> Exception:
        """The session ended under an acquire: clear its lease if it landed; the error."""
        with contextlib.suppress(psycopg.Error, BackendError):
            await self._clear(state, params, "the lock session was lost while acquiring")
        cause = ended.__cause__
        what = "acquire (the lock session ended)"
        return translate(cause, what, self._url) if isinstance(cause, psycopg.Error) else ended

    async def _clear(self, state: _Loop, params: dict[str, Any], why: str) -> None:
        """Clear the lease ``params`` tried to acquire, if it is there, as ``disconnected``."""
        undo = {**params, "outcome": "disconnected", "problem": "disconnected", "details": why}
        session = await state.open()
        await session.one(self._sql.release, undo | {"result": None, "unlock": False})

    # -- release and renew -----------------------------------------------------------------

    async def release(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None:
        call = Release(self._sql, lease, outcome, problem=problem, details=details, result=result)
        state = self._loop()
        async with state.mutex:
            if lease.fence in state.lost:
                state.lost.discard(lease.fence)
                return None
            try:
                async with state.using("release") as session:
                    call.params["unlock"] = unlock = lease.fence in session.held
                    row = await session.one(call.statement, call.params)
                    if row is None and unlock:  # not ours any more, but its lock still is
                        await session.one(self._sql.unlock, {"fence": lease.fence})
            except SessionEnded:
                return await self._read_back(state, lease, call.outcome)
            if unlock:
                session.held.pop(lease.fence, None)
        if row is None:
            return None
        if row[5]:
            self._clients.get().yield_to_waiters(lease.key)
        return call.record(row)

    async def _read_back(self, state: _Loop, lease: Lease, outcome: Outcome) -> Record | None:
        """The session ended under a release: its record, if the release landed."""
        try:
            session = await state.open()
            row = await session.one(self._sql.record_of, {"key": lease.key, "token": lease.token})
        except psycopg.Error as again:
            await state.drop()
            raise translate(again, "release (reading back)", self._url) from again
        if row is None or row[7] != outcome.value:
            return None
        return rows.record(row)

    async def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        params = {"key": lease.key, "token": lease.token, "ttl": validate_ttl(ttl)}
        state = self._loop()
        async with state.mutex:
            if lease.fence in state.lost:
                return None
            try:
                async with state.using("renew") as session:
                    row = await session.one(self._sql.renew, params)
            except SessionEnded:
                return None  # whatever landed, the lease died with the session
        if row is None:
            return None
        return Lease(lease.key, lease.token, lease.fence, lease.holder, row[0], row[1])

    async def get(self, key: str) -> Lease | None:
        state = self._loop()
        async with state.mutex:
            for attempt in (1, 2):
                try:
                    async with state.using("get") as session:
                        row = await session.one(self._sql.get, {"key": key})
                        return rows.lease(row) if row is not None else None
                except SessionEnded:
                    if attempt == 2:
                        raise
        raise AssertionError("unreachable")

    # -- waiting and watching --------------------------------------------------------------

    async def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None:
        """``waiting.wait`` on a waiter connection of this loop."""
        queued = AsyncPlace.of(place, key)
        if timeout <= 0:
            return queued
        params = {"key": key, "ms": max(1, math.ceil(timeout * 1000))}
        state = self._loop()
        conn = await state.check_out() if queued is None else queued.conn
        if conn is None:  # max_waiters are busy: poll
            await asyncio.sleep(min(timeout, random.uniform(0.025, 0.05)))
            return None
        ours = queued or AsyncPlace(key, conn, state.end_wait)
        try:
            cursor = psycopg.AsyncClientCursor(conn)
            await cursor.execute(self._sql.wait if queued is None else self._sql.wait_again, params)
        except psycopg.Error as exc:
            ours.leave()
            if conn.closed:  # only a wake-up, as in ``waiting.wait``: the next look raises
                await asyncio.sleep(min(timeout, random.uniform(0.05, 0.1)))  # if it is down
                return None
            if exc.sqlstate not in _WAIT_ENDED:
                raise translate(exc, "wait", self._url) from exc
            return None
        except BaseException:  # cancelled: psycopg cancelled it on the server
            await ours.leave_now()
            raise
        return ours

    async def wait_any(self, keys: Sequence[str], timeout: float) -> None:
        """``waiting.wait_any`` on this loop: the keys take turns."""
        await waiting.await_any(self.wait, keys, timeout)

    def watch(self, lease: Lease, on_lost: Callable[[Lease], None]) -> Callable[[], None]:
        """``Client.watch`` for a lease of this loop's session, by a task of the loop."""
        state = self._loop()
        fence = lease.fence
        state.watched[fence] = (lease, weakly(on_lost))
        if state.watcher is None:
            state.watcher = asyncio.get_running_loop().create_task(state.watch())

        def stop() -> None:
            state.watched.pop(fence, None)

        return stop
