"""``metrics.collector``: the sum of a multiprocess directory written by real processes,
read past the empty file a process leaves when it is killed between creating its file and
sizing it (prometheus_client's stock collector fails the whole scrape on it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from celery_dlock import metrics

prometheus_client = pytest.importorskip("prometheus_client")

#: A process of its own: prometheus_client picks multiprocess mode at import, from the
#: environment, so the test process (its values in memory) cannot write the directory.
WRITER = textwrap.dedent(
    """
    import sys
    from celery_dlock import Holder, Lock, metrics
    from celery_dlock.backends.file import FileBackend

    metrics.enable()
    backend = FileBackend(sys.argv[1])
    for _ in range(int(sys.argv[2])):
        lock = Lock(backend, "job:metrics:dir", holder=Holder.current(task_name="t.dir"))
        lock.acquire()
        lock.release()
    """
)


def write(directory: Path, store: Path, releases: int) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    subprocess.run(
        [sys.executable, "-c", WRITER, str(store), str(releases)], env=env, check=True, timeout=60
    )


def scrape(directory: Path) -> float | None:
    registry = prometheus_client.CollectorRegistry()
    metrics.collector(registry, path=str(directory))
    labels = {"task": "t.dir", "outcome": "succeeded"}
    return registry.get_sample_value("dlock_releases_total", labels)


def test_the_sum_of_every_process_is_read_past_an_empty_file(tmp_path: Path) -> None:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    write(directory, tmp_path / "locks", 3)
    write(directory, tmp_path / "locks", 2)
    assert scrape(directory) == 5
    # What a process killed between creating its file and sizing it leaves behind.
    (directory / "counter_4194303.db").touch()
    (directory / "histogram_4194303.db").touch()
    assert scrape(directory) == 5
    write(directory, tmp_path / "locks", 1)
    assert scrape(directory) == 6


def test_without_a_directory_it_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR"):
        metrics.collector()
