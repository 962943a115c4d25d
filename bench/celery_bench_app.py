"""The Celery app of bench_celery.py; the worker subprocess imports it.

Environment: BENCH_BROKER (Redis URL), BENCH_COUNTER (Redis URL of the counter DB),
BENCH_LOCKS (celery-dlock store URL). Every body is one Redis INCR, as in the anchors.
"""

from __future__ import annotations

import os

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
