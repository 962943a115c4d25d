"""The first renewals' heap stays bounded by the leases held, not by the leases granted
within a ttl / 3: a Renewer stopped before its first renewal (most task runs) used to stay
in it until its turn (20 s with the default 60 s ttl; at 1,000 short tasks/s about 20,000
entries)."""

from __future__ import annotations

import threading

from celery_dlock import Lock, lock
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.records import Lease
from celery_dlock.renewal import _first_renewals
from tests.support import eventually


def heap_size() -> int:
    """Entries in the first renewals' heap, live and stopped."""
    return len(_first_renewals._due)


def renewed(backend: MemoryBackend, lease: Lease) -> Lease:
    """The stored lease of ``lease``'s key, once it expires later than ``lease``."""

    def later() -> Lease | None:
        current = backend.get(lease.key)
        later = current is not None and (current.expires_at or 0) > (lease.expires_at or 0)
        return current if later else None

    return eventually(later, "the lease renewed")


def test_leases_released_before_their_first_renewal_leave_the_heap_bounded() -> None:
    backend = MemoryBackend()
    before = heap_size()
    for n in range(2000):
        with lock(f"job:short:{n}", backend, ttl=600):
            pass
    assert heap_size() <= 2 * before + 1


def test_the_heap_holds_the_leases_held_and_at_most_as_many_stopped() -> None:
    backend = MemoryBackend()
    before = heap_size()
    held = [Lock(backend, f"job:held:{n}", ttl=600) for n in range(100)]
    for one in held:
        one.acquire()
    for n in range(1000):
        with lock(f"job:short:{n}", backend, ttl=600):
            pass
    assert 100 <= heap_size() <= 2 * (before + 100) + 1
    for one in held:
        one.release()
    assert heap_size() <= 2 * before + 1


def test_a_lease_held_past_its_first_renewal_is_still_renewed_after_compactions() -> None:
    """Compaction keeps the live entries: a lease held among many short ones is renewed."""
    backend = MemoryBackend()
    with lock("job:long", backend, ttl=0.6) as lease:
        for n in range(500):
            with lock(f"job:short:{n}", backend, ttl=600):
                pass
        renewed = eventually(
            lambda: (current := backend.get("job:long")) and current.expires_at > lease.expires_at,
            "the lease renewed",
        )
        names = [t.name for t in threading.enumerate() if t.name.startswith("dlock-renew:")]
        assert renewed and names == ["dlock-renew:job:long"]


def test_a_lease_due_before_the_threads_next_wake_is_renewed_in_time() -> None:
    """The heap's thread is woken only by a lease due before it would wake anyway: after
    leases of a 600 s ttl it sleeps for 200 s, and a lease of a 3 s ttl taken then must still
    be renewed within its ttl, not lost."""
    backend = MemoryBackend()
    for n in range(50):
        with lock(f"job:slow:{n}", backend, ttl=600):
            pass
    held = Lock(backend, "job:quick", ttl=3)
    lease = held.acquire()
    try:
        assert renewed(backend, lease).fence == lease.fence and not held.lost
    finally:
        held.release()


def test_a_leases_thread_is_started_before_its_first_renewal_is_due() -> None:
    """Half an interval ahead (``HEAD_START``): a process starting the threads of hundreds
    of leases on a loaded CPU started the last ones past their first renewal, and leases of
    a 3 s ttl expired. The thread is found waiting, the lease not renewed yet."""
    backend = MemoryBackend()
    held = Lock(backend, "job:ahead", ttl=12)  # renewals due every 4 s; the thread from 2 s
    lease = held.acquire()
    try:
        name = "dlock-renew:job:ahead"
        eventually(
            lambda: any(t.name == name for t in threading.enumerate()),
            "the renewal thread started",
            timeout=10,
        )
        current = backend.get("job:ahead")
        assert current is not None and current.expires_at == lease.expires_at
        assert renewed(backend, lease).fence == lease.fence and not held.lost
    finally:
        held.release()
