"""A ``Lock.acquire`` cut by an exception after the store granted the lease and before
the Lock held it (a Celery soft time limit comes as one, from billiard's SIGUSR1 handler,
wherever the main thread is: here while the client waits for the grant's reply). Nobody
held that lease: the key stayed taken by a process that lives on (on Postgres until its
session ends, which a pool child's does not, and on Redis until its ttl ran out). The Lock
now looks for a lease of its holder on the key and releases it, recorded ``abandoned``.

The reply is held back by a proxy (``drop_next_reply``), which sends the signal first."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from celery_dlock import Lock, Outcome, backend_from_url
from celery_dlock.backends.base import LockBackend
from tests.backends.stores.postgres import SERVER_URL, schema_store, with_options
from tests.backends.stores.redis import URL as REDIS_URL
from tests.backends.stores.redis import delete_prefix, store_url
from tests.support.countingproxy import CountingProxy
from tests.support.cuts import Cut, cut_me, cutting


def _signal_me() -> None:
    """From the proxy's thread, while the client waits for the reply held back."""
    cut_me()
    time.sleep(0.3)  # the main thread raises before the connection is cut


def _through(url: str, port: int) -> str:
    parts = urlsplit(url)
    return url.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{port}", 1)


@pytest.fixture(params=["redis", "postgres"])
def stores(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """The URLs of one store: direct, and through a proxy (its port in the URL's place)."""
    if request.param == "redis":
        prefix = f"cut-{uuid.uuid4().hex[:8]}"
        url = store_url(prefix, REDIS_URL)
        try:
            yield url, url
        finally:
            delete_prefix(REDIS_URL, prefix)
        return
    with schema_store(SERVER_URL) as case:
        assert case.url is not None
        yield case.url, with_options(SERVER_URL, schema=case.backend.schema)


def test_an_acquire_cut_after_the_grant_releases_the_lease_as_abandoned(
    stores: tuple[str, str],
) -> None:
    direct_url, base = stores
    parts = urlsplit(base)
    with CountingProxy(parts.hostname or "127.0.0.1", parts.port or 0) as proxy:
        proxied = backend_from_url(_through(base, proxy.port))
        direct = backend_from_url(direct_url)
        try:
            _cut_acquire(proxied, direct, proxy)
        finally:
            proxied.close()
            direct.close()


def _cut_acquire(proxied: LockBackend, direct: LockBackend, proxy: CountingProxy) -> None:
    key = "job:cut-grant"
    warm = Lock(proxied, "job:warm", ttl=30)  # the connection open, its statements ready
    warm.acquire()
    warm.release()
    lock = Lock(proxied, key, ttl=30)
    with cutting():
        proxy.drop_next_reply(then=_signal_me)
        with pytest.raises(Cut):
            lock.acquire()
    assert proxy.dropped == 1, "the grant's reply was not the one held back"
    assert lock.lease is None
    [record] = direct.history(key=key)
    assert (record.outcome, record.problem) == (Outcome.ABANDONED, "Cut"), record
    assert direct.get(key) is None
    again = Lock(direct, key, ttl=30)
    again.acquire()  # free at once: not after the ttl, nor when this process ends
    again.release()
