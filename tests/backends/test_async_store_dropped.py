"""A store with an asyncio client (Postgres, Redis) dropped while its event loop lives on: a
service that makes a backend per tenant or per request and lets it go. Its loop's connections
are closed by a task of that loop, not torn down by the garbage collector (which finalized
them one by one before their keeper could close them, a ResourceWarning each: an error in a
program run with ``-W error``, as this suite is)."""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from celery_dlock import Outcome
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.base import AsyncStore
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


@pytest.mark.parametrize("then", ["the loop runs on", "the loop shuts down"])
def test_a_store_dropped_while_its_loop_lives_has_its_connections_closed_by_the_loop(
    url: str, then: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend takes and releases a lock through its asyncio client, and is dropped and
    collected while its loop lives. Expected: every connection it opened leaves the server,
    closed by the loop (as it runs on, or by its ``shutdown_asyncgens``), with no warning
    and no error of the loop's."""
    port = urlsplit(url).port
    assert port is not None
    loop = asyncio.new_event_loop()
    before = connections_to(port)
    backend = backend_from_url(url)
    store = backend.async_store()
    assert store is not None

    async def use(store: AsyncStore) -> None:
        lease = await store.try_acquire("job:dropped:1", holder(), 60)
        assert lease is not None
        assert await store.release(lease, Outcome.SUCCEEDED) is not None

    loop.run_until_complete(use(store))
    opened = connections_to(port) - before
    assert opened, "the store opened no connection of its own"
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        backend.close()
        del backend, store
        gc.collect()
        if then == "the loop shuts down":
            loop.run_until_complete(loop.shutdown_asyncgens())
        eventually(
            lambda: (
                loop.run_until_complete(asyncio.sleep(0.01)) or not connections_to(port) & opened
            ),
            f"the dropped store's connections {sorted(opened)} closed",
        )
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        gc.collect()
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
