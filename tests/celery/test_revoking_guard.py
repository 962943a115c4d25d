"""A revoke's lookup of dedupe marks (``revoking.release_marks_of``, what every worker runs
when a revoke reaches it) against the guard another revoker holds beside a mark while it
decides: the guard is not a mark. Found in review: it matched ``#queued:`` in the guard's
key (``<mark key>#revoking``), held for the same task id, and was released ``revoked``
under its decider, which a worker starting that message then no longer waited for."""

from __future__ import annotations

import threading
import time
import uuid

from celery import Celery

from celery_dlock import Holder, LockedTask
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.celery import dedupe, revoking
from celery_dlock.celery.settings import backend_for
from celery_dlock.testing import FakeClock


def test_a_revokers_guard_is_not_taken_for_a_mark() -> None:
    """The other revoker has released the mark and is about to revoke the task: its guard
    is all that is left, and stays its own until it is done."""
    app = Celery("revoking-guard", set_as_current=False)
    app.conf.update(dlock_backend=f"memory://revoking-guard-{uuid.uuid4().hex[:8]}")

    @app.task(base=LockedTask, lock_key="customer:{cid}", dedupe="until_started", shared=False)
    def sync(cid: int) -> None: ...

    backend = backend_for(app)
    task_id = str(uuid.uuid4())
    holder = Holder.current(task_id=task_id, task_name=sync.name)
    guard_key = dedupe.mark_key("job:customer:7", sync.name) + revoking.REVOKING
    other = backend.try_acquire(guard_key, holder, 30)
    assert other is not None

    assert revoking.release_marks_of(app, {task_id}) == []
    assert backend.get(guard_key) == other
    assert backend.history(key=guard_key) == []


def test_a_mark_whose_guard_ran_out_while_the_revoker_waited_is_left() -> None:
    """A revoker takes the guards of the revoked marks one after another, waiting while
    another revoker holds one (a revoker that died holding it: until its ttl). Its first
    guards could run out meanwhile, and a worker starting such a message then saw no guard
    and ran the body, whose mark the revoker then released: a body running without its
    mark. Each guard is renewed before the decision now; a mark whose guard ran out is
    left to the worker (the store's clock here is moved past the guards' ttl)."""
    clock = FakeClock()
    url = f"memory://revoking-guard-{uuid.uuid4().hex[:8]}"
    backend = MemoryBackend.from_url(url, clock=clock)
    app = Celery("revoking-guard", set_as_current=False)
    app.conf.update(dlock_backend=url)

    @app.task(base=LockedTask, lock_key="customer:{cid}", dedupe="until_started", shared=False)
    def sync(cid: int) -> None: ...

    ids = [str(uuid.uuid4()) for _ in range(2)]
    keys = [dedupe.mark_key(f"job:customer:{n}", sync.name) for n in (1, 2)]
    marks = [
        backend.try_acquire(key, Holder.current(task_id=task_id, task_name=sync.name), 3600)
        for key, task_id in zip(keys, ids, strict=True)
    ]
    dead = Holder.current(task_id=ids[1], task_name=sync.name)
    left = backend.try_acquire(keys[1] + revoking.REVOKING, dead, revoking.REVOKING_TTL)
    assert None not in marks and left is not None

    def the_dead_revokers_guard_runs_out() -> None:
        time.sleep(0.3)  # the revoker holds the first guard and waits for the second
        clock.advance(revoking.REVOKING_TTL + 1)
        backend.reap()  # recorded expired: the waiter is woken

    runs_out = threading.Thread(target=the_dead_revokers_guard_runs_out)
    runs_out.start()
    try:
        released = revoking.release_marks_of(app, set(ids))
    finally:
        runs_out.join()
    assert [record.key for record in released] == [keys[1]]
    assert backend.get(keys[1]) is None
    assert backend.get(keys[0]) == marks[0]  # its guard ran out: left
