"""A retry of an ``until_finished`` task whose message has ``expires``, taken by another
worker before the retrying attempt has bounded the mark to that expiry.

The attempt that retries (A) sends the retry's message, then, on its way out, bounds the
mark to the message's ``expires`` (plus ``EXPIRY_GRACE``): a retry's message that nobody
takes must not block the key for ``dedupe_ttl``. A worker (B) can take that message in
between and lengthen the mark to ``dedupe_ttl`` as it takes it; A's bound came after it
and cut the mark of the running retry back to the expiry: the mark ended while B ran, and
a duplicate could be queued behind it (the same two-writer race as the producer's
hand-over). Here one embedded worker with a pool of two threads runs A and B at once, on
a real store, held at the chosen points with events: B holds the body lock before A bounds
the mark, or B took the message (lengthened) but takes the body lock only after A's look.
The mark must outlive ``expires`` while B runs, either way; and with no worker taking the
retry's message, the bound still applies."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import after_task_publish, task_retry

from celery_dlock import LockedTask, Outcome
from celery_dlock.celery.dedupe import EXPIRY_GRACE, mark_key
from celery_dlock.celery.settings import backend_for, forget_settings
from celery_dlock.process import release_all
from tests.celery.support import embedded_app, embedded_worker

pytestmark = pytest.mark.slow

DEDUPE_TTL = 3600.0
EXPIRES = 30.0
WAIT = 20.0


@pytest.fixture
def app(lock_url: str) -> Iterator[Celery]:
    """An app on the lock store, with a backend of its own: the process's shared one of
    ``lock_url`` may have had its lock session cut by a test that restarted the server
    (its next acquire then fails, by design). Leases this process still holds on it when
    the test ends (a task that retries keeps its body lease for the retry) are released,
    so that no later test of this process finds them among its own."""
    if lock_url.startswith("postgres"):
        lock_url += f"&application_name=dedupe-{uuid.uuid4().hex[:8]}"
    app = embedded_app(
        "dedupe-retry-race",
        lock_url,
        dlock_dedupe_ttl=DEDUPE_TTL,
        worker_hijack_root_logger=False,
    )
    yield app
    backend = backend_for(app)
    release_all(Outcome.ABANDONED, None, "left by a dedupe test", backend=backend)
    if lock_url.startswith("postgres"):
        backend.close()
    forget_settings(app)


class Race:
    """The events that hold A and B at the chosen points, and what B saw."""

    def __init__(self, where: str | None) -> None:
        self.where = where  # "held": B holds the body lock; "taken": B took the message
        self.b_there = threading.Event()
        self.a_done = threading.Event()
        self.b_done = threading.Event()
        self.lives: list[float] = []

    def b_reached(self, point: str) -> None:
        """B at ``point``: if it is the chosen one, let A go on and wait for A's end."""
        if point == self.where:
            self.b_there.set()
            assert self.a_done.wait(WAIT), "A did not end its attempt"


def _run(app: Celery, race: Race) -> tuple[str, str]:
    """Send the task; A retries, B runs the retry; the mark's key and the task id."""

    def metadata(who: str) -> None:  # called by B after it took the message, before its lock
        if report.request.retries == 1:
            race.b_reached("taken")

    @app.task(
        base=LockedTask,
        bind=True,
        lock_key="report:{who}",
        dedupe="until_finished",
        lock_metadata=metadata,
        shared=False,
    )
    def report(self: Any, who: str) -> None:
        if self.request.retries == 0:
            raise self.retry(countdown=0 if race.where else 3600)
        race.b_reached("held")
        mark = backend_for(app).get(mark_key(f"job:report:{who}", report.name))
        race.lives.append(-1.0 if mark is None else (mark.expires_at or 0.0) - time.time())
        race.b_done.set()

    def a_sent_the_retry(sender: str, headers: dict[str, Any], **_: Any) -> None:
        if sender == report.name and headers.get("retries") and race.where:
            assert race.b_there.wait(WAIT), "B did not take the retry's message"

    def a_ended(sender: Any, **_: Any) -> None:
        if getattr(sender, "name", None) == report.name:
            race.a_done.set()

    who = uuid.uuid4().hex[:10]
    after_task_publish.connect(a_sent_the_retry, weak=False)
    task_retry.connect(a_ended, weak=False)
    try:
        with embedded_worker(app, pool="threads", concurrency=2):
            sent = report.apply_async((who,), expires=EXPIRES)
            assert race.a_done.wait(WAIT), "A did not retry"
            if race.where:
                assert race.b_done.wait(WAIT), "B did not run"
    finally:
        after_task_publish.disconnect(a_sent_the_retry)
        task_retry.disconnect(a_ended)
    return mark_key(f"job:report:{who}", report.name), sent.id


@pytest.mark.parametrize("where", ["held", "taken"])
def test_a_retry_taken_by_another_worker_keeps_its_mark_while_it_runs(
    app: Celery, where: str
) -> None:
    race = Race(where)
    key, task_id = _run(app, race)
    [lives] = race.lives
    assert lives > DEDUPE_TTL - 60, f"the running retry's mark ends in {lives:.0f} s"
    assert backend_for(app).get(key) is None  # B finished: its mark went with it
    assert [r.lease.holder.task_id for r in backend_for(app).history(key=key)] == [task_id]


def test_a_retrys_message_nobody_took_bounds_its_mark_to_its_expiry(app: Celery) -> None:
    race = Race(None)
    key, task_id = _run(app, race)
    mark = backend_for(app).get(key)
    assert mark is not None and mark.holder.task_id == task_id and mark.expires_at is not None
    assert mark.expires_at - time.time() < EXPIRES + EXPIRY_GRACE + 1
