"""A soft time limit that comes after the body ended, while its lock is being released: the
release and its record are not cut (``celery_dlock.celery.softlimit``). Here the release is
held up while the body runs (a row lock on the lease's row in Postgres, the ``flock`` of
its key's file in the file store), so that the soft limit's SIGUSR1 comes in the middle of
it, on a real prefork worker."""

from __future__ import annotations

import fcntl
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.naming import file_name
from celery_dlock.records import Outcome
from tests.celery.prefork import Worker, settled
from tests.celery.test_worker_death import started_body
from tests.support.services import postgres_admin

#: The task's soft time limit (tests/celery/workerapp.py: its body takes 1 s).
SOFT_LIMIT = 2.0


@contextmanager
def release_held_up(worker: Worker, key: str) -> Iterator[None]:
    """The store's release of ``key`` waits until the block ends."""
    store = worker.store
    if isinstance(store, FileBackend):
        path = Path(store.directory) / "locks" / file_name(key)
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
        return
    admin = postgres_admin()
    try:
        with admin.transaction():
            locks = f'"{store.schema}".locks'
            admin.execute(f"SELECT FROM {locks} WHERE key = %s FOR UPDATE", (key,))
            yield
    finally:
        admin.close()


@pytest.mark.slow
def test_a_soft_time_limit_that_comes_while_the_lock_is_released_does_not_cut_it(
    worker: Worker,
) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:soft-release:{order}"
    result = worker.tasks.soft_release.delay(order)
    body = started_body(worker, key)
    seen = time.time()  # the body started before this, its soft limit's clock too
    with release_held_up(worker, key):
        ended = [e for e in worker.events() if e["event"] == "end" and e["id"] == result.id]
        assert ended == [], "the body ended before the release was held up"
        time.sleep(max(0.0, seen + SOFT_LIMIT + 1.0 - time.time()))
    assert result.get(timeout=30)["fence"] == body["fence"]
    [record] = worker.history(key)
    assert (record.outcome, record.lease.token) == (Outcome.SUCCEEDED, body["token"])
    assert worker.store.get(key) is None
    kept = worker.store.last_success(key, "w.soft_release")
    assert kept is not None and kept.lease.token == body["token"]
    assert f"the soft time limit of w.soft_release[{result.id}] came after" in (
        worker.log.read_text()
    ), "the soft limit did not come during the release: the test proved nothing"
    settled(worker)
