"""The contract of a success that ``once`` must not forget (DESIGN §5): ``remember`` keeps the
first success and never overwrites another lease's (its own lease's it updates),
``Lock.release`` of a lease lost meanwhile keeps its success and records the release as
``lost``, and a later release's success (of the holder that took the key over) does not
replace it, for every store."""

from __future__ import annotations

import asyncio

import pytest

from celery_dlock import AsyncLock, Lock, Outcome, Record
from celery_dlock.backends.base import LockBackend
from celery_dlock.errors import ConfigurationError
from tests.backends.storecase import StoreCase
from tests.backends.test_contract import expire, holder, short_ttl
from tests.support import eventually

TASK = "tasks.charge"


def success_of(backend: LockBackend, key: str, result: object) -> Record:
    """A success record of a lease taken and released as failed (so none is kept yet)."""
    lease = backend.try_acquire(key, holder(TASK), None)
    assert lease is not None
    ended = backend.release(lease, Outcome.FAILED)
    assert ended is not None
    return Record(lease, ended.released_at, Outcome.SUCCEEDED, None, None, result)


def test_remember_keeps_the_first_success_and_never_overwrites_it(backend: LockBackend) -> None:
    first = success_of(backend, "job:first", {"value": "first"})
    second = success_of(backend, "job:first", {"value": "second"})

    assert backend.remember(first) is True
    assert backend.remember(second) is False
    kept = backend.last_success("job:first", TASK)
    assert kept is not None and kept.lease.token == first.lease.token
    assert kept.result == {"value": "first"}
    assert backend.remember(second) is False  # again: still the first's
    assert backend.remember(first) is True  # again (a lost reply): the same, kept once


def test_remember_updates_the_lease_s_own_success_and_only_its_own(backend: LockBackend) -> None:
    """What ``record_success`` kept in a run is that run's to update (a ``Task.replace``
    page keeps its hand-over over the value it committed), as a release updates it."""
    first = success_of(backend, "job:own", {"value": "committed"})
    assert backend.remember(first) is True
    handed = Record(first.lease, first.released_at, Outcome.SUCCEEDED, None, "later", {"value": 2})
    assert backend.remember(handed) is True
    kept = backend.last_success("job:own", TASK)
    assert kept is not None and kept.lease.token == first.lease.token
    assert (kept.result, kept.details) == ({"value": 2}, "later")
    other = success_of(backend, "job:own", {"value": "other"})
    assert backend.remember(other) is False
    again = backend.last_success("job:own", TASK)
    assert again is not None and again.result == {"value": 2}


def test_remember_leaves_the_history_alone(backend: LockBackend) -> None:
    success = success_of(backend, "job:quiet", {"value": 1})
    before = backend.history(key="job:quiet")
    backend.remember(success)
    assert backend.history(key="job:quiet") == before


def test_remember_refuses_what_is_not_a_success_with_a_result(backend: LockBackend) -> None:
    success = success_of(backend, "job:odd", None)
    with pytest.raises(ConfigurationError, match="only a succeeded record with a result"):
        backend.remember(success)
    assert backend.last_success("job:odd", TASK) is None


def lose(store: StoreCase, key: str) -> tuple[Lock, LockBackend]:
    """A Lock of ``TASK`` on ``key`` whose lease expired and was taken by a second client;
    returns the Lock (still thinking it holds) and that client (the new holder)."""
    backend = store.backend
    mine = Lock(backend, key, short_ttl(store), holder=holder(TASK), renew=False)
    lease = mine.acquire()
    expire(store, lease)
    other = store.second()
    # A new client knows the server's clock only to the second of an HTTP Date header at
    # first, so it may need up to that long more to be sure the lease has expired.
    taken = eventually(
        lambda: other.try_acquire(key, holder(TASK), None), f"a second client takes {key}", 10
    )
    assert taken.fence > lease.fence
    return mine, other


def test_a_lost_lease_keeps_its_success_and_is_recorded_lost(store: StoreCase) -> None:
    backend = store.backend
    mine, other = lose(store, "job:lost:ok")
    lease = mine.lease
    assert lease is not None

    assert mine.release(Outcome.SUCCEEDED, result={"value": "charged"}) is None

    kept = backend.last_success("job:lost:ok", TASK)
    assert kept is not None and kept.lease.token == lease.token
    assert kept.result == {"value": "charged"} and kept.outcome is Outcome.SUCCEEDED
    [lost] = backend.history(key="job:lost:ok", outcome=Outcome.LOST)
    assert lost.lease.token == lease.token and lost.problem == "lost"
    assert lost.details is not None
    assert lost.details.startswith("succeeded not recorded: the lease was lost")
    assert "kept for once" in lost.details
    current = other.get("job:lost:ok")  # the new holder is untouched
    assert current is not None and current.token != lease.token


def test_a_lost_success_never_replaces_the_success_kept_before_it(store: StoreCase) -> None:
    backend = store.backend
    mine, other = lose(store, "job:lost:late")
    taken = other.get("job:lost:late")
    assert taken is not None
    winner = other.release(taken, Outcome.SUCCEEDED, result={"value": "winner"})
    assert winner is not None

    assert mine.release(Outcome.SUCCEEDED, result={"value": "late"}) is None

    kept = backend.last_success("job:lost:late", TASK)
    assert kept is not None and kept.lease.token == taken.token
    assert kept.result == {"value": "winner"}
    [lost] = backend.history(key="job:lost:late", outcome=Outcome.LOST)
    assert lost.details is not None and "stays (first wins)" in lost.details


def test_a_lost_failure_is_recorded_lost_with_what_it_could_not_record(store: StoreCase) -> None:
    backend = store.backend
    mine, _ = lose(store, "job:lost:bad")
    lease = mine.lease
    assert lease is not None

    assert mine.release(Outcome.FAILED, "CardDeclined", "card ending 0002 declined") is None

    [lost] = backend.history(key="job:lost:bad", outcome=Outcome.LOST)
    assert lost.lease.token == lease.token
    assert lost.details == (
        "failed not recorded: the lease was lost before its release\n"
        "CardDeclined\ncard ending 0002 declined"
    )
    assert backend.last_success("job:lost:bad", TASK) is None


def test_a_later_success_never_replaces_the_success_a_lost_lease_kept(store: StoreCase) -> None:
    """A's lease is lost and its release keeps its success; B, which took the key over,
    then releases with a success of its own: A's stays (the first wins), and B's release
    is recorded ``succeeded`` with its result in the history all the same."""
    backend = store.backend
    mine, other = lose(store, "job:lost:first")
    first = mine.lease
    assert first is not None
    assert mine.release(Outcome.SUCCEEDED, result={"value": "first"}) is None
    taken = other.get("job:lost:first")
    assert taken is not None

    second = other.release(taken, Outcome.SUCCEEDED, result={"value": "second"})

    assert second is not None and second.result == {"value": "second"}
    for client in (backend, other):
        kept = client.last_success("job:lost:first", TASK)
        assert kept is not None and kept.lease.token == first.token
        assert kept.result == {"value": "first"}
    [recorded] = backend.history(key="job:lost:first", outcome=Outcome.SUCCEEDED)
    assert recorded.lease.token == taken.token and recorded.result == {"value": "second"}


def test_a_later_success_through_the_asyncio_api_never_replaces_the_kept_one(
    store: StoreCase,
) -> None:
    """As above, the later holder an ``AsyncLock`` (the store's own asyncio client where
    it has one: Postgres, Redis)."""
    backend = store.backend
    mine, other = lose(store, "job:lost:aio")
    first = mine.lease
    taken = other.get("job:lost:aio")
    assert first is not None and taken is not None
    assert mine.release(Outcome.SUCCEEDED, result={"value": "first"}) is None
    assert other.release(taken, Outcome.FAILED) is not None

    async def succeed_later() -> Record | None:
        later = AsyncLock(backend, "job:lost:aio", holder=holder(TASK))
        await later.acquire()
        return await later.release(Outcome.SUCCEEDED, result={"value": "later"})

    later = asyncio.run(succeed_later())

    assert later is not None and later.result == {"value": "later"}
    kept = backend.last_success("job:lost:aio", TASK)
    assert kept is not None and kept.lease.token == first.token
    assert kept.result == {"value": "first"}
