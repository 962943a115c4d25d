"""The Prometheus metrics in one process, against real stores: what each hook counts, read
back from a registry of the test's own; off, nothing is counted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import BackendError, Holder, Lock, Outcome, backend_from_url, metrics
from celery_dlock.backends.file import FileBackend
from celery_dlock.reap import reap
from celery_dlock.renewal import report_lost
from tests.support.holders import kill, spawn_holder

prometheus_client = pytest.importorskip("prometheus_client")


@pytest.fixture(scope="module")
def registry() -> Iterator[Any]:
    own = prometheus_client.CollectorRegistry()
    if metrics._metrics:
        pytest.skip("the metrics were enabled in another registry by an earlier test")
    metrics.enable(own)
    yield own
    metrics.disable()


@pytest.fixture(autouse=True)
def on(registry: Any) -> Iterator[None]:
    metrics.enable()
    yield
    metrics.disable()


def sample(registry: Any, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_a_release_counts_by_task_and_outcome_with_the_time_held(
    registry: Any, tmp_path: Path
) -> None:
    backend = FileBackend(str(tmp_path / "locks"))
    before = sample(registry, "dlock_releases_total", task="t.report", outcome="failed")
    lock = Lock(backend, "job:metrics:1", holder=Holder.current(task_name="t.report"))
    lock.acquire()
    lock.release(Outcome.FAILED, "ValueError", "bad row")
    assert sample(registry, "dlock_releases_total", task="t.report", outcome="failed") == before + 1
    assert sample(registry, "dlock_held_seconds_count", task="t.report", outcome="failed") >= 1
    assert sample(registry, "dlock_wait_seconds_count", task="t.report") >= 1
    calls = sample(registry, "dlock_store_seconds_count", backend="file", operation="acquire")
    assert calls >= 1
    assert sample(registry, "dlock_store_seconds_count", backend="file", operation="release") >= 1


def test_a_failing_store_and_a_lost_lease_are_counted(registry: Any) -> None:
    before = sample(registry, "dlock_store_errors_total", backend="redis", operation="acquire")
    unreachable = backend_from_url("redis://127.0.0.1:1/0?socket_connect_timeout=0.5")
    with pytest.raises(BackendError):
        Lock(unreachable, "job:metrics:down").acquire()
    after = sample(registry, "dlock_store_errors_total", backend="redis", operation="acquire")
    assert after == before + 1
    unreachable.close()
    lease_holder = Holder.current(task_name="t.lost")
    lease = Lock(backend_from_url("memory://metrics-lost"), "job:x", holder=lease_holder)
    held = lease.acquire()
    lost_before = sample(registry, "dlock_leases_lost_total", task="t.lost")
    report_lost(held, None, " in a test", backend="memory://")
    assert sample(registry, "dlock_leases_lost_total", task="t.lost") == lost_before + 1
    lease.release()


def test_the_janitor_counts_what_it_reaps(registry: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/locks"
    process, _lease = spawn_holder(url, "job:metrics:crashed")
    kill(process)
    before = sample(registry, "dlock_reaped_total", reason="disconnected")
    backend = backend_from_url(url)
    assert reap(backend)["disconnected"] == 1
    assert sample(registry, "dlock_reaped_total", reason="disconnected") == before + 1


def test_off_nothing_is_counted(registry: Any, tmp_path: Path) -> None:
    metrics.disable()
    backend = FileBackend(str(tmp_path / "locks"))
    before = sample(registry, "dlock_releases_total", task="t.off", outcome="succeeded")
    lock = Lock(backend, "job:metrics:off", holder=Holder.current(task_name="t.off"))
    lock.acquire()
    lock.release()
    assert sample(registry, "dlock_releases_total", task="t.off", outcome="succeeded") == before
