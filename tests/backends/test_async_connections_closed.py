"""The asyncio connections of a store (Postgres, Redis) whose event loop lives on, closed by a
task of that loop when the backend is closed or dropped: a service that makes a backend per
tenant or per request and lets it go. Dropped, they were torn down by the garbage collector
(which finalized them one by one before their keeper could close them, a ResourceWarning
each: an error in a program run with ``-W error``, as this suite is); closed, they stayed
open until the loop ended."""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from celery_dlock import Outcome
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.base import AsyncStore, LockBackend
from tests.backends.conftest import STORES
from tests.backends.test_contract import holder
from tests.support import eventually


@pytest.fixture(params=["postgres", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with STORES[request.param].open_store(tmp_path, request) as case:
        try:
            assert case.url is not None
            yield case.url
        finally:
            case.backend.close()


def connections_to(port: int) -> set[tuple[str, int]]:
    """The local addresses of this process's open TCP connections to ``port``."""
    return {
        (found.laddr.ip, found.laddr.port)
        for found in psutil.Process().net_connections("tcp")
        if found.raddr and found.raddr.port == port and found.status == "ESTABLISHED"
    }


async def use(store: AsyncStore) -> None:
    """Take and release a key through ``store``."""
    lease = await store.try_acquire("job:closed:1", holder(), 60)
    assert lease is not None
    assert await store.release(lease, Outcome.SUCCEEDED) is not None


@dataclass(frozen=True)
class Seen:
    """This process's connections to a store's ``port``: before a backend was made, and
    those the backend opened."""

    port: int
    before: set[tuple[str, int]]
    opened: set[tuple[str, int]]

    def still_open(self) -> set[tuple[str, int]]:
        return connections_to(self.port) & self.opened


def used_on(loop: asyncio.AbstractEventLoop, url: str) -> tuple[LockBackend, AsyncStore, Seen]:
    """A backend of ``url`` that took and released a key on ``loop`` through its asyncio
    client, and the connections it opened."""
    port = urlsplit(url).port
    assert port is not None
    before = connections_to(port)
    backend = backend_from_url(url)
    store = backend.async_store()
    assert store is not None
    loop.run_until_complete(use(store))
    seen = Seen(port, before, connections_to(port) - before)
    assert seen.opened, "the store opened no connection of its own"
    return backend, store, seen


def run_until_closed(loop: asyncio.AbstractEventLoop, seen: Seen) -> None:
    """Run ``loop`` in short steps until none of the connections ``seen`` is open."""
    eventually(
        lambda: loop.run_until_complete(asyncio.sleep(0.01)) or not seen.still_open(),
        f"the connections {sorted(seen.opened)} closed",
        timeout=10,
    )


@pytest.mark.parametrize("then", ["the loop runs on", "the loop shuts down"])
def test_a_store_dropped_while_its_loop_lives_has_its_connections_closed_by_the_loop(
    url: str, then: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend takes and releases a lock through its asyncio client, and is dropped (not
    closed) and collected while its loop lives. Expected: every connection it opened leaves
    the server, closed by the loop (as it runs on, or by its ``shutdown_asyncgens``), with
    no warning and no error of the loop's."""
    loop = asyncio.new_event_loop()
    backend, store, seen = used_on(loop, url)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        del backend, store
        gc.collect()
        if then == "the loop shuts down":
            loop.run_until_complete(loop.shutdown_asyncgens())
        run_until_closed(loop, seen)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        gc.collect()
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_a_closed_backend_has_its_loop_close_its_asyncio_connections_and_connects_again(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``backend.close()`` closes "this process's connections": those of its asyncio client
    too, while their loop runs on (a service that closes a tenant's backend and keeps its
    loop). Used again, the store connects anew; the loop's shutdown closes those."""
    loop = asyncio.new_event_loop()
    backend, store, seen = used_on(loop, url)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        backend.close()
        run_until_closed(loop, seen)
        loop.run_until_complete(use(store))  # connects again
        again = connections_to(seen.port) - seen.before - seen.opened
        assert again, "the store used again opened no connection"
        loop.run_until_complete(loop.shutdown_asyncgens())
        assert not connections_to(seen.port) & again
        loop.close()
        backend.close()  # the loop closed: nothing left of it to close
        gc.collect()
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
