"""The janitor: reaping, its singleton lock, pruning, its beat entry in every configuration
order (Celery 5.7 reads ``beat_schedule`` when beat starts, whichever order the app was
configured in), and beat triggering it against a real prefork worker."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dlock import Holder, Outcome, install
from celery_dlock.backends.file import FileBackend
from celery_dlock.reap import JANITOR_TASK, janitor_key, reap
from celery_dlock.records import Lease
from tests.celery.prefork import HERE, running
from tests.support import eventually
from tests.support.holders import kill, spawn_holder


def dead_holder_lease(url: str, key: str) -> Lease:
    """A lease held by a process that we then SIGKILL."""
    process, lease = spawn_holder(url, key)
    kill(process)
    return lease


def test_reap_clears_dead_holders_and_counts_them(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/locks"
    backend = FileBackend(str(tmp_path / "locks"))
    dead = [dead_holder_lease(url, f"job:dead:{n}") for n in range(3)]
    live = backend.try_acquire("job:live", Holder.current(), None)
    assert live is not None
    counts = reap(backend, batch=2)
    assert counts == {
        "reaped": 3,
        "disconnected": 3,
        "expired": 0,
        "pruned": 0,
        "marks": 0,
        "skipped": 0,
        "quiet": 0,
    }
    for lease in dead:
        assert backend.get(lease.key) is None
    held = backend.get("job:live")
    assert held is not None and held.token == live.token
    [record] = backend.history(key=janitor_key("job"))
    assert record.outcome is Outcome.SUCCEEDED and record.result == counts


def test_reap_is_bounded_per_run(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/locks"
    backend = FileBackend(str(tmp_path / "locks"))
    for n in range(5):
        dead_holder_lease(url, f"job:dead:{n}")
    assert reap(backend, batch=2, max_batches=2)["reaped"] == 4
    assert reap(backend, batch=2, max_batches=2)["reaped"] == 1


def test_a_second_janitor_does_nothing_while_one_runs(tmp_path: Path) -> None:
    backend = FileBackend(str(tmp_path / "locks"))
    dead_holder_lease(f"file://{tmp_path}/locks", "job:dead")
    running = backend.try_acquire(janitor_key("job"), Holder.current(), None)
    assert running is not None
    assert reap(backend)["skipped"] == 1
    assert backend.get("job:dead") is not None  # untouched
    backend.release(running, Outcome.SUCCEEDED)
    assert reap(backend)["reaped"] == 1


def test_reap_prunes_history_past_retention(tmp_path: Path) -> None:
    backend = FileBackend(str(tmp_path / "locks"))
    lease = backend.try_acquire("job:old", Holder.current(), None)
    assert lease is not None
    backend.release(lease, Outcome.SUCCEEDED)
    assert reap(backend, retention=3600.0)["pruned"] == 0
    # A negative retention puts the cut-off in the future: everything before now goes.
    assert reap(backend, retention=-86400.0 * 2)["pruned"] >= 2
    assert backend.history(key="job:old") == []


def _entry(app: Celery) -> Any:
    app.loader.import_default_modules()
    return app.conf.beat_schedule.get(JANITOR_TASK)


class Config:
    dlock_backend = "memory://janitor-config"
    dlock_janitor_interval = 7.0


@pytest.mark.parametrize(
    "order",
    [
        "install-then-config",
        "config-then-install",
        "install-then-update",
        "configured-install-reconfigure",
    ],
)
def test_the_beat_entry_survives_every_configuration_order(order: str) -> None:
    app = Celery(f"order-{order}", set_as_current=False)
    if order == "install-then-config":
        install(app)
        app.config_from_object(Config)
    elif order == "config-then-install":
        app.config_from_object(Config)
        app.conf.beat_schedule  # noqa: B018 - configures the app
        install(app)
    elif order == "install-then-update":
        install(app)
        app.conf.update(dlock_backend="memory://x", dlock_janitor_interval=7.0, beat_schedule={})
    else:
        app.conf.beat_schedule  # noqa: B018
        install(app)
        app.config_from_object(Config)
    entry = _entry(app)
    assert entry is not None, order
    assert entry["task"] == JANITOR_TASK
    assert entry["schedule"] == 7.0


def test_install_twice_registers_one_task(tmp_path: Path) -> None:
    app = Celery("twice", set_as_current=False)
    app.conf.dlock_backend = f"file://{tmp_path}/locks"
    install(app)
    install(app)
    app.finalize()
    assert JANITOR_TASK in app.tasks
    assert list(app.conf.beat_schedule) == [JANITOR_TASK]


def test_the_janitor_task_runs_reap_with_the_app_settings(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/locks"
    app = Celery("janitor-task", set_as_current=False)
    app.conf.update(dlock_backend=url, task_always_eager=True, dlock_namespace="pay")
    install(app)
    dead_holder_lease(url, "pay:order:1")
    started = time.time()
    counts = app.tasks[JANITOR_TASK].delay().get()
    assert counts["reaped"] == 1 and counts["disconnected"] == 1
    backend = FileBackend(str(tmp_path / "locks"))
    [record] = backend.history(key="pay:celery_dlock.janitor")
    assert record.released_at >= started


@pytest.mark.slow
def test_beat_triggers_the_janitor_which_reaps_a_dead_holder(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    # A holder that was SIGKILLed outside any worker: only the janitor can clear it.
    process, orphan = spawn_holder(lock_url, "job:orphan")
    kill(process)
    since = time.time() - 1  # the session's store may hold earlier tests' janitor runs
    with running(tmp_path, redis_url, lock_url, DLOCK_TEST_JANITOR="1") as janitor_worker:
        env = janitor_worker.env
        beat_args = [
            sys.executable, "-m", "celery", "-A", "workerapp", "beat",
            "--schedule", str(tmp_path / "beat-schedule"), "--max-interval", "1",
            "--loglevel=INFO",
        ]  # fmt: skip
        with open(tmp_path / "beat.log", "ab") as log:
            beat = subprocess.Popen(beat_args, env=env, stdout=log, stderr=log, cwd=HERE)
        try:
            runs = eventually(
                lambda: [
                    r
                    for r in janitor_worker.history("job:celery_dlock.janitor")
                    if r.outcome is Outcome.SUCCEEDED and r.released_at >= since
                ],
                "a janitor run sent by beat",
                timeout=60,
            )
        finally:
            beat.terminate()
            beat.wait(timeout=30)
        reaped = [r for r in janitor_worker.history("job:orphan") if r.lease.token == orphan.token]
        assert [r.outcome for r in reaped] == [Outcome.DISCONNECTED]
        assert sum(run.result["reaped"] for run in runs) >= 1
        assert "Sending due task celery_dlock.janitor" in (tmp_path / "beat.log").read_text()
