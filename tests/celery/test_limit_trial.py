"""``lock_limit`` tried as a demanding production user would: real prefork workers of
``tests.celery.limit_trial_app`` on a Redis broker, the Redis lock store (leases live by
their ttl, 600 s here: nothing in a test waits it out), real SIGKILLs, and the CLI an
operator reads. Every check reads the store or the ledger the bodies write."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import Lock, Outcome
from tests.celery.prefork import Worker, running
from tests.celery.support import own_store
from tests.support import eventually, force_release

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


class LimitWorker(Worker):
    """A prefork worker of ``tests.celery.limit_trial_app``."""

    module = "limit_trial_app"


@pytest.fixture(scope="module")
def trial(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[LimitWorker]:
    with (
        own_store("redis", "limit", ttl=600) as url,
        running(tmp_path_factory.mktemp("limit"), redis_url, url, LimitWorker) as worker,
    ):
        yield worker


def new_run() -> str:
    return uuid.uuid4().hex[:8]


def slots(key: str) -> list[str]:
    return [f"{key}#0", f"{key}#1"]


def events(worker: Worker, run: str, event: str | None = None) -> list[dict[str, Any]]:
    return [e for e in worker.events() if e["run"] == run and event in (None, e["event"])]


def started(worker: Worker, run: str, count: int) -> list[dict[str, Any]]:
    """The first ``count`` ``start`` events of ``run``, once written."""

    def look() -> list[dict[str, Any]] | None:
        found = events(worker, run, "start")
        return found[:count] if len(found) >= count else None

    return eventually(look, f"{count} bodies of {run} started")


def go(worker: Worker, run: str) -> None:
    """Let the bodies of ``run`` end."""
    (worker.ledger.parent / f"go-{run}").touch()


def hold_slot(worker: Worker, key: str, slot: int) -> Lock:
    """A holder of this process on ``key#slot`` of ``key``'s two: a ``Lock(limit=2)``, as
    another service of the same tenant takes it (both slots are taken, the other let go)."""
    first, second = Lock(worker.store, key, limit=2), Lock(worker.store, key, limit=2)
    first.acquire()
    second.acquire()
    kept, other = (first, second) if first.lease.key == f"{key}#{slot}" else (second, first)
    other.release()
    return kept


def at_most_two_at_once(worker: Worker, run: str) -> int:
    """The most bodies of ``run`` between their start and end at once, by ledger order."""
    now = most = 0
    for event in events(worker, run):
        now += 1 if event["event"] == "start" else -1 if event["event"] == "end" else 0
        most = max(most, now)
    return most


# -- defects --------------------------------------------------------------------------------


def test_a_redelivery_ends_its_dead_attempts_slot_while_the_other_slot_is_held(
    trial: LimitWorker,
) -> None:
    """acks_late + reject_on_worker_lost under ``lock_limit=2``: the child is SIGKILLed in
    the body on slot ``#1`` while another holder has ``#0``. The message comes back with
    no signal to the worker's parent, and the dead attempt's lease lives by its ttl. As with
    ``lock_limit=1`` (tests/celery/test_pools_trial.py), the redelivery must find its own
    dead attempt's lease, end it (``disconnected``) and run, not be skipped as if another
    run held both slots: the work was never done, and the slot stays held for 600 s."""
    run = new_run()
    key = f"job:late:{run}"
    other = hold_slot(trial, key, 0)
    try:
        (trial.ledger.parent / f"kill-{run}").touch()
        trial.tasks.late.delay(run, 0).get(timeout=60)
        [dead] = started(trial, run, 1)
        assert dead["key"] == f"{key}#1"
        left = trial.store.get(f"{key}#1")
        assert left is None, f"the dead attempt still holds its slot: {left}"
        ended = trial.history(f"{key}#1")  # hold_slot may have taken and let go #1 first
        assert [r.outcome for r in ended if r.lease.holder.task_id == dead["id"]] == [
            Outcome.DISCONNECTED,
            Outcome.SUCCEEDED,
        ]
        assert len(events(trial, run, "end")) == 1  # the redelivery ran the body
    finally:
        other.release()
        force_release(trial.store, f"{key}#1", "test cleanup")


def test_history_of_a_limit_key_shows_its_slots_after_a_run_was_skipped(
    trial: LimitWorker,
) -> None:
    """Two runs hold the tenant's two slots, a third is skipped (``on_locked="skip"``).
    README: ``history --key K`` of a key taken with a limit shows its slots' records. The
    skip is recorded on the bare key (it held no slot): that record must not hide the
    slots' records of the two runs that did the work."""
    run = new_run()
    key = f"job:export:{run}"
    first, second = (trial.tasks.skip.delay(run, 30) for _ in range(2))
    started(trial, run, 2)
    assert trial.tasks.skip.delay(run, 0).get(timeout=60) is None
    go(trial, run)
    done = sorted(result.get(timeout=60)["key"] for result in (first, second))
    assert done == slots(key)
    assert [r.outcome for r in trial.history(key)] == [Outcome.SKIPPED]
    more = ["--key", key, "--json"]
    shown = subprocess.run(
        [str(BIN / "celery-dlock"), "--backend", trial.env["DLOCK_TEST_LOCKS"], "history", *more],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    found = sorted((r["key"], r["outcome"]) for r in json.loads(shown.stdout)["records"])
    assert found == [
        (key, "skipped"),
        (f"{key}#0", "succeeded"),
        (f"{key}#1", "succeeded"),
    ]


# -- what held ------------------------------------------------------------------------------


def test_a_third_run_is_requeued_until_a_slot_frees_and_never_runs_beside_two(
    trial: LimitWorker,
) -> None:
    """``on_locked="retry"``: two runs hold both slots, a third is re-queued (no body) until
    they end, then runs on a slot; never three bodies at once; each slot's fences increase."""
    run = new_run()
    key = f"job:export:{run}"
    results = [trial.tasks.queue.delay(run, 30) for _ in range(2)]
    started(trial, run, 2)
    third = trial.tasks.queue.delay(run, 0)
    eventually(
        lambda: (
            any(r.outcome is Outcome.SKIPPED for r in trial.history(key))
            or "re-queued" in trial.log.read_text()
        ),
        "the third run re-queued",
    )
    assert len(events(trial, run, "start")) == 2
    go(trial, run)
    answers = [result.get(timeout=60) for result in [*results, third]]
    assert {answer["key"] for answer in answers} <= set(slots(key))
    assert at_most_two_at_once(trial, run) == 2
    for slot in slots(key):
        fences = [r.fence for r in trial.history(slot)]
        assert fences == sorted(set(fences))
        assert trial.store.get(slot) is None


def test_a_retry_keeps_its_slot_and_it_counts_towards_the_limit_meanwhile(
    trial: LimitWorker,
) -> None:
    """``self.retry(countdown=...)`` keeps the slot for the retry: during the countdown a
    second run gets the other slot, a third is skipped; the retry takes its own slot back."""
    run = new_run()
    key = f"job:export:{run}"
    retried = trial.tasks.retrying.delay(run, 3)
    [first] = started(trial, run, 1)
    kept = eventually(lambda: trial.store.get(first["key"]), "the slot kept for the retry")
    assert kept.holder.task_id == retried.id
    other = trial.tasks.skip.delay(run, 30)
    eventually(lambda: len(events(trial, run, "start")) >= 2, "a second run started")
    assert trial.tasks.skip.delay(run, 0).get(timeout=60) is None  # both slots taken
    answer = retried.get(timeout=60)
    assert answer["key"] == first["key"]
    go(trial, run)
    assert other.get(timeout=60)["key"] != first["key"]
    assert [trial.store.get(slot) for slot in slots(key)] == [None, None]


def test_revoke_with_terminate_releases_the_runs_slot_as_revoked(trial: LimitWorker) -> None:
    """``revoke(terminate=True)`` of a run holding a slot: the worker's parent ends that
    slot's lease (``revoked``) and leaves the other run's slot alone."""
    run = new_run()
    key = f"job:export:{run}"
    victim, bystander = (trial.tasks.skip.delay(run, 30) for _ in range(2))
    starts = started(trial, run, 2)
    mine = next(e for e in starts if e["id"] == victim.id)
    theirs = next(e for e in starts if e["id"] == bystander.id)
    victim.revoke(terminate=True)
    record = eventually(lambda: next(iter(trial.history(mine["key"])), None), "the slot's record")
    assert (record.outcome, record.lease.token) == (Outcome.REVOKED, mine["token"])
    assert trial.store.get(theirs["key"]).token == theirs["token"]
    go(trial, run)
    assert bystander.get(timeout=60)["token"] == theirs["token"]
    assert [trial.store.get(slot) for slot in slots(key)] == [None, None]


def test_a_hard_time_limit_frees_the_runs_slot_and_leaves_the_other(trial: LimitWorker) -> None:
    """``time_limit=1`` on a ``lock_limit=2`` task whose body runs 30 s: the pool kills the
    child, and its slot's lease ends (``revoked`` or ``disconnected``, by its token) while
    another run's slot stays held by that run."""
    run = new_run()
    key = f"job:export:{run}"
    bystander = trial.tasks.skip.delay(run, 30)
    [theirs] = started(trial, run, 1)
    killed = trial.tasks.slow.delay(run, 30)
    with pytest.raises(Exception, match=r"TimeLimitExceeded|WorkerLostError"):
        killed.get(timeout=60)
    mine = next(e for e in events(trial, run, "start") if e["id"] == killed.id)
    assert mine["key"] != theirs["key"]
    record = eventually(lambda: next(iter(trial.history(mine["key"])), None), "the slot's record")
    assert record.lease.token == mine["token"]
    assert record.outcome in (Outcome.REVOKED, Outcome.DISCONNECTED)
    assert trial.store.get(mine["key"]) is None
    assert trial.store.get(theirs["key"]).token == theirs["token"]
    go(trial, run)
    assert bystander.get(timeout=60)["token"] == theirs["token"]
    assert [trial.store.get(slot) for slot in slots(key)] == [None, None]
