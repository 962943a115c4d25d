"""A Redis that may evict keys (a ``maxmemory`` and a policy other than ``noeviction``)
can give a lock away while its holder runs: the store says so in the log as a process
first talks to it, once, not only when someone runs ``celery dlock doctor``. A private
``redis-server``."""

from __future__ import annotations

import asyncio
import logging

import pytest

from celery_dlock import AsyncLock, Lock, backend_from_url

redis = pytest.importorskip("redis")

from tests.backends import test_redis_server  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

#: A private ``redis-server`` without persistence, stopped after the test.
server = test_redis_server.server

LOGGER = "celery_dlock.backends.redis"


@pytest.fixture(autouse=True)
def unwarned() -> None:
    """Each test's server unwarned about in this process (a port may come again)."""
    from celery_dlock.backends.redis import client

    client._warned.clear()


def configure(server: RedisServer, maxmemory: str, policy: str) -> None:
    client = server.client()
    client.config_set("maxmemory", maxmemory)
    client.config_set("maxmemory-policy", policy)
    client.close()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and "evict" in r.getMessage()
    ]


@pytest.mark.parametrize("policy", ["volatile-lru", "allkeys-lru"])
def test_an_evicting_redis_is_named_in_the_log_once(
    server: RedisServer, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    configure(server, "100mb", policy)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    backend = backend_from_url(server.url("evicting"))
    try:
        for _ in range(3):
            with Lock(backend, "report:daily"):
                pass
    finally:
        backend.close()
    [warning] = warnings_of(caplog)
    assert f"maxmemory-policy {policy}" in warning and "104857600 bytes" in warning
    assert "noeviction" in warning


@pytest.mark.parametrize(("maxmemory", "policy"), [("100mb", "noeviction"), ("0", "allkeys-lru")])
def test_a_redis_that_cannot_evict_is_not_warned_about(
    server: RedisServer, caplog: pytest.LogCaptureFixture, maxmemory: str, policy: str
) -> None:
    configure(server, maxmemory, policy)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    backend = backend_from_url(server.url("safe"))
    try:
        with Lock(backend, "report:daily"):
            pass
    finally:
        backend.close()
    assert warnings_of(caplog) == []


def test_an_asyncio_client_names_an_evicting_redis_too(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    configure(server, "100mb", "volatile-lru")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    backend = backend_from_url(server.url("evicting-aio"))

    async def twice() -> None:
        for _ in range(2):
            async with AsyncLock(backend, "report:daily"):
                pass

    try:
        asyncio.run(twice())
        asyncio.run(twice())  # another loop: its own connections, no second warning
    finally:
        backend.close()
    [warning] = warnings_of(caplog)
    assert "maxmemory-policy volatile-lru" in warning
