"""Eager mode, and what happens when the lock store fails (fail closed)."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dlock import (
    BackendError,
    ConfigurationError,
    Holder,
    LockedTask,
    LockNotAcquiredError,
    Outcome,
    install,
)
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.celery.settings import forget_settings, settings
from tests.celery import embedded_tasks as tasks


def new_run() -> str:
    return uuid.uuid4().hex[:12]


# -- eager mode ---------------------------------------------------------------------------


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


def test_eager_runs_lock_and_once(eager: tuple[Celery, dict[str, Any]]) -> None:
    _, calls = eager
    order = new_run()
    assert calls["charge"].delay(order).get() == f"receipt-{order}"
    assert calls["charge"].delay(order).get() == f"receipt-{order}"
    assert [run for run in calls["runs"] if run[1] == order] == [("charge", order, 1)]
    store = MemoryBackend.from_url("memory://eager-tests")
    outcomes = [r.outcome for r in store.history(key=f"job:order:{order}")]
    assert outcomes == [Outcome.SKIPPED, Outcome.SUCCEEDED]


def test_eager_retry_continues_its_own_lock(eager: tuple[Celery, dict[str, Any]]) -> None:
    _, calls = eager
    order = new_run()
    assert calls["flaky"].delay(order).get() == 2
    fences = [run[2] for run in calls["runs"] if run[1] == order]
    assert len(fences) == 3 and fences == sorted(set(fences))
    store = MemoryBackend.from_url("memory://eager-tests")
    outcomes = [r.outcome for r in reversed(store.history(key=f"job:flaky:{order}"))]
    assert outcomes == [Outcome.RETRIED, Outcome.RETRIED, Outcome.SUCCEEDED]
    assert store.get(f"job:flaky:{order}") is None


def test_eager_busy_key_raises_instead_of_requeueing(eager: tuple[Celery, dict[str, Any]]) -> None:
    _, calls = eager
    order = new_run()
    store = MemoryBackend.from_url("memory://eager-tests")
    assert store.try_acquire(f"job:busy:{order}", Holder.current(), None) is not None
    with pytest.raises(LockNotAcquiredError):
        calls["busy"].delay(order).get()
    assert [run for run in calls["runs"] if run[1] == order] == []


# -- the store fails ----------------------------------------------------------------------


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


@pytest.mark.usefixtures("broken_store")
def test_store_failure_retries_the_task_and_never_runs_it_unlocked(
    app: Any, store: MemoryBackend
) -> None:
    run = new_run()
    result = tasks.refund.delay(run)
    deadline = time.monotonic() + 15
    while result.state != "RETRY":
        assert time.monotonic() < deadline, f"state stayed {result.state}"
        time.sleep(0.02)
    assert tasks.SEEN[run] == []
    app.conf.dlock_backend = "memory://celery-tests"  # the store is back
    forget_settings(app)
    assert result.get(timeout=20) == "refunded"
    [seen] = tasks.SEEN[run]
    assert seen["key"] == f"job:order:{run}"  # ran under the lock, once the store was back
    assert [r.outcome for r in store.history(key=f"job:order:{run}")] == [Outcome.SUCCEEDED]


@pytest.mark.usefixtures("broken_store")
def test_store_failure_with_run_policy_runs_unlocked_and_says_so(
    app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.dlock_on_backend_error = "run"
    forget_settings(app)
    run = new_run()
    with caplog.at_level(logging.WARNING, logger="celery_dlock.task"):
        assert tasks.refund.delay(run).get(timeout=10) == "refunded"
    [seen] = tasks.SEEN[run]
    assert seen["key"] is None  # no lease: it ran unlocked
    assert any("UNLOCKED" in message for message in caplog.messages)


def test_store_failure_in_a_direct_call_raises(app: Any, broken_store: None) -> None:
    with pytest.raises(BackendError):
        tasks.refund(new_run())


# -- settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("dlock_backend", 42, "dlock_backend must be a URL"),
        ("dlock_namespace", 7, "dlock_namespace"),
        ("dlock_ttl", -1, "dlock_ttl"),
        ("dlock_janitor_interval", 0, "dlock_janitor_interval"),
        ("dlock_history_retention", "forever", "dlock_history_retention"),
        ("dlock_on_backend_error", "ignore", "dlock_on_backend_error"),
    ],
)
def test_bad_settings_are_named(name: str, value: Any, message: str) -> None:
    app = Celery("settings", set_as_current=False)
    app.conf[name] = value
    with pytest.raises(ConfigurationError, match=message):
        settings(app)


def test_default_store_is_a_local_file_store_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from celery_dlock.celery import settings as settings_module

    settings_module._warned_default.clear()
    app = Celery("defaults", set_as_current=False)
    with caplog.at_level(logging.WARNING, logger="celery_dlock"):
        current = settings(app)
        assert caplog.messages == []  # reading the settings is pure
        settings_module.warn_if_default_store(current)
        settings_module.warn_if_default_store(settings(app))
    assert current.backend.startswith("file://") and current.default_backend
    assert current.namespace == "job" and current.ttl is None
    assert current.on_backend_error == "retry"
    assert sum("dlock_backend is not set" in m for m in caplog.messages) == 1
