"""The Redis backend's own reading of its hot scripts' replies (``resp.call_simple``): a
reply cut anywhere by the network, every other kind of reply, a connection that fails or
stops in the middle; and on a real server, a read interrupted between send and reply.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator

import pytest

redis = pytest.importorskip("redis")

from redis._parsers import BaseParser  # noqa: E402
from redis.exceptions import InvalidResponse, NoScriptError  # noqa: E402

from celery_dlock import Holder, Outcome  # noqa: E402
from celery_dlock.backends.redis import RedisBackend  # noqa: E402
from celery_dlock.backends.redis.resp import call_simple  # noqa: E402
from tests.backends.stores.redis import delete_prefix, store_url  # noqa: E402
from tests.backends.test_redis import load_scripts  # noqa: E402

parse_error = BaseParser.parse_error
_prefixes = itertools.count()


class Wire:
    """A socket that hands out ``chunks`` one per ``recv`` (then the peer's close, b""),
    or raises ``failure`` at its first ``recv``: the network as the reader meets it."""

    def __init__(self, *chunks: bytes, failure: BaseException | None = None) -> None:
        self.chunks = list(chunks)
        self.failure = failure
        self.sent = b""

    def sendall(self, data: bytes) -> None:
        self.sent += data

    def recv(self, size: int) -> bytes:
        if self.failure is not None:
            raise self.failure
        return self.chunks.pop(0)[:size] if self.chunks else b""


def read(*chunks: bytes, failure: BaseException | None = None) -> bytes | int:
    wire = Wire(*chunks, failure=failure)
    reply = call_simple(wire, b"*1\r\n$4\r\nPING\r\n", parse_error)  # type: ignore[arg-type]
    assert wire.sent == b"*1\r\n$4\r\nPING\r\n"
    return reply


def cuts(data: bytes) -> Iterator[tuple[bytes, ...]]:
    """``data`` whole, and cut in two and in three at every place."""
    yield (data,)
    for first in range(1, len(data)):
        yield data[:first], data[first:]
        for second in range(first + 1, len(data)):
            yield data[:first], data[first:second], data[second:]


def test_a_reply_cut_anywhere_by_the_network_is_read_whole() -> None:
    for chunks in cuts(b"$16\r\n1795 17.5 - 1\r\nx\r\n"):
        assert read(*chunks) == b"1795 17.5 - 1\r\nx"
    for chunks in cuts(b"$0\r\n\r\n"):
        assert read(*chunks) == b""
    for chunks in cuts(b":0\r\n"):
        assert read(*chunks) == 0


def test_an_error_reply_is_raised_as_redis_py_names_it() -> None:
    with pytest.raises(NoScriptError):
        read(b"-NOSCRIPT No matching script. Please use EVAL.\r\n")
    with pytest.raises(redis.ResponseError, match="user_script:1: oops"):
        read(b"-ERR user_script:1: oops\r\n")


@pytest.mark.parametrize(
    "reply",
    [
        b"*2\r\n$1\r\na\r\n$1\r\nb\r\n",  # an array
        b"_\r\n",  # RESP3 null
        b"$-1\r\n",  # RESP2 null
        b"+OK\r\n",
        b">2\r\n$10\r\ninvalidate\r\n*0\r\n",  # a push
        b":1\r\n:2\r\n",  # two replies
        b"$2\r\nab\r\n:1\r\n",
        b"$x\r\nab\r\n",
    ],
)
def test_any_other_reply_is_an_invalid_response(reply: bytes) -> None:
    with pytest.raises(InvalidResponse):
        read(reply)


def test_a_connection_that_fails_or_closes_mid_reply_is_a_redis_connection_error() -> None:
    with pytest.raises(redis.ConnectionError):
        read(b"$10\r\n01234")  # then closed
    with pytest.raises(redis.ConnectionError):
        read()
    with pytest.raises(redis.ConnectionError):
        read(failure=ConnectionResetError(104, "reset"))
    with pytest.raises(redis.TimeoutError):
        read(failure=TimeoutError("timed out"))  # socket.timeout


class Interrupt(BaseException):
    """Raised between a command's send and its reply, as a Celery soft time limit can be."""


class Interrupting:
    """A connection's socket whose next ``recv`` raises :class:`Interrupt` (once)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.interrupted = False

    def recv(self, size: int) -> bytes:
        if not self.interrupted:
            self.interrupted = True
            raise Interrupt
        return self._sock.recv(size)

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


@pytest.fixture
def backend() -> Iterator[RedisBackend]:
    """A backend on the shared Redis, in a namespace of its own (deleted afterwards)."""
    prefix = f"tresp{os.getpid()}-{next(_prefixes)}"
    backend = RedisBackend.from_url(store_url(prefix))
    yield backend
    backend.close()
    delete_prefix(store_url(prefix), prefix)


def test_a_hot_scripts_read_interrupted_leaves_no_stray_reply(backend: RedisBackend) -> None:
    me = Holder.current()
    # Both scripts hot: after a SCRIPT FLUSH (an exclusive test's), the interrupted release
    # would be a NOSCRIPT never answered by its source, and would not land.
    load_scripts(backend)
    lease = backend.try_acquire("job:interrupted", me, 30)
    assert lease is not None
    [connection] = backend._client.connections()._idle
    connection._sock = Interrupting(connection._sock)
    with pytest.raises(Interrupt):
        backend.release(lease, Outcome.SUCCEEDED)  # lands; its reply is left unread
    # The next commands read their own replies, not the one left behind.
    other = backend.try_acquire("job:other", me, 30)
    assert other is not None and other.key == "job:other"
    assert backend.get("job:interrupted") is None
    assert backend.renew(other, 60) is not None
    [record] = backend.history(key="job:interrupted")
    assert record.lease.token == lease.token and record.outcome is Outcome.SUCCEEDED
