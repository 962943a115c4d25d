"""The Redis backend's asyncio client: the calls of a lock's life (acquire, release, renew,
read, wait) on redis-py's asyncio connections, for :class:`~celery_dlock.AsyncLock`.

The scripts, their packing and the reading of their replies are the blocking client's
(:mod:`~celery_dlock.backends.redis.calls`); only the sending differs. Each event loop has
its own idle connections (an asyncio connection belongs to the loop that opened it); a
call that is cancelled or fails between its send and its reply closes its connection, so
no reply is ever read by the wrong call. Retries, their backoff and the errors are the
blocking client's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from functools import partial
from typing import Any

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError

from celery_dlock.backends.base import Place
from celery_dlock.backends.common import LoopLocal
from celery_dlock.backends.redis.calls import Calls
from celery_dlock.backends.redis.client import AMBIGUOUS, Client, backoff, doubt
from celery_dlock.backends.redis.fields import lease_from_state
from celery_dlock.backends.redis.scripts import ACQUIRE, PEEK, PROBE, RELEASE, RENEW, Script, bulks
from celery_dlock.errors import BackendError
from celery_dlock.records import Holder, Lease, Outcome, Record

__all__ = ["AsyncRedis"]


class _LoopConnections:
    """One event loop's idle connections, and the acquires whose reply it lost."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._idle: list[Any] = []
        #: (key, token) of acquires whose reply never came: released once Redis answers.
        self.doubtful: list[tuple[str, str]] = []
        self._keeper: AsyncGenerator[None, None] | None = None

    async def _keep(self) -> AsyncGenerator[None, None]:
        """Closes the connections when the loop shuts down: ``asyncio.run`` (and any loop's
        ``shutdown_asyncgens``) closes the async generators still open, this one too."""
        try:
            yield
        finally:
            await self.close()

    async def send(self, packed: bytes, count: int, timeout: float | None = None) -> Any:
        """Send one command packed as ``count`` bulk strings; its reply. ``timeout`` bounds
        the read (None: the socket timeout)."""
        try:
            connection = self._idle.pop()
        except IndexError:
            if self._keeper is None:
                self._keeper = self._keep()
                await anext(self._keeper)
            connection = self._make()
        try:
            await connection.send_packed_command(b"*%d\r\n%b" % (count, packed), False)
            reply = await connection.read_response(timeout=timeout)
        except ResponseError:
            self._idle.append(connection)  # a whole reply was read: in step
            raise
        except BaseException:
            # Cancelled or failed between send and reply: a reply may still come. Closed,
            # never reused (``nowait``: a cancelled call does not wait for the close).
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)
            raise
        self._idle.append(connection)
        return reply

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            with contextlib.suppress(Exception):
                await connection.disconnect()


class AsyncRedis:
    """A :class:`~celery_dlock.backends.base.AsyncStore` for one ``RedisBackend``: its
    calls (and the epochs they learn), its connection settings, retries and errors."""

    def __init__(self, calls: Calls, client: Client) -> None:
        self._calls = calls
        self._client = client
        settings = {**client.connection, "retry": Retry(NoBackoff(), 0)}
        pool = redis.asyncio.Redis(**settings).connection_pool
        make = partial(pool.connection_class, **pool.connection_kwargs)
        self._loops = LoopLocal(lambda: _LoopConnections(make))
        self._connections = self._loops.get

    async def _run(
        self,
        script: Script,
        count: int,
        tail: bytes,
        *,
        operation: str,
        key: str | None = None,
        again: Callable[[], bytes] | None = None,
    ) -> Any:
        """``Client.run`` on this loop's connections: by SHA, the source on ``NOSCRIPT``,
        a failed connection retried with ``again()`` as the tail where given."""
        send = self._connections().send
        attempt = 0
        while True:
            try:
                try:
                    return await send(script.by_sha + tail, count + 2)
                except NoScriptError:
                    return await send(script.by_source + tail, count + 2)
            except AMBIGUOUS as exc:
                if attempt >= self._client.retries:
                    raise self._client.error(operation, key, exc) from exc
                attempt += 1
                if again is not None:
                    tail = again()
                await asyncio.sleep(backoff(attempt))
            except RedisError as exc:
                raise self._client.error(operation, key, exc) from exc

    async def _eval(
        self, script: Script, keys: Sequence[bytes], args: Sequence[Any], operation: str, key: str
    ) -> Any:
        tail = bulks([len(keys), *keys, *args])
        count = 1 + len(keys) + len(args)
        return await self._run(script, count, tail, operation=operation, key=key)

    async def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None:
        connections = self._connections()
        while connections.doubtful:  # acquires whose reply was lost: their leases go first
            doubtful_key, token = connections.doubtful[0]
            keys, args = self._calls.settle_call(doubtful_key, token)
            await self._eval(RELEASE, keys, args, "release", doubtful_key)
            connections.doubtful.pop(0)
        tokens, count, tail, again = self._calls.acquire_call(key, holder, ttl, replace)
        try:
            reply = await self._run(ACQUIRE, count, tail, operation="acquire", key=key, again=again)
        except BackendError as exc:
            doubt(connections.doubtful, exc, key, tokens)
            raise
        return self._calls.acquired(key, holder, tokens[-1], reply)

    async def release(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None:
        outcome = Outcome(outcome)
        count, tail, again = self._calls.release_call(lease, outcome, problem, details, result)
        reply = await self._run(
            RELEASE, count, tail, operation="release", key=lease.key, again=again
        )
        return self._calls.released(
            reply, lease, outcome=outcome, problem=problem, details=details, result=result
        )

    async def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        count, tail = self._calls.renew_call(lease, ttl)
        reply = await self._run(RENEW, count, tail, operation="renew", key=lease.key)
        return self._calls.renewed(lease, reply)

    async def get(self, key: str) -> Lease | None:
        state = await self._eval(PEEK, self._calls.peek_keys(key), [], "get", key)
        return lease_from_state(key, state) if state else None

    async def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None:
        """``RedisBackend.wait`` on this loop: a cancelled wait closes its connection, and
        its ``BLPOP`` ends with it."""
        await self.wait_any((key,), timeout)
        return None

    async def wait_any(self, keys: Sequence[str], timeout: float) -> None:
        """``RedisBackend.wait_any`` on this loop (never a cluster's: see ``async_store``)."""
        if timeout <= 0:
            return
        pauses: list[float] = []
        for key in keys:
            names, args = self._calls.probe_call(key, timeout)
            left = await self._eval(PROBE, names, args, "wait", key)
            pause = self._calls.pause(left, timeout)
            if pause is None:  # free
                return
            pauses.append(pause)
        signals = [self._calls.layout.names(key).signal for key in keys]
        pause = min(pauses)
        packed = bulks(["BLPOP", *signals, f"{pause:.3f}"])
        try:
            await self._connections().send(packed, len(keys) + 2, timeout=pause + self._calls.slack)
        except AMBIGUOUS:  # only a wake-up: look again (see Client.blpop)
            await asyncio.sleep(min(pause, backoff(2)))
        except RedisError as exc:
            raise self._client.error("wait", ", ".join(keys), exc) from exc
