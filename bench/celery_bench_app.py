"""The Celery app of bench_celery.py; the worker subprocess imports it.

Environment: BENCH_BROKER (Redis URL), BENCH_COUNTER (Redis URL of the counter DB),
BENCH_LOCKS (celery-dlock store URL), BENCH_PG (Postgres URL of the advisory floor).
Every body is one Redis INCR, as in the anchors.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import redis
from celery import Celery

from celery_dlock import LockedTask, install

app = Celery("celery_bench_app")
app.conf.update(
    broker_url=os.environ["BENCH_BROKER"],
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    dlock_backend=os.environ.get("BENCH_LOCKS", "memory://"),
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ["BENCH_COUNTER"], "default_timeout": 3600},
    },
    singleton_backend_url=os.environ["BENCH_COUNTER"],
)
install(app, janitor=False)
counter = redis.Redis.from_url(os.environ["BENCH_COUNTER"])


@app.task(name="bench.plain")
def plain(i: int) -> None:
    counter.incr("bench:done")


@app.task(base=LockedTask, name="bench.locked", lock_key="bench:{i}")
def locked(i: int) -> None:
    counter.incr("bench:done")


_floor_connection: dict[int, Any] = {}


def _floor_pg() -> Any:
    """The raw floors' psycopg 3 connection: one per process (autocommit)."""
    connection = _floor_connection.get(os.getpid())
    if connection is None:
        import psycopg

        connection = _floor_connection[os.getpid()] = psycopg.connect(
            os.environ["BENCH_PG"], autocommit=True
        )
    return connection


@app.task(name="bench.advisory_floor")
def advisory_floor(i: int) -> None:
    """The floor of any Postgres lock: a raw advisory lock/unlock pair (two round trips,
    no writes) around the same body."""
    connection = _floor_pg()
    connection.execute("SELECT pg_try_advisory_lock(%s)", (i,))
    counter.incr("bench:done")
    connection.execute("SELECT pg_advisory_unlock(%s)", (i,))


#: KEYS: the key | ARGV: the token | 1 if deleted, else 0 (the key is another holder's).
_release_floor = counter.register_script(
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


@app.task(name="bench.redis_floor")
def redis_floor(i: int) -> None:
    """The floor of any Redis lock taken in the worker that releases by its token:
    ``SET NX PX`` and a Lua compare-and-delete (two round trips, no fence, no record) around
    the same body, in the Redis of the LockedTask store."""
    key, token = f"bench:floor:{i}", uuid.uuid4().hex
    counter.set(key, token, nx=True, px=60_000)
    counter.incr("bench:done")
    _release_floor(keys=[key], args=[token])


_previous: dict[int, int] = {}


@app.task(name="bench.advisory_one_trip")
def advisory_one_trip(i: int) -> None:
    """The floor of a Postgres lock with one round trip per task: the unlock of the previous
    task's advisory lock travels with this task's lock, in one statement (the shape of a
    release deferred to the next acquire)."""
    previous = _previous.get(os.getpid())
    _floor_pg().execute("SELECT pg_advisory_unlock(%s), pg_try_advisory_lock(%s)", (previous, i))
    _previous[os.getpid()] = i
    counter.incr("bench:done")


try:
    from celery_once import QueueOnce

    @app.task(base=QueueOnce, name="bench.once", once={"graceful": True, "keys": ["i"]})
    def once(i: int) -> None:
        counter.incr("bench:done")

except ImportError:  # pragma: no cover - optional anchor
    pass

try:
    from celery_singleton import Singleton

    @app.task(base=Singleton, name="bench.singleton")
    def singleton(i: int) -> None:
        counter.incr("bench:done")

except ImportError:  # pragma: no cover - optional anchor
    pass
