"""A task that locks several keys (``lock_key`` as a list of templates): all or none, in
key order, released together with one record per key; opposite transfers never deadlock and
never overlap on an account. Real prefork worker, Postgres and file stores."""

from __future__ import annotations

import uuid

import pytest

from celery_dlock import Outcome
from tests.celery.prefork import Worker

pytestmark = pytest.mark.slow


def test_opposite_transfers_submitted_at_once_never_deadlock_or_overlap(worker: Worker) -> None:
    one, two = f"a{uuid.uuid4().hex[:6]}", f"b{uuid.uuid4().hex[:6]}"
    transfer = worker.tasks.transfer
    results = [transfer.delay(one, two, n) for n in range(50)]
    results += [transfer.delay(two, one, n) for n in range(50)]
    keys = sorted([f"job:account:{one}", f"job:account:{two}"])
    for result in results:
        assert result.get(timeout=300) == keys  # every transfer ran, holding both accounts
    events = [e for e in worker.events() if e.get("keys") == keys]
    assert len(events) == 200
    for start, end in zip(events[::2], events[1::2], strict=True):  # one at a time
        assert (start["event"], end["event"]) == ("start", "end") and start["id"] == end["id"]
    for key in keys:  # one record per key per transfer
        succeeded = [r for r in worker.history(key) if r.outcome is Outcome.SUCCEEDED]
        assert len(succeeded) == 100
    assert all(worker.store.get(key) is None for key in keys)
