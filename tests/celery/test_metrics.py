"""Prometheus metrics from a real prefork worker in prometheus_client's multiprocess mode:
scrape, run tasks, SIGKILL a child mid-task, scrape again; the counts are the tasks'."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import metrics
from tests.celery.prefork import Worker, running
from tests.support import eventually

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry  # noqa: E402

pytestmark = pytest.mark.slow


def scrape(directory: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What a scrape of the worker's processes shows: (sample name, labels) -> value."""
    registry = CollectorRegistry()
    metrics.collector(registry, path=str(directory))
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counts_survive_a_sigkilled_child_and_match_the_tasks(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = {"DLOCK_TEST_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    with running(tmp_path, redis_url, lock_url, **env) as worker:
        charged = ("dlock_releases_total", {"task": "w.charge", "outcome": "succeeded"})
        killed = ("dlock_releases_total", {"task": "w.hold", "outcome": "disconnected"})
        assert count(directory, *charged) == 0
        charge(worker, 5)
        before = scrape(directory)
        assert value(before, charged[0], **charged[1]) == 5
        assert value(before, "dlock_held_seconds_count", **charged[1]) == 5
        assert value(before, "dlock_held_seconds_sum", **charged[1]) >= 5 * 0.2
        assert value(before, "dlock_wait_seconds_count", task="w.charge") == 5
        store = {"backend": worker.store.name, "operation": "acquire"}
        assert value(before, "dlock_store_seconds_count", **store) >= 5

        # A child SIGKILLed mid-task: the parent releases its lease as disconnected, and
        # the dead child's own counts stay in its file.
        order = uuid.uuid4().hex[:8]
        held = worker.tasks.hold.delay(order, 60)
        body = eventually(
            lambda: next((e for e in worker.events() if e["key"] == f"job:hold:{order}"), None),
            "the body runs",
        )
        os.kill(body["pid"], signal.SIGKILL)
        with pytest.raises(Exception, match=r"WorkerLostError|SIGKILL|exited"):
            held.get(timeout=60)
        eventually(lambda: count(directory, *killed) == 1, "the disconnected release counted")
        assert count(directory, *charged) == 5
        charge(worker, 3)
        last = scrape(directory)
        assert value(last, charged[0], **charged[1]) == 8
        assert value(last, killed[0], **killed[1]) == 1
        assert value(last, "dlock_wait_seconds_count", task="w.hold") == 1


def count(directory: Path, name: str, labels: dict[str, str]) -> float:
    return value(scrape(directory), name, **labels)


def charge(worker: Worker, orders: int) -> None:
    submitted = [worker.tasks.charge.delay(uuid.uuid4().int % 10**9, 10) for _ in range(orders)]
    for result in submitted:
        result.get(timeout=60)
