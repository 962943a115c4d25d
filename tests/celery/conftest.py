"""The fixtures of the Celery tests; each test asks for the worker it needs.

Embedded: one Celery app and one worker thread for the session (``app``, ``store``). The
worker runs the tasks of ``tests.celery.embedded_tasks`` with the solo pool in a thread of the
test process, so the tests share the memory lock store with it and can hold keys themselves.

Prefork: ``worker``, one real prefork worker per lock store (Postgres, file) for the
session, on a Redis broker (``tests.celery.prefork``); ``redis_url`` and ``lock_url`` for
tests that start a worker of their own.

Eager: ``eager``, an app that runs tasks in the caller; ``broken_store``, a lock store that
fails.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

# pytest-celery 1.x shadows this fixture with a Docker worker; the classic one wins here.
from celery.contrib.pytest import celery_worker  # noqa: F401

from celery_dlock import (
    BackendError,
    Holder,
    LockedTask,
    install,
)
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.celery.settings import forget_settings
from tests.celery import prefork
from tests.celery.prefork import Worker, running
from tests.celery.support import own_store
from tests.support import unavailable

STORE = "memory://celery-tests"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test of a prefork worker shows the end of that worker's log: what it was
    doing (a module's worker outlives the test, and its log is gone with the run)."""
    outcome: Any = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, Worker) and value.log.exists():
            tail = value.log.read_text(errors="replace")[-8000:]
            report.sections.append((f"worker log {value.log} (its end)", tail))


@pytest.fixture(scope="session")
def celery_config() -> dict[str, Any]:
    return {
        "broker_url": "memory://",
        "broker_transport_options": {"polling_interval": 0.02},
        "result_backend": "cache+memory://",
        "broker_connection_retry_on_startup": True,  # see support.embedded_app
        "result_serializer": "json",
        "task_serializer": "json",
        "dlock_backend": STORE,
        "dlock_janitor_interval": 3600.0,
    }


@pytest.fixture(scope="session")
def celery_includes() -> list[str]:
    return ["tests.celery.embedded_tasks"]


@pytest.fixture(scope="session")
def session_app(celery_session_app: Any, celery_session_worker: Any) -> Iterator[Any]:
    install(celery_session_app)
    yield celery_session_app


@pytest.fixture
def app(session_app: Any) -> Any:
    # Any Celery() made meanwhile (another test module's app) became the current app, and
    # the shared tasks of embedded_tasks resolve through the current app: make it ours.
    session_app.set_current()
    session_app.set_default()
    return session_app


@pytest.fixture
def store() -> MemoryBackend:
    backend = MemoryBackend.from_url(STORE)
    assert isinstance(backend, MemoryBackend)
    return backend


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        import redis
    except ImportError:
        unavailable("redis-py is not installed: pip install 'celery-dlock[redis]'")
    client = redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        unavailable(f"Redis is not reachable on 127.0.0.1:6379 ({exc})")
    for db in (prefork.BROKER_DB, prefork.RESULTS_DB):
        redis.Redis(host="127.0.0.1", port=6379, db=db).flushdb()
    return "redis://127.0.0.1:6379"


#: Modules whose tests run on Postgres only, not on the file store too: what they try is
#: the Celery layer's (replace, retries, soft limits, several keys, metrics, dedupe's ways
#: out), the same on every store, whose contract the backend suite checks on each. The file
#: store's own part in a worker (its liveness by pid, a redelivery, the janitor, the
#: payments trial) keeps both. Each of these modules ran about as long again on the file
#: store: about a twentieth of a CI run (255 s of 5,100 summed), on a 2-core machine whose
#: run came to 1,053 s against a bound of 900.
POSTGRES_ONLY = frozenset(
    {
        "test_cut_before_body",
        "test_dedupe",
        "test_dedupe_reject",
        "test_dedupe_reused_task_id",
        "test_metrics",
        "test_replace_mark_trial",
        "test_replace_trial",
        "test_retries",
        "test_revoke_queued_race",
        "test_several_keys_trial",
        "test_soft_limit_sweep",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the file store's runs of the :data:`POSTGRES_ONLY` modules' tests."""
    dropped = [
        item
        for item in items
        if isinstance(item, pytest.Function)
        and item.module.__name__.rsplit(".", 1)[-1] in POSTGRES_ONLY
        and "lock_url" in item.fixturenames
        and item.callspec.params.get("lock_url") == "file"
    ]
    if dropped:
        gone = set(map(id, dropped))
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) not in gone]


@pytest.fixture(scope="session", params=["postgres", "file"])
def lock_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The lock store: Postgres in a schema of its own, and the default local file store."""
    if request.param == "file":
        yield f"file://{tmp_path_factory.mktemp('locks')}"
        return
    with own_store("postgres", "prefork") as url:
        yield url


@pytest.fixture(scope="session")
def worker(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, lock_url: str
) -> Iterator[Worker]:
    with running(tmp_path_factory.mktemp("worker"), redis_url, lock_url) as started:
        yield started


@pytest.fixture(scope="module")
def eager() -> Iterator[tuple[Celery, dict[str, Any]]]:
    app = Celery("eager", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        dlock_backend="memory://eager-tests",
    )
    install(app, janitor=False)
    calls: dict[str, Any] = {"runs": []}

    @app.task(
        shared=False,
        base=LockedTask,
        bind=True,
        name="e.charge",
        lock_key="order:{order_id}",
        once=True,
    )
    def charge(self: Any, order_id: str) -> str:
        calls["runs"].append(("charge", order_id, self.lease.fence))
        return f"receipt-{order_id}"

    @app.task(
        shared=False,
        base=LockedTask,
        bind=True,
        name="e.flaky",
        lock_key="flaky:{order_id}",
        max_retries=3,
        default_retry_delay=0,
    )
    def flaky(self: Any, order_id: str) -> int:
        calls["runs"].append(("flaky", order_id, self.lease.fence))
        if self.request.retries < 2:
            raise self.retry(exc=ConnectionError("later"))
        return int(self.request.retries)

    @app.task(shared=False, base=LockedTask, name="e.busy", lock_key="busy:{order_id}")
    def busy(order_id: str) -> str:
        calls["runs"].append(("busy", order_id))
        return "ran"

    calls.update(charge=charge, flaky=flaky, busy=busy)
    yield app, calls


@pytest.fixture
def broken_store(app: Any, tmp_path: Path) -> Iterator[None]:
    """Point the embedded worker's app at a file store whose directory then vanishes: every
    operation fails with a real OS error, turned into BackendError."""
    directory = tmp_path / "store"
    url = f"file://{directory}"
    from celery_dlock.process import shared_backend

    shared_backend(url)  # made while the directory exists
    shutil.rmtree(directory)
    previous = app.conf.dlock_backend
    app.conf.dlock_backend = url
    forget_settings(app)
    try:
        with pytest.raises(BackendError):
            shared_backend(url).try_acquire("job:probe", Holder.current(), None)
        yield
    finally:
        app.conf.dlock_backend = previous
        app.conf.dlock_on_backend_error = "retry"
        forget_settings(app)
