"""A retry, and a re-queue for a busy body key, send the same logical task again with a
countdown: "a retry keeps the mark", and ``dedupe_ttl`` is what a mark lives past its
message's countdown. The mark lived ``dedupe_ttl`` past the first send only: a retry with
a countdown longer than that (a gateway down: ``self.retry(countdown=600)`` a few times),
or a message re-queued while the key stays busy past it (a long sync), outlived its mark,
and a duplicate was queued beside it. The mark now lives ``dedupe_ttl`` past each re-send's
countdown too, no longer than the message's ``expires`` (plus ``EXPIRY_GRACE``), and is
never shortened by it. A real embedded worker, on a real store; the countdowns are long,
so the re-sent message waits in the worker while the test reads the mark."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from celery import Celery
from celery.signals import task_retry

from celery_dlock import Lock, LockedTask
from celery_dlock.celery.dedupe import EXPIRY_GRACE, mark_key
from celery_dlock.celery.settings import backend_for
from tests.celery.support import embedded_worker
from tests.celery.test_dedupe_retry_race import WAIT, app

__all__ = ["app"]  # the fixture: an app on the lock store, for an embedded worker

pytestmark = pytest.mark.slow

#: The task's own dedupe_ttl: far shorter than the countdowns of its re-sends.
SHORT = 5.0
LATER = 3600.0


def _mark_after_the_re_send(app: Celery, task: Any, who: str, **options: Any) -> float:
    """Send ``task`` for ``who``; once its first attempt has re-sent it, the seconds its
    mark has left."""
    retried = threading.Event()

    def a_ended(sender: Any, **_: Any) -> None:
        if getattr(sender, "name", None) == task.name:
            retried.set()

    task_retry.connect(a_ended, weak=False)
    try:
        with embedded_worker(app, pool="solo"):
            sent = task.apply_async((who,), **options)
            assert retried.wait(WAIT), "the task was not re-sent"
    finally:
        task_retry.disconnect(a_ended)
    mark = backend_for(app).get(mark_key(f"job:sync:{who}", task.name))
    assert mark is not None and mark.holder.task_id == sent.id and mark.expires_at is not None
    return mark.expires_at - time.time()


def test_a_retry_keeps_its_mark_for_its_countdown(app: Celery) -> None:
    @app.task(
        base=LockedTask,
        bind=True,
        lock_key="sync:{who}",
        dedupe="until_finished",
        dedupe_ttl=SHORT,
        shared=False,
    )
    def sync(self: Any, who: str) -> None:
        raise self.retry(countdown=LATER)

    left = _mark_after_the_re_send(app, sync, uuid.uuid4().hex[:10])
    assert LATER + SHORT - 10 < left < LATER + SHORT + 1, f"the mark ends in {left:.0f} s"


@pytest.mark.parametrize("mode", ["until_started", "until_finished"])
@pytest.mark.parametrize("expires", [None, 60.0])
def test_a_message_re_queued_for_a_busy_key_keeps_its_mark_for_its_backoff(
    app: Celery, mode: str, expires: float | None
) -> None:
    @app.task(
        base=LockedTask,
        lock_key="sync:{who}",
        dedupe=mode,
        dedupe_ttl=SHORT,
        lock_retry_backoff=LATER,  # re-queued in LATER / 2 .. LATER
        lock_retry_backoff_max=LATER,
        shared=False,
    )
    def sync(who: str) -> None: ...

    who = uuid.uuid4().hex[:10]
    with Lock(backend_for(app), f"job:sync:{who}"):  # the body's key is busy
        left = _mark_after_the_re_send(app, sync, who, expires=expires)
    if expires is None:
        assert LATER / 2 + SHORT - 10 < left < LATER + SHORT + 1, f"the mark ends in {left:.0f} s"
    else:  # the re-queued message expires with the first: no longer than that
        assert expires + EXPIRY_GRACE - 10 < left < expires + EXPIRY_GRACE + 1, left
