"""The contract of ``LockBackend.hand_over`` on every store: a lease handed over lives by
its ttl alone, whatever becomes of the process that took it (a dedupe mark is held on
behalf of a queued message, not of the producer that sent it)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from celery_dlock.records import Outcome
from tests.backends.storecase import StoreCase
from tests.backends.test_contract import expire, holder, needs_processes, short_ttl
from tests.support import eventually
from tests.support.holders import kill, spawn_holder

#: Long enough that nothing in the test outlives it by accident.
HANDED_TTL = 3600.0


def test_a_lease_handed_over_outlives_its_killed_process_until_its_ttl(
    store: StoreCase,
) -> None:
    url = needs_processes(store)
    backend = store.backend
    process, handed = spawn_holder(url, "job:handed", None, hand_over=HANDED_TTL)
    kill(process)  # its lock session, its pid: gone
    time.sleep(0.5)  # for the server to see the session end
    assert backend.try_acquire("job:handed", holder(), None) is None
    assert backend.reap() == []  # the janitor leaves it alone: not expired
    held = backend.get("job:handed")
    assert held is not None and held.token == handed.token and held.fence == handed.fence
    place = backend.wait("job:handed", 0.2)  # no session to wait on: returns, no error
    try:
        assert backend.try_acquire("job:handed", holder(), None, place=place) is None
    finally:
        if place is not None:
            place.leave()
    # By token, from another process. On a server's clock, 3 s: a renewal whose answer
    # came after its ttl ran out grants nothing (an object store's write took a second
    # once, under the full suite, and the 1 s renewal returned None).
    ttl = short_ttl(store) if store.clock is not None else 3.0
    shortened = backend.renew(handed, ttl)
    assert shortened is not None
    expire(store, shortened)
    taken = eventually(lambda: backend.try_acquire("job:handed", holder(), None), "takeover")
    assert taken.fence > handed.fence
    [record] = [r for r in backend.history(key="job:handed") if r.lease.token == handed.token]
    assert record.outcome is Outcome.EXPIRED


def test_a_lease_handed_over_is_released_by_its_token(store: StoreCase) -> None:
    backend = store.backend
    lease = backend.try_acquire("job:handed-release", holder(), None)
    assert lease is not None
    handed = backend.hand_over(lease, HANDED_TTL)
    assert handed is not None and handed.token == lease.token and handed.fence == lease.fence
    assert handed.expires_at is not None
    assert HANDED_TTL - 60 < handed.expires_at - time.time() < HANDED_TTL + 60
    record = backend.release(lease, Outcome.DEQUEUED, None, "started")
    assert record is not None and record.outcome is Outcome.DEQUEUED
    assert backend.get("job:handed-release") is None
    again = backend.try_acquire("job:handed-release", holder(), None)
    assert again is not None  # nothing of it stays behind


def test_hand_over_never_shortens_a_lease_but_renew_does(store: StoreCase) -> None:
    """A worker that took a dedupe mark's message lengthens the mark to ``dedupe_ttl``,
    sometimes before the producer hands it over for the message's shorter ``expires``: the
    later, shorter hand-over keeps the longer expiry. Before, it cut it to the shorter."""
    backend = store.backend
    lease = backend.try_acquire("job:handed-longer", holder(), 60)
    assert lease is not None and lease.expires_at is not None
    longer = backend.hand_over(lease, HANDED_TTL)
    assert longer is not None and longer.expires_at is not None
    assert longer.expires_at > lease.expires_at + HANDED_TTL - 120
    later = backend.hand_over(lease, 30)
    assert later is not None and later.expires_at == pytest.approx(longer.expires_at, abs=0.002)
    held = backend.get("job:handed-longer")
    assert held is not None and held.token == lease.token
    assert held.expires_at == pytest.approx(longer.expires_at, abs=0.002)
    shortened = backend.renew(lease, 30)
    assert shortened is not None and shortened.expires_at is not None
    assert shortened.expires_at < longer.expires_at - HANDED_TTL + 120
    again = backend.get("job:handed-longer")
    assert again is not None and again.expires_at == pytest.approx(shortened.expires_at, abs=0.002)


def test_hand_over_if_unchanged_sets_the_expiry_of_a_lease_untouched_since_seen(
    store: StoreCase,
) -> None:
    backend = store.backend
    lease = backend.try_acquire("job:handed-untouched", holder(), 60)
    assert lease is not None and lease.expires_at is not None
    handed = backend.hand_over(lease, HANDED_TTL, if_unchanged=True)
    assert handed is not None and handed.expires_at is not None
    assert handed.expires_at > lease.expires_at + HANDED_TTL - 120
    held = backend.get("job:handed-untouched")
    assert held is not None and held.expires_at == pytest.approx(handed.expires_at, abs=0.002)


def test_hand_over_if_unchanged_keeps_an_expiry_set_since_the_lease_was_seen(
    store: StoreCase,
) -> None:
    """A dedupe mark's producer hands it over after its send; a worker that took the message
    first may have shortened the mark already (to a replacement's ``expires``) or lengthened
    it: either end stands. Before, a late hand-over put back the producer's hour."""
    backend = store.backend
    lease = backend.try_acquire("job:handed-changed", holder(), 60)
    assert lease is not None
    shortened = backend.renew(lease, 30)  # the worker's, first
    assert shortened is not None and shortened.expires_at is not None
    late = backend.hand_over(lease, HANDED_TTL, if_unchanged=True)  # the producer's, late
    assert late is not None and late.token == lease.token
    assert late.expires_at == pytest.approx(shortened.expires_at, abs=0.002)
    held = backend.get("job:handed-changed")
    assert held is not None and held.expires_at == pytest.approx(shortened.expires_at, abs=0.002)
    longer = backend.hand_over(shortened, HANDED_TTL)  # a worker's, from what it read
    assert longer is not None and longer.expires_at is not None
    assert longer.expires_at > shortened.expires_at + HANDED_TTL - 120
    assert backend.hand_over(lease, 5, if_unchanged=True) is not None
    kept = backend.get("job:handed-changed")
    assert kept is not None and kept.expires_at == pytest.approx(longer.expires_at, abs=0.002)
    again = backend.hand_over(kept, 7200, if_unchanged=True)  # seen as it is: it is set
    assert again is not None and again.expires_at is not None
    assert again.expires_at > longer.expires_at + 3000


def test_a_renewal_renews_whatever_expiry_its_lease_object_names(store: StoreCase) -> None:
    """Only a hand-over ``if_unchanged`` looks at the expiry it was given: a renewal from a
    lease object whose expiry is not the stored one (none, here) renews all the same. On
    Redis the hand-over's condition once leaked into every renewal of such an object."""
    backend = store.backend
    lease = backend.try_acquire("job:renew-any", holder(), 30)
    assert lease is not None
    renewed = backend.renew(dataclasses.replace(lease, expires_at=None), 600)
    assert renewed is not None and renewed.expires_at is not None
    held = backend.get("job:renew-any")
    assert held is not None and held.expires_at == pytest.approx(renewed.expires_at, abs=0.002)
    assert lease.expires_at is not None and held.expires_at > lease.expires_at + 500


def test_a_lease_handed_over_unchanged_after_a_renewal_outlives_its_killed_process(
    store: StoreCase,
) -> None:
    """A hand-over that keeps the expiry a renewal set still hands the lease over: it no
    longer lives or dies with its process or lock session, but by that expiry."""
    url = needs_processes(store)
    backend = store.backend
    key = "job:handed-after-renewal"
    process, handed = spawn_holder(url, key, 60, hand_over=HANDED_TTL, renew_first=40)
    assert handed.expires_at is not None and handed.expires_at < time.time() + 41
    kill(process)
    time.sleep(0.5)  # for the server to see the session end
    assert backend.try_acquire(key, holder(), None) is None
    assert backend.reap() == []  # alive by its ttl: not disconnected
    held = backend.get(key)
    assert held is not None and held.token == handed.token
    assert held.expires_at == pytest.approx(handed.expires_at, abs=0.002)


def test_hand_over_of_a_lease_no_longer_ours_is_none(store: StoreCase) -> None:
    backend = store.backend
    lease = backend.try_acquire("job:handed-gone", holder(), None)
    assert lease is not None
    assert backend.release(lease, Outcome.SUCCEEDED) is not None
    assert backend.hand_over(lease, HANDED_TTL) is None


def test_hand_over_without_a_ttl_is_refused(store: StoreCase) -> None:
    backend = store.backend
    lease = backend.try_acquire("job:handed-no-ttl", holder(), None)
    assert lease is not None
    with pytest.raises(ValueError, match="hand_over needs a ttl"):
        backend.hand_over(lease, None)  # type: ignore[arg-type]
    held = backend.get("job:handed-no-ttl")
    assert held is not None and held.expires_at == lease.expires_at  # unchanged
