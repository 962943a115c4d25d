"""The janitor under Celery, as a production user configures it: a ``celery beat`` of its
own with a bad ``dlock_janitor_interval`` stops naming the setting (it ran on, never sending
the janitor), and the janitor task with a retention reaching before 1970 prunes nothing
and succeeds (PostgreSQL failed every run on a date out of range)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dlock import Holder, Outcome, backend_from_url, install
from celery_dlock.celery.settings import LONGEST, backend_for
from celery_dlock.reap import JANITOR_TASK, janitor_key
from tests.support.services import POSTGRES_URL, drop_schema, postgres_admin

ROOT = Path(__file__).parent.parent.parent


@pytest.mark.parametrize("interval", ["'30'", "0", "1e12"])
def test_beat_with_a_bad_janitor_interval_stops_naming_the_setting(
    tmp_path: Path, interval: str
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DLOCK_TRIAL_BACKEND": f"file://{tmp_path}/locks",
        "DLOCK_TRIAL_INTERVAL": interval,
    }
    beat = [
        sys.executable, "-m", "celery", "-A", "tests.celery.janitor_trial_app", "beat",
        "--schedule", str(tmp_path / "beat-schedule"), "--max-interval", "1", "-l", "INFO",
    ]  # fmt: skip
    process = subprocess.Popen(beat, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0
    assert b"dlock_janitor_interval" in output


@pytest.fixture
def postgres_url() -> Iterator[str]:
    schema = f"dlock_{uuid.uuid4().hex[:10]}"
    yield f"{POSTGRES_URL}?schema={schema}&auto_migrate=1"
    admin = postgres_admin()
    try:
        drop_schema(admin, schema)
    finally:
        admin.close()


def test_the_janitor_task_with_a_retention_of_100_years_keeps_the_history(
    postgres_url: str,
) -> None:
    backend = backend_from_url(postgres_url)
    try:
        lease = backend.try_acquire("job:kept", Holder.current(), None)
        assert lease is not None
        kept = backend.release(lease, Outcome.SUCCEEDED)
        app = Celery("janitor-trial", set_as_current=False)
        app.conf.update(
            dlock_backend=postgres_url, dlock_history_retention=LONGEST, task_always_eager=True
        )
        install(app)
        task: Any = app.tasks[JANITOR_TASK]
        counts = task.delay().get()
        assert counts["pruned"] == 0
        assert backend.history(key="job:kept") == [kept]
        assert [r.outcome for r in backend.history(key=janitor_key("job"))] == [Outcome.SUCCEEDED]
        backend_for(app).close()  # the app's client of the store: its session ends here
    finally:
        backend.close()
