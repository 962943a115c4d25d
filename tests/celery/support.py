"""Helpers of the embedded-worker tests."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from celery import Celery, _state
from celery.contrib.testing.worker import TestWorkController
from celery.utils.nodenames import anon_nodename
from celery.worker import WorkController

from celery_dlock import (
    Outcome,
    backend_from_url,
)
from celery_dlock.backends.memory import MemoryBackend
from tests.backends.stores.redis import URL as REDIS_STORE
from tests.backends.stores.redis import delete_prefix, store_url
from tests.support.services import POSTGRES_URL, drop_schema, postgres_admin


def new_run() -> str:
    return uuid.uuid4().hex[:12]


def outcomes(store: MemoryBackend, key: str) -> list[Outcome]:
    return [record.outcome for record in reversed(store.history(key=key))]


def embedded_app(name: str, store_url: str | None = None, **conf: object) -> Celery:
    """An app of one test, for :func:`embedded_worker`: the memory broker (one per process)
    with a queue of its own, since the session's embedded worker consumes the default one;
    results in memory; its locks in ``store_url``. ``conf`` adds to or overrides these."""
    app = Celery(name, set_as_current=False)
    app.conf.update(
        {
            "broker_url": "memory://",
            "task_default_queue": f"{name}-{uuid.uuid4().hex[:8]}",
            "broker_transport_options": {"polling_interval": 0.02},
            "result_backend": "cache+memory://",
            # Celery before 5.7 warns without it as the worker connects, which the suite's
            # filterwarnings turns into an error that stops the worker before it is ready.
            "broker_connection_retry_on_startup": True,
            **({} if store_url is None else {"dlock_backend": store_url}),
            **conf,
        }
    )
    return app


@contextmanager
def embedded_worker(
    app: Celery, pool: str = "solo", concurrency: int = 1, shutdown_timeout: float = 10.0
) -> Iterator[WorkController]:
    """A worker of ``app`` in a thread of this process, for one test, stopped by its own
    ``stop`` path. Celery's ``start_worker`` stops its worker by setting the process-wide
    ``state.should_terminate``, which ends every worker of the process: the session's
    embedded worker of the other tests too. The ``worker_shutdown`` signal is not sent (the
    process does not end: what it holds for other tests stays held).

    While it runs, ``app`` is the process's default app (the worker's timer thread, which
    re-sends a countdown, and the solo pool find tasks through it); the previous default
    comes back when it stops."""
    app.finalize()
    previous = _state.default_app
    app.set_default()
    worker = TestWorkController(
        app=app,
        concurrency=concurrency,
        hostname=anon_nodename(),
        pool=pool,
        loglevel="WARNING",
        logfile=None,
        ready_callback=None,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
    )

    def run() -> None:
        app.set_current()  # in this thread only
        worker.start()

    thread = threading.Thread(target=run, daemon=True, name="embedded-worker")
    thread.start()
    worker.ensure_started()
    _state._set_task_join_will_block(False)  # the worker's start set it: the tests wait
    try:
        yield worker
    finally:
        worker.signal_consumer_close()
        worker._shutdown(warm=True)
        thread.join(shutdown_timeout)
        _state.set_default_app(previous)
        if thread.is_alive():
            raise RuntimeError(f"the embedded worker did not stop in {shutdown_timeout} s")


@contextmanager
def own_store(kind: str, name: str, **redis_options: object) -> Iterator[str]:
    """The URL of a lock store of the caller's own, removed at the end: ``kind``
    ``"postgres"`` (a schema ``dlock_<name>_<run>``, migrated) or ``"redis"`` (a prefix
    ``<name>-<run>``, with ``redis_options`` in the URL)."""
    run = uuid.uuid4().hex[:8]
    if kind == "redis":
        prefix = f"{name}-{run}"
        yield store_url(prefix, REDIS_STORE, **redis_options)
        delete_prefix(REDIS_STORE, prefix)
        return
    postgres_admin().close()  # not installed, or not reachable: a visible skip
    schema = f"dlock_{name}_{run}"
    url = f"{POSTGRES_URL}?schema={schema}"
    backend = backend_from_url(url)
    backend.migrate()  # type: ignore[attr-defined]
    backend.close()
    yield url
    with postgres_admin() as admin:
        drop_schema(admin, schema)
