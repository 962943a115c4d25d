"""``revoke_queued`` against a worker starting that very message, with a real prefork worker
held at the chosen point (``tests.celery.revoke_race_app``): exactly one of them wins. The
revoke wins when the worker has not taken the body lock yet: the mark is released
``revoked``, the body does not run, the task ends ``REVOKED`` and the next call sends again.
The worker wins once it holds the body lock: the body runs under a mark left alone, and
``revoke_queued`` revokes nothing. A worker that finds a revoker deciding waits for it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.states import READY_STATES

from celery_dlock import Holder, Lock, Outcome
from celery_dlock.records import Record
from tests.celery.prefork import Worker, running
from tests.support import eventually

pytestmark = pytest.mark.slow

MODES = {"until_finished": "finished", "until_started": "started"}
#: What a revoker holds beside a mark's key while it decides (``revoking.REVOKING``).
GUARD = "#revoking"


class RaceWorker(Worker):
    module = "revoke_race_app"


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, lock_url: str
) -> Iterator[Worker]:
    with running(tmp_path_factory.mktemp("race"), redis_url, lock_url, RaceWorker) as started:
        yield started


def _customer() -> str:
    return uuid.uuid4().hex[:10]


def _ended(result: Any) -> str:
    """The final state of ``result``, once it has one."""
    return str(eventually(lambda: result.state in READY_STATES and result.state, "an end"))


def _events(worker: Worker, task_id: str, event: str) -> list[dict[str, Any]]:
    return [e for e in worker.events() if e["id"] == task_id and e["event"] == event]


def _pause(worker: Worker, where: str, customer: str) -> Path:
    """Hold the worker at ``where`` for ``customer``'s message; the file that releases it."""
    (worker.ledger.parent / f"pause-{where}-{customer}").touch()
    return worker.ledger.parent / f"go-{customer}"


def _history(worker: Worker, key: str) -> list[Record]:
    return worker.history(key)


@pytest.mark.parametrize("mode", MODES)
def test_a_message_revoked_before_its_worker_holds_the_body_lock_does_not_run(
    worker: Worker, mode: str
) -> None:
    """The child took the message and stands before its body lock: ``revoke_queued`` wins.
    (It used to release the mark and let the body run, unmarked: a duplicate was then
    queued behind a running ``until_finished`` task.)"""
    who = _customer()
    task = getattr(worker.tasks, MODES[mode])
    go = _pause(worker, "taken", who)
    queued = task.delay(who, 0)
    eventually(lambda: _events(worker, queued.id, "paused"), "the child took the message")
    assert task.revoke_queued(who, 0) == queued.id
    mark_key = f"job:race:{who}#queued:{task.name}"
    assert worker.store.get(mark_key) is None
    go.touch()
    assert _ended(queued) == "REVOKED"
    assert _events(worker, queued.id, "start") == []  # the body never ran
    [mark] = _history(worker, mark_key)
    assert mark.outcome is Outcome.REVOKED and mark.lease.holder.task_id == queued.id
    body = eventually(lambda: _history(worker, f"job:race:{who}"), "the body lease's record")
    assert [(r.outcome, r.lease.holder.task_id) for r in body] == [(Outcome.REVOKED, queued.id)]
    again = task.delay(who, 0)  # the next call sends again, and runs
    assert again.id != queued.id
    assert "fence" in again.get(timeout=60)
    assert worker.store.get(f"job:race:{who}") is None


def test_a_worker_holding_the_body_lock_wins_and_revoke_queued_revokes_nothing(
    worker: Worker,
) -> None:
    """The child holds the body lock, its body not started yet: ``revoke_queued`` finds its
    body lease and leaves the ``until_finished`` mark, which ends with the body."""
    who = _customer()
    task = worker.tasks.finished
    go = _pause(worker, "held", who)
    running_ = task.delay(who, 0)
    eventually(lambda: _events(worker, running_.id, "paused"), "the child holds the body lock")
    assert task.revoke_queued(who, 0) is None
    mark_key = f"job:race:{who}#queued:{task.name}"
    mark = worker.store.get(mark_key)
    assert mark is not None and mark.holder.task_id == running_.id
    assert task.delay(who, 0).id == running_.id  # still a duplicate
    go.touch()
    assert "fence" in running_.get(timeout=60)
    [record] = eventually(lambda: _history(worker, mark_key), "the mark's record")
    assert record.outcome is Outcome.SUCCEEDED and record.lease.token == mark.token


@pytest.mark.parametrize("decided", ["revoked", "left"])
def test_a_worker_waits_for_a_revoker_deciding_and_follows_its_decision(
    worker: Worker, decided: str
) -> None:
    """A revoker holds the mark's guard while the worker takes the body lock: the body does
    not start before the revoker decides; then it runs if the mark was left, and does not
    if the mark was released ``revoked`` (as a revoker does that looked before the body
    lease was taken). The test is the revoker here, through the store."""
    who = _customer()
    task = worker.tasks.finished
    mark_key = f"job:race:{who}#queued:{task.name}"
    queued = task.apply_async((who, 0), countdown=1)
    mark = worker.store.get(mark_key)
    assert mark is not None
    guard = Lock(worker.store, mark_key + GUARD, 60, holder=Holder.current(task_id=queued.id))
    guard.acquire()
    try:
        body = eventually(lambda: worker.store.get(f"job:race:{who}"), "the body lock taken")
        assert body.holder.task_id == queued.id
        assert _events(worker, queued.id, "start") == []  # it waits: the guard is held
        if decided == "revoked":
            assert worker.store.release(mark, Outcome.REVOKED) is not None
    finally:
        guard.release()
    if decided == "left":
        assert "fence" in queued.get(timeout=60)
        [record] = eventually(lambda: _history(worker, mark_key), "the mark's record")
        assert record.outcome is Outcome.SUCCEEDED
        return
    assert _ended(queued) == "REVOKED"
    assert _events(worker, queued.id, "start") == []
    [record] = _history(worker, mark_key)
    assert record.outcome is Outcome.REVOKED
