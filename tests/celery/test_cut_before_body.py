"""A LockedTask cut by an exception after it took its lock and before its body ran: a
Celery soft time limit comes as one, wherever the child's main thread is, and the steps
between are store calls (the ``once`` task's read of its kept success, the handshake that
ends an ``until_started`` mark, the lengthening of an ``until_finished`` mark whose message
has ``expires``). The exception went past the body's own ending, so the body lease stayed
held (renewed, for as long as Celery kept the exception's traceback) and the dedupe mark
stayed for its ``dedupe_ttl``: every ``apply_async`` meanwhile returned the failed task.
Now the lease is released ``failed`` with the exception's type, and the mark ended so.

The cut comes at a chosen point (``arm_cut``, armed in the worker's thread as the task
starts), on an embedded worker whose requests carry real headers from the broker."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from celery.signals import task_postrun, task_prerun

from celery_dlock import LockedTask, Outcome
from celery_dlock.celery import dedupe, once, revoking
from celery_dlock.celery.dedupe import mark_key
from celery_dlock.celery.settings import backend_for
from tests.celery.support import embedded_worker
from tests.celery.test_dedupe_retry_race import app
from tests.support.cuts import Cut, arm_cut

__all__ = ["app"]  # the fixture: an app on the lock store (Postgres, file)

WAIT = 20.0
CUT = "tests.support.cuts.Cut"


@contextmanager
def cut_in_task(name: str, function: Callable[..., Any]) -> Iterator[list[list[str]]]:
    """In the worker's thread, the first run of the task ``name`` is cut as ``function``
    starts; yields a list of what each armed cut fired (one run: one list)."""
    armed: list[list[str]] = []

    def arm(sender: Any, **_: Any) -> None:
        if sender.name == name and not armed:
            armed.append(arm_cut(function))

    def disarm(sender: Any, **_: Any) -> None:
        if sender.name == name:
            sys.setprofile(None)

    task_prerun.connect(arm, weak=False)
    task_postrun.connect(disarm, weak=False)
    try:
        yield armed
    finally:
        task_prerun.disconnect(arm)
        task_postrun.disconnect(disarm)


def test_a_once_task_cut_before_its_body_releases_its_lock(app: Celery) -> None:
    ran: list[int] = []

    @app.task(base=LockedTask, lock_key="pay:{n}", once=True, shared=False)
    def pay(n: int) -> int:
        ran.append(n)
        return n

    n = uuid.uuid4().int % 10**9
    key = f"job:pay:{n}"
    backend = backend_for(app)
    with embedded_worker(app), cut_in_task(pay.name, once.kept_success) as armed:
        failed = pay.apply_async((n,))
        with pytest.raises(Cut):
            failed.get(timeout=WAIT)
        assert armed == [[once.kept_success.__qualname__]]
        assert ran == []
        assert backend.get(key) is None, "the body lease is still held"
        [record] = backend.history(key=key)
        assert (record.outcome, record.problem) == (Outcome.FAILED, CUT)
        assert record.lease.holder.task_id == failed.id
        assert pay.apply_async((n,)).get(timeout=WAIT) == n  # the next one runs, and is kept
    assert ran == [n]
    assert backend.last_success(key, pay.name) is not None


@pytest.mark.parametrize(
    ("lifecycle", "where", "expires"),
    [
        ("until_started", revoking.may_start, None),  # the mark ends as the body starts
        ("until_finished", dedupe.extend_mark, 60),  # lengthened as the message is taken
        ("until_finished", revoking.may_start, None),
    ],
    ids=["until_started", "until_finished-expires", "until_finished"],
)
def test_a_task_cut_before_its_body_ends_its_dedupe_mark(
    app: Celery, lifecycle: str, where: Callable[..., Any], expires: int | None
) -> None:
    ran: list[str] = []

    @app.task(base=LockedTask, lock_key="sync:{who}", dedupe=lifecycle, shared=False)
    def sync(who: str) -> None:
        ran.append(who)

    who = uuid.uuid4().hex[:10]
    backend = backend_for(app)
    mark = mark_key(f"job:sync:{who}", sync.name)
    with embedded_worker(app), cut_in_task(sync.name, where) as armed:
        failed = sync.apply_async((who,), expires=expires)
        with pytest.raises(Cut):
            failed.get(timeout=WAIT)
        assert armed == [[where.__qualname__]]
        assert ran == []
        assert backend.get(mark) is None, "the dedupe mark is still held"
        [ended] = backend.history(key=mark)
        assert (ended.outcome, ended.problem) == (Outcome.FAILED, "Cut")
        assert ended.lease.holder.task_id == failed.id
        assert backend.get(f"job:sync:{who}") is None, "the body lease is still held"
        again = sync.apply_async((who,), expires=expires)  # sent: no mark keeps it out
        assert again.id != failed.id
        again.get(timeout=WAIT)
    assert ran == [who]
