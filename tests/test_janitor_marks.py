# ruff: noqa: F811
"""The janitor releases the dedupe marks a store brought back after losing their release
(held for a message that has run), each by its token, recorded ``forced``; no other mark,
and within its bounds: a few marks a run, runs that ended a while ago, granted after the
mark (:mod:`celery_dlock.marks`). On every store, on the real clock."""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import Celery

from celery_dlock import ConfigurationError, Outcome, install
from celery_dlock import marks as marks_module
from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.celery import janitor as janitor_module
from celery_dlock.celery.settings import backend_for, forget_settings
from celery_dlock.reap import JANITOR_TASK, janitor_key, reap
from celery_dlock.records import HANDED_ON, REQUEUE, Lease
from tests.backends.storecase import StoreCase
from tests.support.marks import TASK, body, handed_mark

# ``case`` is the janitor trial's fixture: the tests name it as a parameter (F811).
from tests.test_janitor_trial import ALL, case, stores  # noqa: F401


def _held(backend: LockBackend, mark: Lease) -> bool:
    now = backend.get(mark.key)
    return now is not None and now.token == mark.token


@stores(*ALL)
def test_a_run_releases_the_marks_whose_message_ran_and_no_other(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = case.backend
    monkeypatch.setattr(marks_module, "GRACE", 0.0)
    monkeypatch.setattr(marks_module, "SKEW", 0.5)
    # Task ids used again by a later message, whose mark this is: a run of t10 that ended
    # before the mark, and one of t12 granted before it and ended since.
    body(backend, "job:sync:10", "t10", Outcome.SUCCEEDED)
    earlier = body(backend, "job:sync:12", "t12", None)
    time.sleep(1.0)
    marks = {n: handed_mark(backend, f"job:sync:{n}", f"t{n}") for n in range(1, 13)}
    assert backend.release(earlier, Outcome.SUCCEEDED) is not None
    body(backend, "job:sync:1", "t1", Outcome.SUCCEEDED)  # ran
    body(backend, "job:sync:2", "t2", Outcome.RETRIED)  # goes on under its mark
    body(backend, "job:sync:3", "t3", Outcome.SUCCEEDED)  # ran, and runs again now (a
    body(backend, "job:sync:3", "t3", None)  # redelivery): left to the running body
    # 4: no run of it seen (queued)
    body(backend, "job:sync:5", "t99", Outcome.SUCCEEDED)  # another task id's run
    body(backend, "job:sync:6#1", "t6", Outcome.FAILED)  # on a slot: not looked at here
    # A run that replaced itself (Task.replace): the replacement goes on under its task id.
    body(backend, "job:sync:7", "t7", Outcome.SUCCEEDED, f"{HANDED_ON}{TASK}: its result...")
    body(backend, "job:sync:8", "t8", Outcome.RETRIED)  # retried, then ran
    body(backend, "job:sync:8", "t8", Outcome.SUCCEEDED)
    # A Reject that put its message back (acks_late): it runs again under its mark.
    requeued = body(backend, "job:sync:9", "t9", None)
    backend.release(requeued, Outcome.FAILED, "Reject", f"{REQUEUE}True: Reject(...)")
    body(backend, "job:sync:11", "t11", Outcome.FAILED)  # ran, and failed: ran all the same

    counts = reap(backend, marks=100)

    assert counts["marks"] == 3
    for n, mark in marks.items():
        if n in (1, 8, 11):
            assert not _held(backend, mark), n
            (record,) = backend.history(key=mark.key)
            assert record.outcome is Outcome.FORCED and record.lease.token == mark.token
            assert record.details is not None
            assert f"released by the janitor: its message t{n} had run" in record.details
        else:
            assert _held(backend, mark), n
    [run] = backend.history(key=janitor_key("job"))
    assert run.outcome is Outcome.SUCCEEDED and run.result == counts
    assert reap(backend, marks=100)["marks"] == 0  # nothing more to release


@stores("file", "memory", "postgres", "redis")
def test_a_run_that_ended_within_the_grace_keeps_its_mark_for_the_worker_to_release(
    case: StoreCase,
) -> None:
    """Default grace (300 s): the worker releases an until_finished mark just after its
    body's record; a janitor run between the two must not take that release from it."""
    backend = case.backend
    mark = handed_mark(backend, "job:sync:now", "tnow")
    body(backend, "job:sync:now", "tnow", Outcome.SUCCEEDED)
    assert reap(backend, marks=100)["marks"] == 0
    assert _held(backend, mark)
    assert marks_module.ran_marks(backend, "job:", sample=100, grace=0.0) != []


@stores("memory", "redis")
def test_a_run_looks_at_no_more_marks_than_asked(
    case: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = case.backend
    monkeypatch.setattr(marks_module, "GRACE", 0.0)
    marks = [handed_mark(backend, f"job:sync:{n}", f"t{n}") for n in range(5)]
    for n in range(5):
        body(backend, f"job:sync:{n}", f"t{n}", Outcome.SUCCEEDED)
    assert [reap(backend, marks=2)["marks"] for _ in range(3)] == [2, 2, 1]
    assert not any(_held(backend, mark) for mark in marks)
    assert reap(backend, marks=0)["marks"] == 0


def test_a_quiet_run_that_released_a_mark_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run on the beat schedule that finds no dead lease stays unrecorded (quiet) only
    when it released no mark either."""
    backend = MemoryBackend()
    monkeypatch.setattr(marks_module, "GRACE", 0.0)
    assert reap(backend, quiet_for=3600, marks=100)["quiet"] == 0  # the first run: recorded
    assert reap(backend, quiet_for=3600, marks=100)["quiet"] == 1
    handed_mark(backend, "job:sync:q", "tq")
    body(backend, "job:sync:q", "tq", Outcome.SUCCEEDED)
    counts = reap(backend, quiet_for=3600, marks=100)
    assert (counts["quiet"], counts["marks"]) == (0, 1)
    runs = backend.history(key=janitor_key("job"), limit=None)
    assert [run.result["marks"] for run in runs] == [1, 0]


@pytest.mark.parametrize("value", [-1, True, 2.5, "100"], ids=repr)
def test_a_bad_marks_bound_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"janitor's marks must be an int >= 0"):
        reap(MemoryBackend(), marks=value)
    app = Celery("bad-marks", set_as_current=False)
    app.conf.update(dlock_backend="memory://", dlock_janitor_marks=value)
    install(app)
    with pytest.raises(ConfigurationError, match=r"dlock_janitor_marks must be a whole number"):
        app.tasks[JANITOR_TASK].apply().get()


def test_the_celery_janitor_releases_marks_up_to_its_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(marks_module, "GRACE", 0.0)
    app = Celery("marks", set_as_current=False)
    app.conf.update(dlock_backend="memory://", dlock_janitor_marks=1)
    install(app)
    backend = backend_for(app)
    for n in range(2):
        handed_mark(backend, f"job:sync:c{n}", f"c{n}")
        body(backend, f"job:sync:c{n}", f"c{n}", Outcome.SUCCEEDED)
    janitor = app.tasks[JANITOR_TASK]
    assert janitor.apply().get()["marks"] == 1
    # One look every MARKS_EVERY seconds in a process: the next runs leave the other mark.
    assert [janitor.apply().get()["marks"] for _ in range(3)] == [0, 0, 0]
    assert len(backend.leases("job:")) == 1
    monkeypatch.setattr(janitor_module, "MARKS_EVERY", 0.0)
    app.conf.dlock_janitor_marks = 0
    forget_settings(app)
    assert janitor.apply().get()["marks"] == 0  # turned off
    assert len(backend.leases("job:")) == 1
    app.conf.dlock_janitor_marks = 5
    forget_settings(app)
    assert janitor.apply().get()["marks"] == 1
    assert backend.leases("job:") == []
