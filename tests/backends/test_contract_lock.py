"""The contract through the public :class:`Lock`, on every store: a limited ``wait`` takes a
key freed within it and times out no earlier than it; and a release by a holder whose lease
another client ended (an operator's forced release) never frees that client's new lease,
even where the first client's cache of what it wrote is stale."""

from __future__ import annotations

import gc
import itertools
import threading
import time

import pytest

from celery_dlock import Lease, Lock, LockNotAcquiredError, Locks, LockTimeoutError, Outcome
from tests.backends.storecase import StoreCase
from tests.backends.test_contract import holder

WAIT = 1.0


def test_a_key_freed_within_wait_is_taken(store: StoreCase) -> None:
    backend = store.backend
    first = backend.try_acquire("job:wait:freed", holder(), None)
    assert first is not None
    taken: list[Lease] = []
    waiter = Lock(store.second(), "job:wait:freed", wait=30.0)
    thread = threading.Thread(target=lambda: taken.append(waiter.acquire()), daemon=True)
    thread.start()
    time.sleep(0.3)
    assert taken == []  # still waiting while the key is held
    backend.release(first, Outcome.SUCCEEDED)
    thread.join(timeout=30)
    [lease] = taken
    assert lease.fence > first.fence
    current = backend.get("job:wait:freed")
    assert current is not None and current.token == lease.token
    waiter.release()


def test_a_limited_wait_times_out_no_earlier_than_its_wait(store: StoreCase) -> None:
    held = store.backend.try_acquire("job:wait:held", holder(), None)
    assert held is not None
    waiter = Lock(store.second(), "job:wait:held", wait=WAIT)
    started = time.monotonic()
    with pytest.raises(LockTimeoutError) as info:
        waiter.acquire()
    assert time.monotonic() - started >= WAIT
    assert info.value.wait == WAIT and info.value.key == "job:wait:held"
    current = store.backend.get("job:wait:held")
    assert current is not None and current.token == held.token


def test_a_stale_release_from_another_client_never_frees_the_new_holder(
    store: StoreCase,
) -> None:
    """A holds through client 1; an operator on client 2 ends A's lease (forced) and takes
    the key; A then releases through client 1, which last wrote the key itself."""
    mine = Lock(store.backend, "job:stale:two", holder=holder())
    stale = mine.acquire()
    operator = store.second()
    shown = operator.get("job:stale:two")
    assert shown is not None and shown.token == stale.token
    assert operator.release(shown, Outcome.FORCED, "forced", "by the operator") is not None
    taken = operator.try_acquire("job:stale:two", holder(), None)
    assert taken is not None

    assert mine.release(Outcome.SUCCEEDED) is None

    current = operator.get("job:stale:two")
    assert current is not None and current.token == taken.token
    assert store.backend.get("job:stale:two") == current
    assert operator.try_acquire("job:stale:two", holder(), None) is None  # still held
    outcomes = [r.outcome for r in operator.history(key="job:stale:two")]
    assert outcomes == [Outcome.LOST, Outcome.FORCED]


def test_a_waiters_place_goes_with_it_to_try_acquire_and_is_used_up(store: StoreCase) -> None:
    """``wait`` may return the caller's place in the store's queue of waiters (Postgres);
    whatever it returns is accepted by the next ``try_acquire`` and ``wait`` of the key, an
    acquire uses it up, and leaving it is idempotent."""
    backend = store.backend
    first = backend.try_acquire("job:place", holder(), None)
    assert first is not None
    waiter = store.second()
    release = threading.Timer(0.3, lambda: backend.release(first, Outcome.SUCCEEDED))
    release.start()
    place = None
    taken = None
    deadline = time.monotonic() + 30
    while taken is None and time.monotonic() < deadline:
        place = waiter.wait("job:place", 1.0, place)
        assert place is None or place.key == "job:place"
        taken = waiter.try_acquire("job:place", holder(), None, place=place)
    release.join()
    assert taken is not None and taken.fence > first.fence
    if place is not None:
        assert not place.held  # used up by the acquire
        place.leave()
        place.leave()
    assert waiter.release(taken, Outcome.SUCCEEDED) is not None


def test_a_limit_lets_that_many_hold_at_once_each_in_a_slot_of_its_own(store: StoreCase) -> None:
    """``Lock(..., limit=3)``: a semaphore over slots ``key#0..2``, on every store."""
    locks = [Lock(store.second(), "job:pool", limit=3) for _ in range(4)]
    leases = [lock.attempt() for lock in locks[:3]]
    assert all(leases)
    held = [lease for lease in leases if lease is not None]
    assert sorted(lease.key for lease in held) == ["job:pool#0", "job:pool#1", "job:pool#2"]
    assert len({lease.token for lease in held}) == 3  # fences are per slot, as per key
    assert locks[3].attempt() is None  # a fourth is refused
    assert sorted(lease.token for lease in locks[3].holders()) == sorted(h.token for h in held)
    freed = held[1].key
    assert locks[1].release() is not None
    taken = locks[3].attempt()
    assert taken is not None and taken.key == freed  # the freed slot, and only it
    for lock in (locks[0], locks[2], locks[3]):
        lock.release()
    outcomes = {r.key: r.outcome for r in store.backend.history(limit=None)}
    assert set(outcomes) == {"job:pool#0", "job:pool#1", "job:pool#2"}  # history names the slot


def test_a_waiter_on_a_full_limit_takes_the_first_slot_freed(store: StoreCase) -> None:
    holders = [Lock(store.backend, "job:pool-wait", limit=2) for _ in range(2)]
    for lock in holders:
        assert lock.attempt() is not None
    waiter = Lock(store.second(), "job:pool-wait", wait=30.0, limit=2)
    taken: list[Lease] = []
    thread = threading.Thread(target=lambda: taken.append(waiter.acquire()), daemon=True)
    thread.start()
    time.sleep(0.3)
    assert taken == []
    slot = holders[0].lease.key if holders[0].lease else ""
    holders[0].release()
    thread.join(timeout=30)
    [lease] = taken
    assert lease.key == slot
    waiter.release()
    holders[1].release()


def test_several_keys_are_taken_all_or_none_and_a_partial_take_is_recorded(
    store: StoreCase,
) -> None:
    backend = store.backend
    held = backend.try_acquire("job:acct:2", holder(), None)
    assert held is not None
    both = Locks(store.second(), ["job:acct:2", "job:acct:1"])
    assert both.keys == ("job:acct:1", "job:acct:2")  # always taken in key order
    with pytest.raises(LockNotAcquiredError, match="job:acct:2"):
        both.acquire()
    assert backend.get("job:acct:1") is None  # what was taken went back
    [backed_off] = backend.history(key="job:acct:1")
    assert backed_off.outcome is Outcome.SKIPPED and "job:acct:2" in (backed_off.details or "")
    backend.release(held, Outcome.SUCCEEDED)
    with both as leases:
        assert [lease.key for lease in leases] == ["job:acct:1", "job:acct:2"]
        assert [backend.get(key) for key in both.keys] == leases
    assert [backend.get(key) for key in both.keys] == [None, None]


def test_opposite_sets_never_deadlock_and_never_overlap(store: StoreCase) -> None:
    """Transfers 1->2 and 2->1 from two clients at once: each completes, one at a time."""
    intervals: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def transfers(keys: list[str]) -> None:
        client = store.second()
        try:
            for _ in range(10):
                with Locks(client, keys, wait=60.0):
                    start = time.monotonic()
                    time.sleep(0.002)
                    intervals.append((start, time.monotonic()))
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=transfers, args=(keys,), daemon=True)
        for keys in (["job:acct:a", "job:acct:b"], ["job:acct:b", "job:acct:a"])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    assert len(intervals) == 20
    ordered = sorted(intervals)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))


def test_metadata_is_stored_with_the_lease_and_its_record(store: StoreCase) -> None:
    metadata = {"order": 42, "amount": "19.99", "by": "ops@example.com", "tags": ["éu", None]}
    lock = Lock(store.backend, "job:meta:42", metadata=metadata)
    lease = lock.acquire()
    assert lease.metadata == metadata
    seen = store.second()  # another client reads what the store kept
    current = seen.get("job:meta:42")
    assert current is not None and current.metadata == metadata
    [listed] = [found for found in seen.leases("job:meta:") if found.token == lease.token]
    assert listed.metadata == metadata
    lock.release()
    [record] = seen.history(key="job:meta:42")
    assert record.lease.metadata == metadata and record.outcome is Outcome.SUCCEEDED
    plain = Lock(store.backend, "job:meta:plain")
    plain.acquire()
    held = seen.get("job:meta:plain")
    assert held is not None and held.metadata is None
    plain.release()


def test_a_lock_collected_while_held_frees_its_key_at_once(store: StoreCase) -> None:
    """A Lock dropped while it holds its lease is released as abandoned when collected, on
    stores that watch its session too (the watcher must not keep the Lock alive)."""
    lock = Lock(store.backend, "job:dropped", holder=holder())
    lease = lock.acquire()
    with pytest.warns(ResourceWarning, match="job:dropped.*garbage-collected"):
        del lock
        gc.collect()
    assert store.backend.get("job:dropped") is None
    [record] = store.backend.history(key="job:dropped")
    assert record.outcome is Outcome.ABANDONED and record.lease.token == lease.token
