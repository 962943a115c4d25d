"""The Redis backend's asyncio client: the calls of a lock's life (acquire, release, renew,
read, wait) on redis-py's asyncio connections, for :class:`~celery_dlock.AsyncLock`.

The scripts, their packing and the reading of their replies are the blocking client's
(:mod:`~celery_dlock.backends.redis.calls`); only the sending differs. Each event loop has
its own connections (an asyncio connection belongs to the loop that opened it), at most
``MAX_CONNECTIONS`` of them, ``MAX_WAITERS`` of those in a ``BLPOP``; a call that is
cancelled or fails between its send and its reply closes its connection, so no reply is
ever read by the wrong call. An acquire cancelled so (by the loop's end) releases by token
what it may have got before the cancel goes on. Retries, their backoff and the errors are
the blocking client's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError

from celery_dlock.backends.base import Place
from celery_dlock.backends.common import LoopLocal, LoopOwned
from celery_dlock.backends.redis.calls import Calls
from celery_dlock.backends.redis.client import AMBIGUOUS, Client, backoff, doubt, evicting
from celery_dlock.backends.redis.fields import lease_from_state
from celery_dlock.backends.redis.resp import bulks
from celery_dlock.backends.redis.scripts import ACQUIRE, PEEK, PROBE, RELEASE, RENEW, Script
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.records import Holder, Lease, Outcome, Record, describe_exception

__all__ = ["AsyncRedis"]


#: Connections a loop opens at most (a coroutine is cheap, a connection is a file
#: descriptor and a Redis client): calls past this wait for one to come free...
MAX_CONNECTIONS = 512
#: ...idle ones it keeps for good (more are closed once ``IDLE`` seconds unused: after a
#: burst, not during one, where closing and opening again would cost a connect a call)...
MAX_IDLE = 16
IDLE = 5.0
#: ...and those blocked in ``BLPOP`` at once, the rest being left to calls: waiters past
#: this sleep their step and look again (``AsyncLock`` tries the key), as after a lost
#: wake-up.
MAX_WAITERS = 256


class _LoopConnections(LoopOwned):
    """One event loop's connections, and the acquires whose reply it lost."""

    def __init__(
        self,
        make: Callable[[], Any],
        claims: tuple[tuple[bytes, ...], ...],
        check: Callable[[list[Any]], None],
    ) -> None:
        self._make = make
        self._claims = claims  # the layout's (``Client``'s), sent by the first connection
        self._check = check
        self._idle: list[tuple[Any, float]] = []  # with when each was last used
        self._open = 0  # idle or in a call
        self._freed: collections.deque[asyncio.Future[None]] = collections.deque()
        self.blocked = 0  # in a BLPOP now
        #: (key, token) of acquires whose reply never came: released once Redis answers.
        self.doubtful: list[tuple[str, str]] = []
        #: Whether the server's eviction policy was read (by the first connection made).
        self._policy_read = False

    async def send(self, packed: bytes, count: int, timeout: float | None = None) -> Any:
        """Send one command packed as ``count`` bulk strings; its reply. ``timeout`` bounds
        the read (None: the socket timeout)."""
        connection = await self._take()
        try:
            await connection.send_packed_command(b"*%d\r\n%b" % (count, packed), False)
            reply = await connection.read_response(timeout=timeout)
        except ResponseError:
            await self._put_back(connection)  # a whole reply was read: in step
            raise
        except BaseException:
            # Cancelled or failed between send and reply: a reply may still come. Closed,
            # never reused (``nowait``: a cancelled call does not wait for the close).
            await self._drop(connection)
            raise
        await self._put_back(connection)
        return reply

    async def _take(self) -> Any:
        """An idle connection, or a new one; with ``MAX_CONNECTIONS`` open and busy, one
        that comes free (the calls waiting are woken in turn)."""
        while not self._idle and self._open >= MAX_CONNECTIONS:
            freed = asyncio.get_running_loop().create_future()
            self._freed.append(freed)
            try:
                await freed
            except asyncio.CancelledError:
                if not freed.cancelled():  # woken as the cancel came: wake the next
                    self._wake()
                raise
        if self._idle:
            return self._idle.pop()[0]  # the last used: the others age, and are closed
        await self.keep()
        self._open += 1
        connection = self._make()
        if not self._policy_read:
            self._policy_read = True
            try:
                await self._first(connection)
            except BaseException:
                await self._drop(connection)
                self._policy_read = False
                raise
        return connection

    async def _first(self, connection: Any) -> None:
        """What the loop's first connection asks before any call: the server's eviction
        policy, and the layout's claims (a refusal of any, as by an ACL or a replica, is
        left to the doctor)."""
        try:
            await connection.send_command("INFO", "memory")
            evicting(await connection.read_response(), connection)
        except ResponseError:
            pass
        replies = []
        for claim in self._claims:
            try:
                await connection.send_command(*claim)
                replies.append(await connection.read_response())
            except ResponseError:
                replies.append(None)
        self._check(replies)

    def _wake(self) -> None:
        """Wake the first call still waiting for a connection."""
        while self._freed:
            freed = self._freed.popleft()
            if not freed.done():
                freed.set_result(None)
                return

    async def _put_back(self, connection: Any) -> None:
        """Keep ``connection`` idle for the next call; close the oldest idle past
        ``MAX_IDLE`` that went unused for ``IDLE`` seconds."""
        now = asyncio.get_running_loop().time()
        self._idle.append((connection, now))
        self._wake()
        while len(self._idle) > MAX_IDLE and self._idle[0][1] < now - IDLE:
            oldest, _ = self._idle.pop(0)
            await self._drop(oldest, nowait=False)  # its socket closed on return

    async def _drop(self, connection: Any, nowait: bool = True) -> None:
        """Close ``connection``: at once (a cancelled call does not wait), or its socket
        closed before another may be opened in its place."""
        try:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=nowait)
        finally:
            self._open -= 1
            self._wake()  # a call waiting may open one now

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        self._open -= len(idle)
        for connection, _ in idle:
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
        layout = calls.layout
        self._loops = LoopLocal(lambda: _LoopConnections(make, layout.claims(), layout.check_all))
        self._connections = self._loops.get

    def close(self) -> None:
        """Close each loop's connections, by a task of that loop."""
        self._loops.close()

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
        if self._calls.refused is not None:
            await self._claim_again(None, connections)  # refused until the marker is ours
        await self._settle(connections, key)  # the error is this acquire's
        tokens, count, tail, again = self._calls.acquire_call(key, holder, ttl, replace)
        try:
            reply = await self._run(ACQUIRE, count, tail, operation="acquire", key=key, again=again)
        except BackendError as exc:
            doubt(connections.doubtful, exc, key, tokens)
            raise
        except asyncio.CancelledError:
            # Cancelled between send and reply (AsyncLock's try is cancelled only by the
            # loop's end, with the tasks left): a lease that landed has no holder to
            # release it before its ttl. Released by token now, before the cancel goes on.
            connections.doubtful.extend((key, token) for token in tokens)
            with contextlib.suppress(BackendError):
                await self._settle(connections, key)
            raise
        lease = self._calls.acquired(key, holder, tokens[-1], reply)
        if self._calls.lost_data:
            await self._claim_again(lease, connections)
        return lease

    async def _claim_again(self, lease: Lease | None, connections: _LoopConnections) -> None:
        """``RedisBackend._claim_again`` on this loop's connections."""
        found: list[Any] = []
        try:
            for claim in self._calls.layout.claims():
                try:
                    found.append(await connections.send(bulks(claim), len(claim)))
                except ResponseError:
                    found.append(None)  # as the first claim: an ACL or a replica refused it
        except RedisError as exc:
            if lease is not None:
                connections.doubtful.append((lease.key, lease.token))
            raise self._client.error("claim", None, exc) from exc
        try:
            self._calls.judge(found)
        except ConfigurationError as exc:
            if lease is not None:
                await self.release(lease, Outcome.FAILED, *describe_exception(exc))
            raise

    async def _settle(self, connections: _LoopConnections, key: str) -> None:
        """Release the leases of acquires whose reply was lost, recorded ``disconnected``
        (a release by token: nothing happens to a try that never landed)."""
        while connections.doubtful:
            doubtful_key, token = connections.doubtful[0]
            keys, args = self._calls.settle_call(doubtful_key, token)
            await self._eval(RELEASE, keys, args, "acquire", key)
            connections.doubtful.pop(0)

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
        connections, pause = self._connections(), min(pauses)
        if connections.blocked >= MAX_WAITERS:
            await asyncio.sleep(pause)  # no connection to spare: a poll, one step long
            return
        connections.blocked += 1
        try:
            await self._blpop(connections, signals, pause, keys)
        finally:
            connections.blocked -= 1

    async def _blpop(
        self, connections: _LoopConnections, signals: list[bytes], pause: float, keys: Sequence[str]
    ) -> None:
        packed = bulks(["BLPOP", *signals, f"{pause:.3f}"])
        try:
            await connections.send(packed, len(keys) + 2, timeout=pause + self._calls.slack)
        except AMBIGUOUS:  # only a wake-up: look again (see Client.blpop)
            await asyncio.sleep(min(pause, backoff(2)))
        except RedisError as exc:
            raise self._client.error("wait", ", ".join(keys), exc) from exc
