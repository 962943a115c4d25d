"""A worker that drops a message without running it (its task name is not registered
there, as when a deploy reached the producers before the workers) ends the message's dedupe
mark, by the token the message carried, recorded ``failed``; the next ``apply_async`` sends
again. Kept, the mark coalesced every later call into the dropped message, whose result is
a ``NotRegistered`` failure, until ``dedupe_ttl`` (an hour by default). An embedded worker
of an app that lacks the task, on a real store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_dlock import LockedTask, Outcome, backend_from_url, install
from celery_dlock.backends.base import LockBackend
from celery_dlock.celery.dedupe import mark_key
from celery_dlock.celery.settings import forget_settings
from tests.celery.support import embedded_app, embedded_worker
from tests.support import eventually

pytestmark = pytest.mark.slow


def app_of(name: str, queue: str, url: str) -> Celery:
    app = embedded_app(name, url, task_default_queue=queue, worker_hijack_root_logger=False)
    install(app, janitor=False)
    return app


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[str, LockBackend]]:
    url = f"file://{tmp_path}/locks"
    with backend_from_url(url) as backend:
        yield url, backend


def test_a_message_of_a_task_the_worker_lacks_ends_its_mark(
    store: tuple[str, LockBackend],
) -> None:
    url, backend = store
    queue = f"dropped-{uuid.uuid4().hex[:8]}"
    producer = app_of("newer-producer", queue, url)
    older_worker = app_of("older-worker", queue, url)  # does not have deploy.sync yet

    @producer.task(
        base=LockedTask, name="deploy.sync", lock_key="sync:{who}", dedupe="until_finished",
        shared=False,
    )  # fmt: skip
    def sync(who: str) -> None: ...

    who = uuid.uuid4().hex[:10]
    key = mark_key(f"job:sync:{who}", "deploy.sync")
    try:
        first = sync.delay(who)
        assert sync.delay(who).id == first.id  # queued: coalesced
        with embedded_worker(older_worker):
            [record] = eventually(lambda: backend.history(key=key) or None, "the mark's end")
        assert record.outcome is Outcome.FAILED and record.problem == "NotRegistered"
        assert record.lease.holder.task_id == first.id
        assert "deploy.sync" in (record.details or "")
        second: Any = sync.delay(who)
        assert second.id != first.id, "coalesced into the message the worker dropped"
        current = backend.get(key)
        assert current is not None and current.holder.task_id == second.id
    finally:
        for app in (producer, older_worker):
            forget_settings(app)


def test_a_message_the_worker_cannot_read_ends_its_mark(store: tuple[str, LockBackend]) -> None:
    """A message whose headers the worker rejects (here an ``eta`` that is no time, as a
    foreign producer might write): ``task_rejected``, the mark ends ``failed``."""
    url, backend = store
    queue = f"unreadable-{uuid.uuid4().hex[:8]}"
    app = app_of("unreadable", queue, url)

    @app.task(
        base=LockedTask, name="deploy.report", lock_key="report:{who}", dedupe="until_started",
        shared=False,
    )  # fmt: skip
    def report(who: str) -> None: ...

    def garble(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == "deploy.report" and isinstance(headers, dict):
            headers["eta"] = "not a time"

    who = uuid.uuid4().hex[:10]
    key = mark_key(f"job:report:{who}", "deploy.report")
    before_task_publish.connect(garble, weak=False)
    try:
        first = report.delay(who)
    finally:
        before_task_publish.disconnect(garble)
    try:
        with embedded_worker(app):
            [record] = eventually(lambda: backend.history(key=key) or None, "the mark's end")
        assert record.outcome is Outcome.FAILED and record.problem == "InvalidTaskError"
        assert record.lease.holder.task_id == first.id
        assert report.delay(who).id != first.id, "coalesced into the message the worker dropped"
    finally:
        forget_settings(app)
