"""A ``Lock.acquire`` cut by an exception after the Lock held its lease and before
``acquire`` returned (a Celery soft time limit comes as one, wherever the main thread is:
here as the renewal thread starts, or as the wait is counted). ``acquire`` raised, so no
caller would release the lease: it stayed held, renewed in the background, for as long as
the exception's traceback kept the Lock (Celery keeps a failed task's), and then was
released ``abandoned`` as garbage. It is now given back at once, recorded ``abandoned``
with the exception's type. The cut comes as a chosen function starts: that function
raises before its first statement (``cut_calls``), as a signal's handler would there."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_dlock import Lock, Locks, Outcome, metrics
from celery_dlock.backends.base import LockBackend
from celery_dlock.renewal import Renewer
from tests.support.cuts import Cut

POINTS: dict[str, tuple[Any, str]] = {
    "as its renewal starts": (Renewer, "start"),
    "as its wait is counted": (metrics, "waited"),
}


def cut_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, after: int = 0) -> list[int]:
    """``owner.name`` raises :class:`Cut` as it starts, from its call ``after + 1`` on, until
    the test ends; the others run it. Returns the count of calls cut, in a list."""
    function, calls, cut = getattr(owner, name), [0], [0]

    def cutting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > after and not cut[0]:
            cut[0] += 1
            raise Cut
        return function(*args, **kwargs)

    monkeypatch.setattr(owner, name, cutting)
    return cut


@pytest.fixture
def backend(lock_store: LockBackend) -> LockBackend:
    return lock_store


@pytest.mark.parametrize("where", sorted(POINTS))
def test_an_acquire_cut_after_the_lease_was_held_gives_it_back(
    backend: LockBackend, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "job:cut-held"
    lock = Lock(backend, key, ttl=30)
    fired = cut_calls(monkeypatch, *POINTS[where])
    with pytest.raises(Cut) as cut:
        lock.acquire()
    assert fired == [1], f"acquire did not pass {where}"
    assert cut.value.__traceback__ is not None  # kept, with the Lock in its frames
    assert lock.lease is None
    assert backend.get(key) is None, "the key is still held"
    [record] = backend.history(key=key)
    assert (record.outcome, record.problem) == (Outcome.ABANDONED, "Cut")
    renewing = [t.name for t in threading.enumerate() if t.name == f"dlock-renew:{key}"]
    assert not renewing, "its renewal thread still runs"
    with lock:  # the Lock takes the key again
        assert backend.get(key) is not None
    assert backend.get(key) is None


@pytest.mark.parametrize("held", [1, 2])
def test_a_locks_acquire_cut_after_a_key_was_held_lets_go_of_what_it_holds(
    backend: LockBackend, held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two keys, all or none: the cut comes as the renewal of the first key's lease starts,
    or of the second's (before ``Locks`` had noted it taken)."""
    keys = ["job:cut-a", "job:cut-b"]
    locks = Locks(backend, keys, ttl=30)
    fired = cut_calls(monkeypatch, Renewer, "start", after=held - 1)
    with pytest.raises(Cut):
        locks.acquire()
    assert fired == [1]
    assert [backend.get(key) for key in keys] == [None, None]
    records = [record for key in keys for record in backend.history(key=key)]
    assert len(records) == held
    assert {(record.outcome, record.problem) for record in records} == {
        (Outcome.FAILED, "tests.support.cuts.Cut")
    }
    with locks:
        assert all(backend.get(key) is not None for key in keys)
