"""Several keys (``lock([...])``, :class:`Locks`) and slots (``lock(key, limit=N)``) outside
Celery, tried as a demanding production user would, on real stores (Postgres, Redis, file)
and memory. Every check reads the store."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import celery_dlock
from celery_dlock import ConfigurationError, Lock, LockLostError, LockNotAcquiredError, Outcome
from celery_dlock.backends.base import LockBackend
from celery_dlock.locks import Locks, lost_lease
from tests.backends import conftest
from tests.support import eventually, force_release

backend = conftest.lock_store  # file, memory, Postgres, Redis


def keys(*names: str) -> list[str]:
    run = uuid.uuid4().hex[:8]
    return [f"job:{name}:{run}" for name in names]


def outcomes(backend: LockBackend, key: str) -> list[Outcome]:
    return [record.outcome for record in reversed(backend.history(key=key, limit=None))]


def test_a_list_of_keys_with_a_limit_is_refused_by_name(backend: LockBackend) -> None:
    """A list takes every key, all or none: a ``limit`` has no meaning there (the task
    option is refused the same way), and must not end in a bare TypeError."""
    with pytest.raises(ConfigurationError, match="limit"):
        celery_dlock.lock(keys("acct", "acct2"), backend, limit=2)


def test_leaving_a_block_whose_second_lease_was_lost_names_that_key(
    backend: LockBackend,
) -> None:
    first, second = sorted(keys("a", "b"))
    both = Locks(backend, [first, second])
    with pytest.raises(LockLostError) as raised, both as leases:
        assert force_release(backend, second, "operator") is not None
    assert raised.value.key == second and raised.value.fence == leases[1].fence
    assert backend.get(first) is None and backend.get(second) is None
    assert outcomes(backend, first) == [Outcome.SUCCEEDED]
    assert outcomes(backend, second) == [Outcome.FORCED, Outcome.LOST]


def test_the_lost_lease_of_a_set_is_the_key_renewal_found_gone(backend: LockBackend) -> None:
    """What a task's LockLostError names (``lost_lease``): the key whose renewal found its
    lease gone, not the set's first key."""
    first, second = sorted(keys("a", "b"))
    both = Locks(backend, [first, second], ttl=0.6)
    leases = both.acquire()
    assert lost_lease(both) == leases[0]  # nothing lost: the first
    try:
        assert force_release(backend, second, "operator") is not None
        eventually(lambda: both.lost, "the renewal of the second key found it gone")
        assert lost_lease(both).key == second
    finally:
        assert both.release() is None  # one lease was lost
    assert backend.get(first) is None
    assert outcomes(backend, first) == [Outcome.SUCCEEDED]
    with pytest.raises(ConfigurationError, match="not held"):
        lost_lease(both)


def test_a_set_whose_second_key_is_busy_keeps_nothing_and_names_the_busy_key(
    backend: LockBackend,
) -> None:
    first, second = sorted(keys("a", "b"))
    other = Lock(backend, second)
    other.acquire()
    with pytest.raises(LockNotAcquiredError) as raised:
        Locks(backend, [second, first]).acquire()
    assert raised.value.key == second
    assert backend.get(first) is None
    assert outcomes(backend, first) == [Outcome.SKIPPED]
    assert backend.get(second) == other.lease
    other.release()


@pytest.mark.xfail(
    strict=True,
    reason="lock.py: a Lock counts only the slots of its own limit; holders of a larger "
    "limit's slots (a deploy that lowered it, another caller) are not counted",
)
@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 1)])
def test_holders_of_slots_beyond_a_lowered_limit_still_count(
    backend: LockBackend, before: int, after: int
) -> None:
    """At most ``limit`` holders at once per key: a deploy that lowers ``lock_limit`` (3 to
    2, or 2 to 1 to serialise the key) must not let a new holder in while ``after`` holders
    of the old deploy still run on their slots (here: every slot but ``#0``)."""
    [key] = keys("export")
    old = [Lock(backend, key, limit=before) for _ in range(before)]
    for lock in old:
        lock.acquire()
    [zero] = [lock for lock in old if lock.lease is not None and lock.lease.key == f"{key}#0"]
    zero.release()
    running = old[0].holders()
    assert sorted(lease.key for lease in running) == [f"{key}#{n}" for n in range(1, before)]
    assert len(running) == after
    new = Lock(backend, key, limit=after)
    try:
        taken = new.attempt()
        assert taken is None, f"{after} holders on {key}'s slots, and {taken.key} taken too"
    finally:
        for lock in [new, *old]:
            if lock.lease is not None:
                lock.release()


def test_waiting_on_a_busy_second_key_does_not_take_and_record_the_first_again_and_again(
    backend: LockBackend,
) -> None:
    """A set that waits while its second key stays busy: the first key is taken once,
    released (``skipped``) once, and not taken again on every wake-up while the key found
    busy is still held (each take wrote a record and a fence on the free key, and kept it
    from its own users for a moment: a waiter of minutes wrote hundreds of records)."""
    first, second = sorted(keys("a", "b"))
    other = Lock(backend, second)
    other.acquire()
    try:
        with pytest.raises(LockNotAcquiredError) as raised:
            Locks(backend, [first, second]).acquire(wait=3)
        assert raised.value.key == second
    finally:
        other.release()
    assert backend.get(first) is None
    assert outcomes(backend, first) == [Outcome.SKIPPED]
    assert outcomes(backend, second) == [Outcome.SUCCEEDED]
    with Locks(backend, [second, first]) as leases:  # free again: both taken
        assert [lease.key for lease in leases] == [first, second]


CLI = "import sys; from celery_dlock.cli import main; sys.argv[0] = 'celery-dlock'; main()"


def test_releasing_a_key_held_in_slots_names_its_slots(tmp_path: Path) -> None:
    """An operator sees ``job:export:<tenant> is busy`` in a task's log (busy tasks log the
    key, not the slot) and runs ``celery-dlock release job:export:<tenant>``: it should say
    where the key is held, not only that it has no lease (exit 1), which reads as free."""
    url = f"file://{tmp_path / 'locks'}"
    [key] = keys("export")
    pool = Lock(url, key, limit=2)
    held = pool.acquire()
    try:
        done = subprocess.run(
            [sys.executable, "-c", CLI, "--backend", url, "release", key, "--force"],
            capture_output=True, text=True, check=False, timeout=60,
            env={**os.environ, "NO_COLOR": "1"},
        )  # fmt: skip
        assert done.returncode == 1  # nothing released: the slot's lease is untouched
        assert pool.backend.get(held.key) == held
        assert held.key in done.stdout + done.stderr
    finally:
        pool.release()


def test_alock_of_several_keys_takes_all_or_none(backend: LockBackend) -> None:
    """``lock([...])`` takes several keys, all or none; its asyncio counterpart ``alock``
    should too (a transfer in an async service), with what a cancelled acquire leaves
    held tried next."""
    first, second = sorted(keys("a", "b"))

    async def transfer() -> list[str]:
        async with celery_dlock.alock([second, first], backend) as leases:
            return [lease.key for lease in leases]

    assert asyncio.run(transfer()) == [first, second]
    assert outcomes(backend, first) == outcomes(backend, second) == [Outcome.SUCCEEDED]


def test_a_skipped_set_records_each_key_once(backend: LockBackend) -> None:
    """A set whose second key is busy, skipped (``on_locked="skip"`` does this): the first
    key, taken and let go by the try, has that one ``skipped`` record, not a second one from
    ``record_skip``; the busy key has one."""
    first, second = sorted(keys("a", "b"))
    blocker = Lock(backend, second)
    blocker.acquire()
    try:
        both = Locks(backend, [first, second])
        with pytest.raises(LockNotAcquiredError):
            both.acquire(wait=0)
        both.record_skip("locked", "held by the blocker")
        assert outcomes(backend, first) == [Outcome.SKIPPED]
        assert [r.fence for r in backend.history(key=second, limit=None)] == [0]
    finally:
        blocker.release()
