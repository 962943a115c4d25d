"""A soft time limit that comes after the body ended, while its lock is being released: the
release and its record are not cut (``celery_dlock.celery.softlimit``). On a real prefork
worker the release is held up while the body runs (a row lock on the lease's row in
Postgres, the ``flock`` of its key's file in the file store), so that the soft limit's
SIGUSR1 comes in the middle of it. In this process, as in a pool child (billiard's SIGUSR1
handler, the main thread), the memory store's clock sends the signal from inside a call."""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery
from celery.signals import task_prerun

import celery_dlock
from celery_dlock import LockedTask, critical, install
from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.backends.naming import file_name
from celery_dlock.celery import signals, softlimit
from celery_dlock.celery.settings import backend_for
from celery_dlock.records import Outcome
from tests.celery.prefork import Worker, settled
from tests.celery.test_worker_death import started_body
from tests.support import eventually
from tests.support.cuts import arm_cut
from tests.support.poolchild import pool_child
from tests.support.services import row_locked

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
    with row_locked(store.schema, key):
        yield


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


class SignalClock:
    """A wall clock that, once armed, sends this process SIGUSR1 when next read: from inside
    the store call that reads it."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self) -> float:
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGUSR1)
        return time.time()


__all__ = ["pool_child"]  # the fixture: this process as a pool child's


@pytest.mark.usefixtures("pool_child")
def test_in_a_pool_child_a_soft_limit_is_held_back_in_the_release_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = SignalClock()
    url = f"memory://soft-{uuid.uuid4().hex[:8]}"
    store = MemoryBackend.from_url(url, clock=clock)
    app = Celery("soft", set_as_current=False)
    app.conf.update(dlock_backend=url)
    install(app, janitor=False)

    @app.task(shared=False, base=LockedTask, name="s.pay", lock_key="pay:{n}", once=True)
    def pay(n: int, limit_in_body: bool = False) -> str:
        if limit_in_body:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1)  # the limit's exception comes first
        clock.armed = True  # the next read of the store's clock: in the release
        return f"paid {n}"

    with caplog.at_level(logging.WARNING, logger="celery_dlock.task"):
        assert pay(1) == "paid 1"
    assert clock.armed is False, "the store's clock was not read in the release"
    [record] = store.history(key="job:pay:1")
    assert record.outcome is Outcome.SUCCEEDED
    assert store.get("job:pay:1") is None
    kept = store.last_success("job:pay:1", "s.pay")  # once: kept, so never run again
    assert kept is not None and kept.lease.token == record.lease.token
    [line] = [r for r in caplog.records if "soft time limit of s.pay" in r.getMessage()]
    assert getattr(line, "event", None) == "soft_limit_held"
    with pytest.raises(SoftTimeLimitExceeded):  # in the body, the limit still raises
        pay(2, limit_in_body=True)
    [failed] = store.history(key="job:pay:2")
    assert (failed.outcome, failed.problem) == (
        Outcome.FAILED,
        "billiard.exceptions.SoftTimeLimitExceeded",
    )
    clock.armed = False
    with pytest.raises(SoftTimeLimitExceeded):  # and after the task, once let through
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)


def plain_app(name: str) -> Celery:
    """An app whose first task puts the guard in place, as in a new pool child."""
    app = Celery(name, set_as_current=False)
    app.conf.update(dlock_backend=f"memory://{name}-{uuid.uuid4().hex[:8]}")
    install(app, janitor=False)
    task_prerun.connect(signals._guard_from_the_first_task, weak=False)
    return app


@pytest.mark.usefixtures("pool_child")
def test_in_a_pool_child_any_first_task_puts_the_guard_in_place() -> None:
    """A plain task (one that takes ``celery_dlock.lock`` itself, say) as a child's first:
    from then on a soft limit inside a store's step that must not be cut waits for its end
    (``celery_dlock.critical``). The handler that does it goes after the first task."""
    app = plain_app("soft-first")  # its handler connected, as in a new child

    @app.task(shared=False, name="s.plain")
    def plain() -> int:
        return 1

    assert not critical.state.guarded
    assert plain.apply().get() == 1
    assert softlimit._guard.installed is True
    assert critical.state.guarded
    handler = signals._guard_from_the_first_task  # connected strongly: kept as it is
    assert all(receiver is not handler for _, receiver in task_prerun.receivers)


@pytest.mark.usefixtures("pool_child")
def test_a_region_left_open_is_closed_as_the_next_task_starts() -> None:
    """An interrupt that is not a soft limit, right after a store's step began its region,
    leaves it open: a soft limit is then held back (pending) until the next task starts,
    which starts the count again, so that its own limit is raised where it comes."""
    url = f"memory://soft-{uuid.uuid4().hex[:8]}"
    app = Celery("soft-region", set_as_current=False)
    app.conf.update(dlock_backend=url)
    install(app, janitor=False)

    @app.task(shared=False, base=LockedTask, name="s.region", lock_key="region:{n}")
    def region(n: int, limit_in_body: bool = False) -> int:
        if limit_in_body:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1)  # the limit's exception comes first
        return n

    assert region(1) == 1  # the guard in place
    critical.enter()  # a region no one will leave
    os.kill(os.getpid(), signal.SIGUSR1)  # held back: its region never ends
    assert critical.state.pending is not None
    with pytest.raises(SoftTimeLimitExceeded):  # the next task's own limit, in its body
        region(2, limit_in_body=True)
    assert critical.state.depth == 0 and critical.state.pending is None


class Cycle:
    """An object in a reference cycle, whose finalizer the garbage collector calls: the
    soft limit comes while it runs, and it goes on to its end."""

    ended = False

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs here, in the finalizer
        Cycle.ended = True


@pytest.mark.usefixtures("pool_child")
def test_a_soft_limit_that_comes_inside_a_finalizer_is_raised_once_it_has_returned(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python prints an exception raised in a ``__del__`` and drops it: a soft limit there
    (the garbage collector calls finalizers wherever the main thread is) would be lost, and
    the body would run on to the hard limit. The guard sends it again after; once the task
    has ended, it is dropped instead of cutting whatever the child does next. (Sent again
    after 0.3 s here, not 5 ms, so that a body that returns at once ends first.)"""
    monkeypatch.setattr(softlimit, "_AGAIN", 0.3, raising=False)  # absent before the guard
    app = plain_app("soft-finalizer")
    reached: list[str] = []

    @app.task(shared=False, name="s.final")
    def final(then: str) -> str:
        Cycle()
        if then == "leave":
            return "ended"
        gc.collect()
        if then == "return":
            return "ended"
        time.sleep(2)  # the limit, sent again, comes here
        reached.append("slept")
        return "ran on"

    def dropped() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if getattr(r, "event", None) == "soft_limit_dropped"
        ]

    failed = final.apply(("wait",))
    assert isinstance(failed.result, SoftTimeLimitExceeded)
    assert Cycle.ended, "the limit was raised inside the finalizer, and lost"
    assert reached == [], "the limit never came to the body"
    with caplog.at_level(logging.WARNING, logger="celery_dlock.task"):
        Cycle.ended = False
        assert final.apply(("return",)).get() == "ended"  # ended before it is sent again
        [late] = eventually(dropped, "the limit sent again, dropped")
        assert "after its task had ended" in late
        caplog.clear()
        Cycle.ended = False
        assert final.apply(("leave",)).get() == "ended"  # its Cycle is collected after it
        gc.collect()  # no task runs: the limit is not sent again
        assert Cycle.ended
        [outside] = dropped()
        assert "outside any task" in outside
    assert softlimit._guard.again is None


#: Where the limit comes as a plain task's ``with`` block ends: the store, the keys, and the
#: function on whose way in it comes (the first call after the block's body).
ENDS: dict[str, tuple[str, int, Any]] = {
    "Lock.__exit__": ("memory", 1, celery_dlock.Lock.__exit__),
    "Locks.__exit__": ("memory", 2, celery_dlock.Locks.__exit__),
    # inside the file store's step of the first key's release (a region: held back until
    # the step ends, then sent again after the release, not raised before the second key)
    "file store step": ("file", 2, FileBackend._ours),
}


@pytest.mark.parametrize("where", sorted(ENDS))
@pytest.mark.usefixtures("pool_child")
def test_a_soft_limit_as_a_with_block_ends_lets_its_release_end(where: str, tmp_path: Path) -> None:
    """A plain task's ``with celery_dlock.lock(...)``: a soft limit that comes as the block
    ends, on the way into ``__exit__`` (a Python function: the interpreter runs a signal's
    handler on the way into any) or while the release runs, would leave a lease held (and
    renewed) for as long as the exception is kept. The release ends, every key; the limit
    is raised after it, in the task."""
    kind, keys, function = ENDS[where]
    app = plain_app("soft-with")
    if kind == "file":
        app.conf.update(dlock_backend=f"file://{tmp_path / 'locks'}")
    store = backend_for(app)
    names = [f"job:with:{n}" for n in range(keys)]
    armed: list[list[str]] = []

    @app.task(shared=False, name="s.with")
    def hold() -> None:
        with celery_dlock.lock(names if keys > 1 else names[0], backend=store, ttl=30):
            armed.append(arm_cut(function, signal.SIGUSR1))  # fires after the body
        sys.setprofile(None)
        time.sleep(1)  # the limit, sent again, comes here

    failed = hold.apply()
    assert armed == [[function.__code__.co_qualname]]
    assert isinstance(failed.result, SoftTimeLimitExceeded)
    for name in names:
        assert store.get(name) is None
        [record] = store.history(key=name)
        assert record.outcome is Outcome.SUCCEEDED
    store.close()
