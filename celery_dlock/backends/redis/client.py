"""Talking to Redis: this process's connections, commands packed here, retries, and the
one place where redis-py's exceptions become :class:`BackendError` (the cause kept).

Commands go over redis-py ``Connection`` objects but not through its client or pool: on
loopback a round trip is about 50 µs and redis-py's ``execute_command`` adds about 25 µs
(pool lock, event dispatch, metrics, argument packing), which the hot path avoids by
keeping idle connections on a list and packing the constant part of each script call once
(``resp.bulks``); the hot scripts' replies are read off the socket here (``resp``).
redis-py still connects, authenticates, speaks TLS and reads every other reply.
"""

from __future__ import annotations

import logging
import random
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    AuthenticationError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from celery_dlock.backends.common import ProcessLocal
from celery_dlock.backends.redis.resp import bulks, call_simple
from celery_dlock.backends.redis.scripts import Script
from celery_dlock.errors import BackendError
from celery_dlock.events import fields

__all__ = [
    "AMBIGUOUS", "Client", "Connections", "Wire", "backoff", "doubt", "evicting",
    "warn_if_evicting",
]  # fmt: skip

logger = logging.getLogger("celery_dlock.backends.redis")


def _raw_readable() -> bool:
    """Whether redis-py's connections have the private parts ``resp.call_simple`` reads past
    (``_sock``, ``_parser.parse_error``: redis-py 5 to 8); without them, its reader reads."""
    probe = redis.connection.Connection()  # type: ignore[no-untyped-call]  # not connected
    parser = getattr(probe, "_parser", None)
    return hasattr(probe, "_sock") and callable(getattr(parser, "parse_error", None))


_RAW = _raw_readable()

T = TypeVar("T")

#: Failures after which a command may or may not have run: retried, then read back.
AMBIGUOUS = (RedisConnectionError, RedisTimeoutError)
#: Acquires whose outcome is unknown, kept per process until Redis answers again.
_DOUBTFUL_LIMIT = 1000


def doubt(doubtful: list[tuple[str, str]], exc: BackendError, key: str, tokens: list[str]) -> None:
    """Note an acquire of ``key`` that failed with ``exc`` after trying ``tokens``: if a
    try may have landed with its reply lost, its lease is released once Redis answers."""
    if isinstance(exc.__cause__, AMBIGUOUS):
        room = max(0, _DOUBTFUL_LIMIT - len(doubtful))
        doubtful.extend((key, token) for token in tokens[:room])


class Wire(Protocol):
    """This process's connections to a Redis, one node's (``Connections``) or a cluster's
    (``ClusterConnections``)."""

    #: (key, token) of acquires whose reply never came: released once Redis answers.
    doubtful: list[tuple[str, str]]

    def send(
        self, packed: bytes, count: int, timeout: float | None = None, simple: bool = False
    ) -> Any: ...

    def call(self, *args: Any, timeout: float | None = None) -> Any: ...

    def send_all(self, commands: list[bytes]) -> list[Any]: ...

    def send_all_at(self, key: bytes, commands: list[bytes]) -> list[Any]: ...

    def close(self) -> None: ...


class Connections:
    """This process's connections to Redis, a stack of idle ones shared by its threads.

    A command takes a connection, sends, reads its reply and puts it back; a waiter holds
    one through its ``BLPOP``, so it never holds up other threads. ``list.pop`` and
    ``list.append`` are atomic: no lock is needed.
    """

    def __init__(self, connection: dict[str, Any]) -> None:
        template = redis.Redis(**connection).connection_pool
        self._make: Callable[[], Any] = partial(
            template.connection_class, **template.connection_kwargs
        )
        self._idle: list[Any] = []
        self._all: weakref.WeakSet[Any] = weakref.WeakSet()
        #: (key, token) of acquires whose reply never came: released once Redis answers.
        self.doubtful: list[tuple[str, str]] = []
        #: Whether the server's eviction policy was read (by the first connection made).
        self._policy_read = False

    def _take(self) -> Any:
        """An idle connection (given back by the caller when done), or a new one."""
        try:
            return self._idle.pop()
        except IndexError:
            connection = self._make()
            self._all.add(connection)
            if not self._policy_read:
                try:
                    warn_if_evicting(connection)
                except BaseException:
                    connection.disconnect()
                    raise
                self._policy_read = True
            return connection

    def call(self, *args: Any, timeout: float | None = None) -> Any:
        """Send one command and return its reply; ``timeout`` bounds the read (seconds)."""
        return self.send(bulks(args), len(args), timeout)

    def send(
        self, packed: bytes, count: int, timeout: float | None = None, simple: bool = False
    ) -> Any:
        """``call`` for a command already packed as ``count`` bulk strings; ``simple``: its
        reply is one bulk string or integer, read here (``resp.call_simple``)."""
        connection = self._take()
        try:
            command = b"*%d\r\n%b" % (count, packed)
            if simple and not connection.health_check_interval and _RAW:
                if connection._sock is None:
                    connection.connect()
                return call_simple(connection._sock, command, connection._parser.parse_error)
            connection.send_packed_command([command])
            if timeout is None:
                return connection.read_response()
            return connection.read_response(timeout=timeout)
        except ResponseError:
            raise  # a whole reply was read: the connection is in step
        except BaseException:
            # Anything else, even an exception raised between the send and the read (a
            # Celery soft time limit arrives as one), leaves a reply unread: drop it.
            connection.disconnect()
            raise
        finally:
            self._idle.append(connection)

    def send_all(self, commands: list[bytes]) -> list[Any]:
        """Send packed ``commands`` in one write and read their replies, in order: one
        round trip for all. A reply that is an error is returned, not raised."""
        connection = self._take()
        try:
            connection.send_packed_command([b"".join(commands)])  # a list: one sendall each
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(connection.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            return replies
        except BaseException:
            connection.disconnect()  # replies may be left unread
            raise
        finally:
            self._idle.append(connection)

    def send_all_at(self, key: bytes, commands: list[bytes]) -> list[Any]:
        """``send_all`` on one connection (a cluster's: to the primary of ``key``'s slot)."""
        return self.send_all(commands)

    def close(self) -> None:
        for connection in list(self._all):
            connection.disconnect()
        self._idle.clear()


def warn_if_evicting(connection: Any) -> None:
    """Read the eviction policy of the server behind ``connection`` (a new one) and warn
    when it may evict keys (:func:`evicting`). A server that refuses ``INFO`` (an ACL) is
    left to ``celery dlock doctor``."""
    connection.send_command("INFO", "memory")
    try:
        reply = connection.read_response()
    except ResponseError:
        return
    evicting(reply, connection)


#: The servers warned about in this process (``host:port`` or a socket's path).
_warned: set[str] = set()


def evicting(info: Any, connection: Any) -> None:
    """Warn once per process and server when ``INFO memory`` (``info``) shows a
    ``maxmemory`` and a policy other than ``noeviction``: an evicted lock key is a lock
    given away, and managed Redis often defaults to ``volatile-lru``, which evicts exactly
    the keys with a ttl. ``INFO``, not ``CONFIG``, which managed Redis often disables."""
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    fields_ = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    policy = fields_.get("maxmemory_policy", "noeviction").strip()
    limit = fields_.get("maxmemory", "0").strip()
    where = getattr(connection, "path", None) or (
        f"{getattr(connection, 'host', '?')}:{getattr(connection, 'port', '?')}"
    )
    if policy == "noeviction" or not limit.isdigit() or int(limit) == 0 or where in _warned:
        return
    _warned.add(where)
    logger.warning(
        "Redis at %s may evict keys (maxmemory %s bytes, maxmemory-policy %s): an evicted "
        "lock key is a lock given away while its holder runs. Set maxmemory-policy "
        "noeviction (celery dlock doctor checks it)",
        where,
        limit,
        policy,
        extra=fields("redis_evicting"),
    )


class Client:
    """Scripts and commands for one Redis, with retries and our errors.

    Args:
        connection: keyword arguments for redis-py's ``Redis`` (host, port, db, TLS...).
        connections: makes this process's connections from ``connection`` (a cluster's:
            ``ClusterConnections``).
        retries: how often a command whose connection failed is sent again.
        url: the masked URL, for error messages.
        claims, check: commands sent once per process before any other, and the judge of
            their replies (the layout's; see ``Layout.check_all``).
    """

    def __init__(
        self,
        connection: dict[str, Any],
        retries: int,
        url: str,
        connections: Callable[[dict[str, Any]], Wire] = Connections,
        *,
        claims: Sequence[tuple[bytes, ...]] = (),
        check: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self.connection = {
            "socket_timeout": 5.0,
            "socket_connect_timeout": 5.0,
            "client_name": "celery-dlock",
            **connection,
            # Our own retries tell the scripts when a call may be a repeat.
            "retry": Retry(NoBackoff(), 0),
        }
        self.retries = retries
        self.url = url
        #: Extra time a blocking read may take beyond its own timeout.
        self.slack = float(self.connection["socket_timeout"] or 5.0)
        #: Whether the connections are a cluster's (``ClusterConnections``).
        self.cluster = connections is not Connections
        self._make = connections
        #: Commands sent once per process before any other, and what judges their replies
        #: (None for a ResponseError, as from a replica or an ACL): the layout's claims.
        self._claims = tuple(claims)
        self._check = check
        self._local = ProcessLocal(self._open, lambda made: made.close())

    def _open(self) -> Wire:
        """This process's connections, made now, after the claim (retried as a call is)."""
        wire = self._make(self.connection)
        if not self._claims or self._check is None:
            return wire
        attempt = 0
        try:
            while True:
                try:
                    self._check(self._claim(wire))
                    return wire
                except AMBIGUOUS as exc:
                    if attempt >= self.retries:
                        raise self.error("connect", None, exc) from exc
                    attempt += 1
                    time.sleep(backoff(attempt))
                except RedisError as exc:
                    raise self.error("connect", None, exc) from exc
        except BaseException:
            wire.close()
            raise

    def _claim(self, wire: Wire) -> list[Any]:
        """The replies of the layout's claims on ``wire``, one round trip per node: None for
        one Redis refused (an ACL, a replica), which the doctor reports."""
        packed = [b"*%d\r\n%b" % (len(claim), bulks(claim)) for claim in self._claims]
        return [None if isinstance(r, ResponseError) else r for r in wire.send_all(packed)]

    def claim(self) -> list[Any]:
        """The layout's claims sent again (after a loss of Redis's data): their replies,
        for ``Calls.judge``."""
        try:
            return self._claim(self._local.get())
        except RedisError as exc:
            raise self.error("claim", None, exc) from exc

    def connections(self) -> Wire:
        """This process's connections (made afresh after a fork)."""
        return self._local.get()

    def run(
        self,
        script: Script,
        count: int,
        tail: bytes,
        *,
        operation: str,
        key: str | None = None,
        again: Callable[[], bytes] | None = None,
        wire: Wire | None = None,
    ) -> Any:
        """Run ``script`` by its SHA (sending its source on ``NOSCRIPT``) with ``tail``, its
        ``count`` packed parts (number of keys, keys, arguments); retry a failed connection
        with ``again()`` as the tail, where given, so the script can tell a repeat of a call
        whose reply was lost. ``wire``: ``connections()``, where the caller has it."""
        send = (wire or self._local.get()).send
        attempt = 0
        while True:
            try:
                try:
                    return send(script.by_sha + tail, count + 2, None, script.simple)
                except NoScriptError:
                    return send(script.by_source + tail, count + 2, None, script.simple)
            except AMBIGUOUS as exc:
                if attempt >= self.retries:
                    raise self.error(operation, key, exc) from exc
                attempt += 1
                if again is not None:
                    tail = again()
                time.sleep(backoff(attempt))
            except RedisError as exc:
                raise self.error(operation, key, exc) from exc

    def eval(
        self,
        script: Script,
        keys: Sequence[bytes],
        args: Sequence[Any],
        *,
        operation: str,
        key: str | None = None,
    ) -> Any:
        """``run`` with keys and arguments as values, for the paths off the hot one."""
        tail = bulks([len(keys), *keys, *args])
        return self.run(script, 1 + len(keys) + len(args), tail, operation=operation, key=key)

    def run_all(
        self,
        script: Script,
        calls: list[tuple[int, bytes]],
        *,
        operation: str,
        key: str | None = None,
    ) -> list[Any]:
        """``run`` of ``script`` once per ``(count, tail)`` of ``calls``, pipelined: one
        round trip for the batch. For scripts that are safe to run twice: a batch that met
        ``NOSCRIPT`` (its first call then sent by its source) or a failed connection runs
        again."""
        local = self._local.get()
        packed = [b"*%d\r\n%b%b" % (c + 2, script.by_sha, t) for c, t in calls]
        replies = self.retried(lambda: local.send_all(packed), operation, key)
        failed = next((r for r in replies if isinstance(r, ResponseError)), None)
        if isinstance(failed, NoScriptError):
            # Not loaded where the batch runs (a flushed cache, a new node): the first
            # call by its source loads it there, then the rest of the batch by its SHA.
            count, tail = calls[0]
            first = local.send(script.by_source + tail, count + 2)
            if not calls[1:]:
                return [first]
            return [first, *self.run_all(script, calls[1:], operation=operation, key=key)]
        if failed is not None:
            raise self.error(operation, key, failed)
        return replies

    def command(self, operation: str, *args: Any) -> Any:
        """A plain, idempotent command, with the same retries and errors as ``run``."""
        call = self._local.get().call
        return self.retried(lambda: call(*args), operation, None)

    def pipeline_at(
        self, slot_key: bytes, commands: list[bytes], operation: str, key: str
    ) -> list[Any]:
        """The replies of packed ``commands``, sent together on one connection to the node
        of ``slot_key`` (safe to send twice: retried as ``command``); an error reply is
        raised as the ``BackendError`` of ``operation`` on ``key``."""
        wire = self._local.get()
        replies = self.retried(lambda: wire.send_all_at(slot_key, commands), operation, key)
        failed = next((r for r in replies if isinstance(r, ResponseError)), None)
        if failed is not None:
            raise self.error(operation, key, failed)
        return replies

    def retried(self, send: Callable[[], T], operation: str, key: str | None) -> T:
        """``send()``, sent again after a failed connection (``retries`` times, with
        ``backoff``); a failure is the ``BackendError`` of ``operation`` on ``key``."""
        attempt = 0
        while True:
            try:
                return send()
            except AMBIGUOUS as exc:
                if attempt >= self.retries:
                    raise self.error(operation, key, exc) from exc
                attempt += 1
                time.sleep(backoff(attempt))
            except RedisError as exc:
                raise self.error(operation, key, exc) from exc

    def blpop(self, signals: Sequence[bytes], timeout: float, key: str) -> bool:
        """Block on ``signals`` (lists of one hash slot) for up to ``timeout`` seconds,
        until one of them holds a wake-up: whether one came. A wait is only a wake-up: one
        whose connection failed (a killed client, a restart) returns after a short pause
        and its waiter looks again; the store's state is read by that look, which raises
        if the store is down."""
        try:
            call = self._local.get().call
            reply = call("BLPOP", *signals, f"{timeout:.3f}", timeout=timeout + self.slack)
        except AMBIGUOUS:
            time.sleep(min(timeout, backoff(2)))
            return True
        except RedisError as exc:
            raise self.error("wait", key, exc) from exc
        return reply is not None

    def error(self, operation: str, key: str | None, exc: RedisError) -> BackendError:
        what = f"redis {operation}" + ("" if key is None else f" of {key!r}")
        hint = ""
        if isinstance(exc, MovedError | AskError) and not self.cluster:
            # A node of a cluster serves the slots it owns and redirects the rest: some
            # keys work, others fail, which a cluster client would have followed.
            hint = " (this Redis is a node of a Redis Cluster: use redis+cluster://host:port)"
        elif isinstance(exc, AuthenticationError) and not self.connection.get("password"):
            # Without a password redis-py's HELLO is refused with a message about HELLO.
            hint = " (this Redis requires a password: redis://:password@host:port)"
        return BackendError(f"{what} failed: {type(exc).__name__}: {exc}{hint}", self.url)

    def close(self) -> None:
        self._local.reset()


def backoff(attempt: int) -> float:
    """Seconds to pause before retry number ``attempt`` (1, 2...) of a failed command."""
    return float(0.05 * 2 ** (attempt - 1) * random.uniform(0.5, 1.0))
