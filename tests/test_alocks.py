"""Several keys from asyncio (``alock([...])``, :class:`AsyncLocks`), all or none, on real
stores (Postgres, Redis, file) and memory: what a try leaves, the order of the keys, two
opposite transfers, cancellation at every step of the loop, the records of each key. Every
check reads the store."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable

import pytest

import celery_dlock
from celery_dlock import (
    AsyncLock,
    AsyncLocks,
    ConfigurationError,
    Lease,
    Lock,
    LockLostError,
    LockNotAcquiredError,
    LockTimeoutError,
    Outcome,
)
from celery_dlock.alocks import lost_lease
from celery_dlock.backends.base import LockBackend
from tests.backends import conftest
from tests.support import force_release

backend = conftest.lock_store  # file, memory, Postgres, Redis


def keys(*names: str) -> list[str]:
    run = uuid.uuid4().hex[:8]
    return sorted(f"job:{name}:{run}" for name in names)


def outcomes(backend: LockBackend, key: str) -> list[Outcome]:
    return [record.outcome for record in reversed(backend.history(key=key, limit=None))]


async def until(check: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``check()`` is true (a state the store decides)."""
    async with asyncio.timeout(30):  # a guard against a hang, not a measure
        while not check():
            await asyncio.sleep(0.01)


def test_a_set_whose_second_key_is_busy_holds_nothing_and_names_it(backend: LockBackend) -> None:
    first, second = keys("a", "b")
    other = Lock(backend, second)
    other.acquire()

    async def scenario() -> None:
        with pytest.raises(LockNotAcquiredError) as raised:
            async with celery_dlock.alock([second, first], backend):
                raise AssertionError("entered with a busy key")
        assert raised.value.key == second

    try:
        asyncio.run(scenario())
        assert backend.get(first) is None
        assert backend.get(second) == other.lease
        assert outcomes(backend, first) == [Outcome.SKIPPED]  # taken, and let go at once
    finally:
        other.release()


def test_keys_are_tried_in_sorted_order_whatever_the_order_given(backend: LockBackend) -> None:
    """The first key in sorted order is busy: the set, given last key first, takes nothing
    (had it taken the given order, the last key would have a ``skipped`` record)."""
    first, second, third = keys("a", "b", "c")
    other = Lock(backend, first)
    other.acquire()
    try:
        with pytest.raises(LockNotAcquiredError):
            asyncio.run(AsyncLocks(backend, [third, second, first]).acquire())
        assert outcomes(backend, second) == outcomes(backend, third) == []
    finally:
        other.release()

    async def taken() -> list[str]:
        async with celery_dlock.alock([third, first, second, first], backend) as leases:
            assert [backend.get(lease.key) for lease in leases] == leases
            return [lease.key for lease in leases]

    assert asyncio.run(taken()) == [first, second, third]


def test_a_waiting_set_tries_the_busy_key_first_and_takes_the_others_once(
    backend: LockBackend,
) -> None:
    """Waiting over several steps on a busy second key, the set takes (and lets go, one
    ``skipped`` record) the free first key once, not at every wake-up."""
    first, second = keys("a", "b")
    other = Lock(backend, second)
    other.acquire()
    try:
        with pytest.raises(LockTimeoutError) as raised:
            asyncio.run(AsyncLocks(backend, [first, second], wait=1.2).acquire())
        assert raised.value.key == second
        assert backend.get(first) is None
        assert outcomes(backend, first) == [Outcome.SKIPPED]
    finally:
        other.release()


def test_two_opposite_transfers_never_overlap_and_never_deadlock(backend: LockBackend) -> None:
    first, second = keys("a", "b")
    inside: set[str] = set()
    done: list[tuple[str, str]] = []

    async def transfer(source: str, target: str) -> None:
        async with celery_dlock.alock([source, target], backend, wait=None) as leases:
            assert not inside & {source, target}, "two holders of one key"
            inside.update((source, target))
            assert [backend.get(lease.key) for lease in leases] == leases
            await asyncio.sleep(0)
            inside.difference_update((source, target))
            done.append((source, target))

    async def scenario() -> None:
        async with asyncio.timeout(300):  # a guard against a deadlock, not a measure
            await asyncio.gather(
                *(transfer(first, second) for _ in range(50)),
                *(transfer(second, first) for _ in range(50)),
            )

    asyncio.run(scenario())
    assert len(done) == 100
    assert backend.get(first) is None and backend.get(second) is None
    for key in (first, second):
        ended = outcomes(backend, key)
        assert ended.count(Outcome.SUCCEEDED) == 100
        assert set(ended) <= {Outcome.SUCCEEDED, Outcome.SKIPPED}


@pytest.mark.parametrize("awaited", [True, False], ids=["awaited", "left-to-the-loop"])
def test_a_set_cancelled_while_it_waits_holds_and_queues_nothing(
    backend: LockBackend, awaited: bool
) -> None:
    """A set cancelled in its wait for its busy second key, 20 times: it holds nothing,
    and the second key is free for the next try as soon as its holder lets go, in the
    step of the loop where the cancel ended (awaited), or after the loop ended right after
    the cancel (``asyncio.run`` returning). On Postgres the cancelled waiter's place in the
    key's queue was let go by closing its connection, in a task of the loop, which the
    server saw a moment later: on a loaded machine the next try was refused (once in CI;
    2 times in 100 with the machine's cores kept busy). It is now left, by a statement,
    before the cancel is raised."""
    for _ in range(20):
        first, second = keys("a", "b")
        other = Lock(backend, second)
        other.acquire()
        after = Lock(backend, second)
        taken: list[Lease | None] = []

        async def scenario() -> None:
            sets = AsyncLocks(backend, [first, second], wait=None)  # noqa: B023
            waiter = asyncio.ensure_future(sets.acquire())
            await until(lambda: outcomes(backend, first) == [Outcome.SKIPPED], "the set waits")  # noqa: B023
            waiter.cancel()
            if awaited:
                with pytest.raises(asyncio.CancelledError):
                    await waiter
                other.release()  # noqa: B023
                taken.append(after.attempt())  # noqa: B023

        try:
            asyncio.run(scenario())
            assert backend.get(first) is None
        finally:
            if other.lease is not None:
                other.release()
        if not awaited:
            taken.append(after.attempt())
        assert taken[0] is not None, "refused: the cancelled set is still queued"
        after.release()
        assert outcomes(backend, first) == [Outcome.SKIPPED]


def test_a_set_cancelled_while_held_releases_every_key_revoked(backend: LockBackend) -> None:
    first, second = keys("a", "b")
    held: list[Lease] = []

    async def holding(entered: asyncio.Event) -> None:
        async with celery_dlock.alock([first, second], backend, ttl=30) as leases:
            held.extend(leases)
            entered.set()
            await asyncio.Event().wait()

    async def scenario() -> None:
        entered = asyncio.Event()
        task = asyncio.ensure_future(holding(entered))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert backend.get(first) is None and backend.get(second) is None
    for lease in held:
        [record] = backend.history(key=lease.key)
        assert record.lease.token == lease.token and record.outcome is Outcome.REVOKED


def test_a_cancelled_waiter_ends_whatever_step_the_cancel_lands_on(backend: LockBackend) -> None:
    """A waiter on a busy key (``wait=None``) cancelled after 0, 1, 2 ... steps of the loop
    ends cancelled, every time: a cancel that the store's driver swallows (Python 3.11's
    ``wait_for``, under redis-py's socket timeout) would leave it waiting for ever, and
    ``asyncio.timeout`` around an acquire would never fire."""
    [key] = keys("busy")
    other = Lock(backend, key)
    other.acquire()
    lost: list[int] = []

    async def scenario() -> None:
        for steps in range(80):
            lock = AsyncLock(backend, key, wait=None)
            waiter = asyncio.ensure_future(lock.acquire())
            for _ in range(steps):
                await asyncio.sleep(0)
            waiter.cancel()
            await asyncio.wait([waiter], timeout=30)  # a guard: a lost cancel never ends
            if not waiter.done():
                lost.append(steps)
                other.release()  # the waiter takes the key: let it end
                lease = await waiter
                assert backend.get(key) == lease  # granted to a cancelled coroutine
                await lock.release()
                return
            assert waiter.cancelled()

    try:
        asyncio.run(scenario())
    finally:
        if other.lease is not None:
            other.release()
    assert lost == []


@pytest.mark.parametrize("busy", [False, True])
def test_a_cancel_at_any_step_of_the_loop_leaves_no_key_held(
    backend: LockBackend, busy: bool
) -> None:
    """A cancel lands after 0, 1, 2 ... steps of the loop: while the set is tried, while a
    key is let go, while it waits, while it is held or released. Nothing stays held, and
    every lease granted has exactly one record."""
    first, second = keys("a", "b")
    other = Lock(backend, second)
    if busy:
        other.acquire()
    granted: list[Lease] = []

    async def transfer() -> None:
        async with celery_dlock.alock([first, second], backend, wait=None) as leases:
            granted.extend(leases)
            await asyncio.sleep(0)

    async def cancel_after(steps: int) -> None:
        task = asyncio.ensure_future(transfer())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()  # done already (the block ran): no cancel to raise
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def scenario() -> None:
        # 60 steps at least; with a free key, on until a block ran before its cancel (a store
        # called in a thread may take many steps to answer on an idle machine).
        steps = 0
        while steps < 60 or not (busy or granted):
            await cancel_after(steps)
            assert backend.get(first) is None, steps
            assert backend.get(second) == other.lease, steps
            steps += 1
            assert steps < 100_000, "no block ran before its cancel"

    try:
        asyncio.run(scenario())
    finally:
        if busy:
            other.release()
    for key in (first, second):
        records = backend.history(key=key, limit=None)
        tokens = [record.lease.token for record in records]
        assert len(tokens) == len(set(tokens))  # one record per lease
        if not busy:
            assert {lease.token for lease in granted if lease.key == key} <= set(tokens)
    assert (granted == []) if busy else granted


def test_each_key_has_one_record_of_how_the_block_ended(backend: LockBackend) -> None:
    first, second = keys("a", "b")
    held: list[Lease] = []

    async def failing() -> None:
        async with celery_dlock.alock([second, first], backend, metadata={"by": "t"}) as leases:
            held.extend(leases)
            raise KeyError("no such account")

    with pytest.raises(KeyError):
        asyncio.run(failing())
    assert [lease.key for lease in held] == [first, second]
    for lease in held:
        [record] = backend.history(key=lease.key)
        assert record.lease.token == lease.token and record.outcome is Outcome.FAILED
        assert record.problem == "KeyError" and record.lease.holder.metadata == {"by": "t"}

    async def released() -> list[Outcome]:
        both = AsyncLocks(backend, [first, second])
        await both.acquire()
        records = await both.release(Outcome.SKIPPED, "nothing to do", "empty")
        assert records is not None and both.lease is None
        return [record.outcome for record in records]

    assert asyncio.run(released()) == [Outcome.SKIPPED, Outcome.SKIPPED]


def test_leaving_a_set_whose_second_lease_was_lost_releases_the_first(
    backend: LockBackend,
) -> None:
    """Renewal finds the second key gone: ``lost_lease`` names it; the block raising
    (``on_lock_lost="raise"`` in a task does this) releases the first key all the same."""
    first, second = keys("a", "b")

    async def scenario() -> None:
        both = AsyncLocks(backend, [first, second], ttl=0.6)
        with pytest.raises(LockLostError) as raised:
            async with both as leases:
                assert lost_lease(both) == leases[0]
                assert force_release(backend, second, "operator") is not None
                await until(lambda: both.lost, "the renewal of the second key found it gone")
                gone = lost_lease(both)
                raise LockLostError(gone.key, gone.fence, "renew")
        assert raised.value.key == second
        with pytest.raises(ConfigurationError, match="not held"):
            lost_lease(both)

    asyncio.run(scenario())
    assert backend.get(first) is None
    assert outcomes(backend, first) == [Outcome.FAILED]
    assert outcomes(backend, second) == [Outcome.FORCED, Outcome.LOST]


def test_several_keys_with_a_limit_are_refused_by_name(backend: LockBackend) -> None:
    with pytest.raises(ConfigurationError, match="limit"):
        celery_dlock.alock(keys("a", "b"), backend, limit=2)
    with pytest.raises(ConfigurationError, match="at least one key"):
        AsyncLocks(backend, [])


def test_a_second_task_acquiring_the_same_set_is_refused(backend: LockBackend) -> None:
    first, second = keys("a", "b")
    other = Lock(backend, second)
    other.acquire()
    both = AsyncLocks(backend, [first, second], wait=None)

    async def scenario() -> None:
        waiter = asyncio.ensure_future(both.acquire())
        await until(lambda: outcomes(backend, first) == [Outcome.SKIPPED], "the set waits")
        with pytest.raises(ConfigurationError, match="another task"):
            await both.acquire()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    try:
        asyncio.run(scenario())
    finally:
        other.release()
    assert backend.get(first) is None


def test_an_acquire_refused_for_a_bad_wait_leaves_the_set_free_to_acquire(
    backend: LockBackend,
) -> None:
    """Found in review: the refused acquire left the set marked as being acquired, so every
    later acquire was refused as "another task is acquiring"."""
    first, second = keys("a", "b")
    both = AsyncLocks(backend, [first, second])

    async def scenario() -> list[Lease]:
        with pytest.raises(ConfigurationError, match="wait"):
            await both.acquire(wait=-1)
        async with both:
            return list(both.leases)

    taken = asyncio.run(scenario())
    assert [lease.key for lease in taken] == [first, second]
    assert backend.get(first) is None and backend.get(second) is None
    assert outcomes(backend, first) == [Outcome.SUCCEEDED]


def test_an_async_lock_refused_for_a_bad_wait_stays_free_to_acquire(
    backend: LockBackend,
) -> None:
    """The same for one key (``AsyncLock``): refused, then taken and released."""
    [key] = keys("one")
    lock = AsyncLock(backend, key)

    async def scenario() -> Lease:
        with pytest.raises(ConfigurationError, match="wait"):
            await lock.acquire(wait=-1)
        async with lock as lease:
            return lease

    lease = asyncio.run(scenario())
    assert backend.get(key) is None
    [record] = backend.history(key=key)
    assert record.lease.token == lease.token and record.outcome is Outcome.SUCCEEDED
