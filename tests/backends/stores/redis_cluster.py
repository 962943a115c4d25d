"""The Redis store on a real Redis Cluster (three primaries, three replicas, started for
the run): ``redis+cluster://``, commands routed by slot, following ``MOVED``; each test
gets its own key prefix, deleted afterwards, and the namespace spread over 16 slots."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.backends.storecase import StoreCase
from tests.support.redis_cluster import shared_cluster

NAME = "redis_cluster"
#: A URL of this kind whose store cannot be reached (or made), with a password where the
#: scheme has one: ``from_url`` must accept it without I/O (contract).
UNREACHABLE = "redis+cluster://:s3cret@127.0.0.1:1,127.0.0.1:2?retries=0"
_counter = itertools.count()


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    from redis.cluster import ClusterNode, RedisCluster

    from celery_dlock.backends.redis import RedisBackend

    cluster = shared_cluster()
    prefix = f"c{os.getpid()}-{next(_counter)}"
    # A new cluster is younger than restart_delay: its guard would hold every grant back.
    url = f"{cluster.url}?prefix={prefix}&restart_delay=0"
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
        admin = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster.ports[0])])
        for name in admin.scan_iter(match=f"{{{prefix}*", count=1000):
            admin.delete(name)
        admin.close()
