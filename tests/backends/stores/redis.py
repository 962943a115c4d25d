"""The Redis store of the contract suite: a real Redis (DB 1 of 127.0.0.1:6379 unless
``DLOCK_REDIS_URL`` says otherwise), expiry by Redis's own clock (``clock=None``).

Each test gets its own key prefix, deleted afterwards, so runs that share the database
(the full suite and a ``-k redis`` run at the same time) never see each other's keys.
``DLOCK_REDIS_BUCKETS=4`` runs the suite with the namespace spread over 4 hash slots.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.backends.storecase import StoreCase
from tests.support.services import redis_client

NAME = "redis"
#: A URL of this kind whose store cannot be reached (or made), with a password where the
#: scheme has one: ``from_url`` must accept it without I/O (contract).
UNREACHABLE = "redis://:s3cret@127.0.0.1:1/0?retries=0"
URL = os.environ.get("DLOCK_REDIS_URL", "redis://127.0.0.1:6379/1")
BUCKETS = int(os.environ.get("DLOCK_REDIS_BUCKETS", "1"))
_counter = itertools.count()


def store_url(prefix: str, base: str = URL, **options: object) -> str:
    """``base`` with our options: the URL a subprocess needs to reach the same store."""
    query = "&".join(f"{name}={value}" for name, value in {"prefix": prefix, **options}.items())
    return f"{base}{'&' if '?' in base else '?'}{query}"


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key of namespace ``prefix`` (tests only: SCAN is fine here)."""
    import redis

    client = redis.Redis.from_url(url.split("?", maxsplit=1)[0])
    try:
        for name in client.scan_iter(match=f"{{{prefix}*", count=1000):
            client.delete(name)
    finally:
        client.close()


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    redis_client(URL).close()
    from celery_dlock.backends.redis import RedisBackend

    prefix = f"t{os.getpid()}-{next(_counter)}"
    url = store_url(prefix, buckets=BUCKETS)
    others: list[RedisBackend] = []

    def second() -> RedisBackend:
        other = RedisBackend.from_url(url)
        others.append(other)
        return other

    try:
        yield StoreCase(backend=RedisBackend.from_url(url), url=url, clock=None, second=second)
    finally:
        for other in others:
            other.close()
        delete_prefix(URL, prefix)
