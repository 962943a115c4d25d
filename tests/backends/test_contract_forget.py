"""The contract of ``forget_success``, an operator's undoing of what ``once`` keeps: only the
success kept by the lease named (by token) goes, the next success is kept anew, the key's
other tasks and a lease held on the key meanwhile are left whole, for every store; and
``celery_dlock.forget`` over it."""

from __future__ import annotations

from typing import Any

from celery_dlock import Outcome, forget
from celery_dlock.backends.base import LockBackend
from celery_dlock.records import Lease, Record
from tests.backends.test_contract import holder

TASK = "tasks.charge"
KEY = "job:order:forget"


def succeed(backend: LockBackend, result: Any, task: str = TASK, key: str = KEY) -> Record:
    """A run of ``task`` on ``key`` that takes the key and releases it as a success."""
    lease = backend.try_acquire(key, holder(task), None)
    assert lease is not None
    record = backend.release(lease, Outcome.SUCCEEDED, None, None, result)
    assert record is not None
    return record


def kept_token(backend: LockBackend, task: str = TASK) -> str | None:
    kept = backend.last_success(KEY, task)
    return None if kept is None else kept.lease.token


def test_only_the_success_of_the_lease_named_is_forgotten(backend: LockBackend) -> None:
    first = succeed(backend, {"charged": 1})
    succeed(backend, {"charged": 2})  # a duplicate's success: not kept, the first wins
    assert kept_token(backend) == first.lease.token

    assert backend.forget_success(KEY, TASK, "not-a-token-that-kept-it") is False
    assert kept_token(backend) == first.lease.token
    assert backend.forget_success(KEY, TASK, first.lease.token) is True
    assert backend.last_success(KEY, TASK) is None
    assert backend.forget_success(KEY, TASK, first.lease.token) is False  # gone already


def test_after_forgetting_the_next_success_is_the_one_kept(backend: LockBackend) -> None:
    first = succeed(backend, {"charged": 1})
    assert backend.forget_success(KEY, TASK, first.lease.token) is True
    second = succeed(backend, {"charged": 2})
    kept = backend.last_success(KEY, TASK)
    assert kept is not None
    assert (kept.lease.token, kept.result) == (second.lease.token, {"charged": 2})
    succeed(backend, {"charged": 3})  # and the first wins again from there on
    assert kept_token(backend) == second.lease.token


def test_another_task_s_success_on_the_key_stays(backend: LockBackend) -> None:
    charge = succeed(backend, {"charged": 1})
    receipt = succeed(backend, {"sent": True}, task="tasks.receipt")
    assert backend.forget_success(KEY, TASK, charge.lease.token) is True
    assert kept_token(backend, "tasks.receipt") == receipt.lease.token
    assert backend.forget_success(KEY, "tasks.receipt", charge.lease.token) is False
    assert kept_token(backend, "tasks.receipt") == receipt.lease.token


def test_a_lease_held_on_the_key_meanwhile_renews_and_releases_as_before(
    backend: LockBackend,
) -> None:
    """On S3 and GCS the success lives in the key's lock object too: forgetting it swaps
    that object under the holder, whose renewal and release must still find their lease."""
    first = succeed(backend, {"charged": 1})
    held = backend.try_acquire(KEY, holder(TASK), 60.0)
    assert held is not None
    assert backend.forget_success(KEY, TASK, first.lease.token) is True
    assert backend.get(KEY) == held

    renewed = backend.renew(held, 60.0)
    assert renewed is not None and renewed.token == held.token
    record = backend.release(renewed, Outcome.SUCCEEDED, None, None, {"charged": 2})
    assert record is not None and record.outcome == Outcome.SUCCEEDED
    assert backend.get(KEY) is None
    kept = backend.last_success(KEY, TASK)
    assert kept is not None
    assert (kept.lease.token, kept.result) == (held.token, {"charged": 2})


def test_forgetting_leaves_the_history_and_other_keys_alone(backend: LockBackend) -> None:
    first = succeed(backend, {"charged": 1})
    other = succeed(backend, {"charged": 9}, key="job:order:other")
    before = [(r.lease.token, r.outcome) for r in backend.history(key=KEY)]
    assert backend.forget_success(KEY, TASK, first.lease.token) is True
    assert [(r.lease.token, r.outcome) for r in backend.history(key=KEY)] == before
    kept = backend.last_success("job:order:other", TASK)
    assert kept is not None and kept.lease.token == other.lease.token


def test_forget_of_a_key_that_never_kept_a_success_is_false(backend: LockBackend) -> None:
    lease: Lease | None = backend.try_acquire(KEY, holder(TASK), None)
    assert lease is not None
    assert backend.release(lease, Outcome.FAILED) is not None
    assert backend.forget_success(KEY, TASK, lease.token) is False
    assert backend.forget_success("job:never", TASK, lease.token) is False


def test_forget_forgets_the_task_and_its_replacements_and_records_it(
    backend: LockBackend,
) -> None:
    """``celery_dlock.forget``, what an app's refund code and ``celery-dlock forget`` call:
    the task's success and those of its replacements go (``NAME (replacement N)``, up to
    the first not kept), the act is one ``forgotten`` record on the key, and another
    task's success stays."""
    charge = succeed(backend, {"value": None, "replaced": {"nesting": 1}})
    page = succeed(backend, {"value": {"pages": 2}}, task=f"{TASK} (replacement 1)")
    after_gap = succeed(backend, {"value": 3}, task=f"{TASK} (replacement 3)")
    other = succeed(backend, {"value": "sent"}, task="tasks.receipt")

    assert forget(backend, KEY, TASK, token="not-the-one-kept") is None
    assert kept_token(backend) == charge.lease.token
    record = forget(backend, KEY, TASK, reason="refund 881", by="ops@shop")
    assert record is not None and record.outcome == Outcome.FORGOTTEN
    assert (record.fence, record.problem) == (0, "forgotten")
    assert record.details is not None
    assert f"kept by fence {charge.fence}" in record.details
    assert f"and those of {TASK} (replacement 1) forgotten by ops@shop" in record.details
    assert record.details.endswith(": refund 881")
    assert backend.last_success(KEY, TASK) is None
    assert backend.last_success(KEY, f"{TASK} (replacement 1)") is None
    assert kept_token(backend, f"{TASK} (replacement 3)") == after_gap.lease.token
    assert kept_token(backend, "tasks.receipt") == other.lease.token
    assert page.lease.token != after_gap.lease.token
    newest = backend.history(key=KEY, limit=1)[0]
    assert (newest.outcome, newest.lease.token) == (Outcome.FORGOTTEN, record.lease.token)
    assert forget(backend, KEY, TASK) is None  # nothing kept now: nothing written
    assert backend.history(key=KEY, limit=1)[0].lease.token == record.lease.token
