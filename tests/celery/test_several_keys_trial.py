"""Several keys (``lock_key=[...]``) tried as a demanding production user would: real
prefork workers of ``tests.celery.several_keys_trial_app``, a Redis broker, the Postgres and
file stores, real SIGKILLs. Every check reads the store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dlock import Lock, LockedTask, LockLostError, Outcome, backend_from_url, install
from tests.celery.prefork import Worker, running
from tests.support import eventually, force_release

pytestmark = pytest.mark.slow


class TrialWorker(Worker):
    """A prefork worker of ``tests.celery.several_keys_trial_app``."""

    module = "several_keys_trial_app"


@pytest.fixture(scope="module")
def trial(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, lock_url: str
) -> Iterator[TrialWorker]:
    with running(tmp_path_factory.mktemp("trial"), redis_url, lock_url, TrialWorker) as worker:
        yield worker


def accounts() -> tuple[str, str, list[str]]:
    """Two new accounts and their keys, sorted."""
    src, dst = f"s{uuid.uuid4().hex[:6]}", f"t{uuid.uuid4().hex[:6]}"
    return src, dst, sorted([f"job:account:{src}", f"job:account:{dst}"])


def outcomes(worker: Worker, key: str) -> list[Outcome]:
    return [record.outcome for record in worker.history(key)]


def started(worker: Worker, task_id: str) -> dict[str, Any]:
    return eventually(
        lambda: next(
            (e for e in worker.events() if e["id"] == task_id and e["event"] == "start"), None
        ),
        f"{task_id} started",
    )


def test_a_child_killed_holding_two_keys_has_both_released_as_disconnected(
    trial: TrialWorker,
) -> None:
    src, dst, keys = accounts()
    (trial.ledger.parent / f"kill-{src}").touch()
    result = trial.tasks.move.delay(src, dst, 0)
    with pytest.raises(Exception, match=r"WorkerLostError|Worker exited"):
        result.get(timeout=60)
    start = started(trial, result.id)
    assert start["keys"] == keys
    for key, token in zip(keys, start["tokens"], strict=True):
        [record] = eventually(lambda key=key: trial.history(key), f"a record of {key}")
        assert trial.store.get(key) is None
        assert (record.outcome, record.lease.token) == (Outcome.DISCONNECTED, token)


def test_an_acks_late_transfer_killed_holding_two_keys_runs_again_on_redelivery(
    trial: TrialWorker,
) -> None:
    src, dst, keys = accounts()
    (trial.ledger.parent / f"kill-{src}").touch()
    assert trial.tasks.move_late.delay(src, dst, 0).get(timeout=90) == keys
    for key in keys:
        assert trial.store.get(key) is None
        assert outcomes(trial, key)[-1] is Outcome.SUCCEEDED
        assert Outcome.DISCONNECTED in outcomes(trial, key)


def test_the_same_account_twice_locks_its_one_key(trial: TrialWorker) -> None:
    src, _, _ = accounts()
    key = f"job:account:{src}"
    assert trial.tasks.move.delay(src, src, 0).get(timeout=60) == [key]
    assert outcomes(trial, key) == [Outcome.SUCCEEDED]


def test_a_busy_second_key_under_skip_lets_the_first_go_and_runs_nothing(
    trial: TrialWorker,
) -> None:
    src, dst, keys = accounts()
    blocker = trial.tasks.move.delay(f"x{dst}", dst, 3)  # holds only dst's key...
    started(trial, blocker.id)
    assert trial.tasks.move.delay(src, dst, 0).get(timeout=60) is None  # ...skipped
    assert blocker.get(timeout=60) is not None
    first = keys[0] if keys[0].endswith(src) else keys[1]
    assert trial.store.get(first) is None
    assert all(outcome is Outcome.SKIPPED for outcome in outcomes(trial, first))
    assert not [e for e in trial.events() if e["id"] != blocker.id and first in e["keys"]]


def test_a_body_that_catches_a_lost_lease_still_releases_the_other_key(
    trial: TrialWorker,
) -> None:
    """on_lock_lost="raise" and a body with a broad ``except Exception`` that returns: the
    task ends with LockLostError; the lost key's lease is gone, but the other key's is held
    and valid, and must be released (recorded) when the body ends, not left held for as
    long as the worker's child lives."""
    src, dst, keys = accounts()
    result = trial.tasks.move_careful.delay(src, dst, True)
    start = started(trial, result.id)
    assert force_release(trial.store, keys[1], "operator") is not None
    with pytest.raises(LockLostError):  # the body returned, with a lease lost meanwhile
        result.get(timeout=60)
    assert [e["event"] for e in trial.events() if e["id"] == result.id] == ["start", "caught"]
    assert trial.store.get(keys[1]) is None
    kept = trial.store.get(keys[0])
    assert kept is None, f"{keys[0]} is still held by {kept}"
    assert [r.lease.token for r in trial.history(keys[0])] == [start["tokens"][0]]


def test_a_lost_second_key_is_the_key_the_lock_lost_error_names(trial: TrialWorker) -> None:
    src, dst, keys = accounts()
    result = trial.tasks.move_careful.delay(src, dst, False)
    started(trial, result.id)
    assert force_release(trial.store, keys[1], "operator") is not None
    with pytest.raises(LockLostError) as raised:
        result.get(timeout=60)
    assert keys[1] in str(raised.value) and keys[0] not in str(raised.value)
    assert trial.store.get(keys[0]) is None
    assert outcomes(trial, keys[0]) == [Outcome.FAILED]
    assert outcomes(trial, keys[1]) == [Outcome.FORCED, Outcome.LOST]


def test_a_duplicate_transfer_under_dedupe_is_not_sent_and_the_mark_ends_with_the_body(
    trial: TrialWorker,
) -> None:
    src, dst, keys = accounts()
    first = trial.tasks.move_queued.delay(src, dst, 1)
    assert trial.tasks.move_queued.delay(src, dst, 0).id == first.id
    assert first.get(timeout=60) == keys
    mark = f"{'+'.join(keys)}#queued:t.move_queued"
    assert trial.store.get(mark) is None
    assert outcomes(trial, mark) == [Outcome.SUCCEEDED]
    assert len([e for e in trial.events() if e["keys"] == keys and e["event"] == "start"]) == 1


def test_a_child_killed_holding_a_slot_has_it_released_as_disconnected(
    trial: TrialWorker,
) -> None:
    tenant = f"e{uuid.uuid4().hex[:6]}"
    slots = [f"job:export:{tenant}#{n}" for n in range(2)]
    (trial.ledger.parent / f"kill-{tenant}").touch()
    result = trial.tasks.export.delay(tenant, 0)
    with pytest.raises(Exception, match=r"WorkerLostError|Worker exited"):
        result.get(timeout=60)
    [slot] = started(trial, result.id)["keys"]
    record = eventually(lambda: next(iter(trial.history(slot)), None), "a record of the slot")
    assert record.outcome is Outcome.DISCONNECTED
    assert [trial.store.get(key) for key in slots] == [None, None]


def test_a_retry_revoked_before_it_runs_releases_the_slot_kept_for_it(
    trial: TrialWorker,
) -> None:
    tenant = f"r{uuid.uuid4().hex[:6]}"
    slots = [f"job:export:{tenant}#{n}" for n in range(2)]
    result = trial.tasks.export.delay(tenant, 0, True)
    [slot] = started(trial, result.id)["keys"]
    kept = eventually(lambda: trial.store.get(slot), "the slot kept for the retry")
    assert kept.holder.task_id == result.id
    result.revoke()
    record = eventually(lambda: next(iter(trial.history(slot)), None), "a record of the slot")
    assert (record.outcome, record.lease.token) == (Outcome.REVOKED, kept.token)
    assert [trial.store.get(key) for key in slots] == [None, None]


def test_a_callable_on_locked_gets_the_busy_key_of_a_set_and_its_holder() -> None:
    """README: ``on_locked`` may be a callable ``(task, key, lease)``. With several keys it
    got ``job:account:1+job:account:2``, which no lease has (an eager run: the same call as
    in a worker)."""
    app = Celery("several-keys-trial-eager", set_as_current=False)
    app.conf.update(task_always_eager=True, dlock_backend="memory://several-keys-trial")
    install(app, janitor=False)
    seen: list[tuple[str, str | None]] = []

    def policy(task: Any, key: str, lease: Any) -> str:
        seen.append((key, None if lease is None else lease.token))
        return "busy"

    @app.task(shared=False, base=LockedTask, name="e.move", on_locked=policy,
              lock_key=["account:{src}", "account:{dst}"])  # fmt: skip
    def move(src: str, dst: str) -> str:
        return "moved"

    src, dst, keys = accounts()
    busy = next(key for key in keys if key.endswith(dst))
    other = Lock(backend_from_url("memory://several-keys-trial"), busy)
    held = other.acquire()
    try:
        assert move.delay(src, dst).get() == "busy"
    finally:
        other.release()
    assert seen == [(busy, held.token)]
