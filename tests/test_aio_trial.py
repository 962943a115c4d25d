"""An adversarial trial of the asyncio API (``alock``, ``AsyncLock``, ``AsyncLocks``) on the
real Postgres and Redis servers, as an asyncio service would use it: cancels from
``wait_for`` and ``TaskGroup`` at whatever point they land, a loop blocked past the ttl, a
crowd of 200 waiters, one lock shared or carried across loops and threads, the store's
connections killed under a holder and a waiter, and a process that ends holding a lease.

Every check reads the store: the lease on the key, its fence, and the history of each lease.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import celery_dlock
from celery_dlock import (
    AsyncLock,
    BackendError,
    ConfigurationError,
    Lease,
    Lock,
    LockLostError,
    LockTimeoutError,
    Outcome,
)
from celery_dlock.backends.base import LockBackend
from tests.backends.conftest import STORES
from tests.backends.storecase import StoreCase
from tests.backends.stores.postgres import SERVER_URL, admin_connection, schema_store
from tests.support import eventually
from tests.support.services import lease_session_pids, redis_client


@pytest.fixture(params=["postgres", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreCase]:
    """The two stores with an asyncio client of their own, each test on its own schema or
    key prefix (dropped afterwards)."""
    with STORES[request.param].open_store(tmp_path, request) as case:
        try:
            yield case
        finally:
            case.backend.close()


def fresh_key(what: str) -> str:
    return f"job:aio-trial:{what}:{uuid.uuid4().hex[:8]}"


async def until(check: Callable[[], bool]) -> None:
    """Let the loop run until ``check()`` is true (a state the store or the loop decides)."""
    async with asyncio.timeout(30):  # a guard against a hang, not a measure
        while not check():
            await asyncio.sleep(0.01)


def records_by_token(backend: LockBackend, key: str) -> dict[str, list[Outcome]]:
    """The outcomes recorded for each lease of ``key``, oldest first."""
    found: dict[str, list[Outcome]] = collections.defaultdict(list)
    for record in reversed(backend.history(key=key, limit=None)):
        found[record.lease.token].append(record.outcome)
    return found


# -- cancels -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["one key", "two keys"])
def test_acquires_cut_short_by_tiny_timeouts_leave_no_lease_held_by_no_one(
    store: StoreCase, shape: str
) -> None:
    """``asyncio.wait_for`` around an acquire (and a release) with timeouts of 0 to 20 ms,
    200 times, while another holder takes and frees one key now and then: after each round,
    the keys are free or that holder's, never held by a lease nobody has; every lease the
    loop was granted (returned or revoked) has exactly one record."""
    backend = store.backend
    first, second = sorted([fresh_key("tiny-a"), fresh_key("tiny-b")])
    keys = [first] if shape == "one key" else [first, second]
    other = Lock(store.second(), keys[-1], ttl=30)
    rng = random.Random(7)
    returned: list[Lease] = []
    timeouts = 0

    async def round_(timeout: float) -> None:
        nonlocal timeouts
        lock: Any = celery_dlock.alock(keys[0] if shape == "one key" else keys, backend, 30, 2)
        try:
            got = await asyncio.wait_for(lock.acquire(), timeout)
        except TimeoutError:
            timeouts += 1
            assert lock.lease is None
            return
        returned.extend(got if isinstance(got, list) else [got])
        with contextlib.suppress(TimeoutError):  # a release, once started, ends first
            await asyncio.wait_for(lock.release(), rng.choice([0.001, 1]))
        assert lock.lease is None

    async def scenario() -> None:
        for n in range(200):
            if n % 25 == 0:  # the other holder takes the last key, or frees it
                await asyncio.to_thread(other.release if other.lease else other.acquire)
            await round_(rng.choice([0, 0.0005, 0.002, 0.005, 0.02]))
            expected = {keys[-1]: other.lease}
            for key in keys:
                assert backend.get(key) == expected.get(key), (n, key)

    asyncio.run(scenario())
    if other.lease is not None:
        other.release()
    assert timeouts > 0 and returned  # both kinds of round happened
    for key in keys:
        assert backend.get(key) is None
        recorded = records_by_token(backend, key)
        assert all(len(outcomes) == 1 for outcomes in recorded.values()), recorded
        assert {lease.token for lease in returned if lease.key == key} <= set(recorded)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is 3.11+")
def test_a_task_group_whose_sibling_fails_revokes_the_holder_and_the_waiter(
    store: StoreCase,
) -> None:
    """A ``TaskGroup``: one task holds a key, one waits on it, one waits on a set that
    includes it; a fourth fails. The group cancels the others: the holder's lease is
    recorded ``revoked``, the waiters were granted nothing, and nothing stays held."""
    backend = store.backend
    run = uuid.uuid4().hex[:8]
    other_key, key = f"job:aio-trial:group:{run}:a", f"job:aio-trial:group:{run}:b"
    held = asyncio.Event()
    granted: list[Lease] = []

    async def holder() -> None:
        async with celery_dlock.alock(key, backend, ttl=30) as lease:
            granted.append(lease)
            held.set()
            await asyncio.sleep(60)

    async def waiter() -> None:
        await held.wait()
        async with celery_dlock.alock(key, backend, ttl=30, wait=None) as lease:
            granted.append(lease)

    async def set_waiter() -> None:
        await held.wait()
        async with celery_dlock.alock([other_key, key], backend, ttl=30, wait=None) as leases:
            granted.extend(leases)

    async def failing() -> None:
        await held.wait()
        await until(lambda: len(records_by_token(backend, other_key)) > 0)  # a set let go
        raise ValueError("the request failed")

    async def scenario() -> None:
        with pytest.raises(ExceptionGroup) as raised:  # noqa: F821 (3.11+, as TaskGroup)
            async with asyncio.TaskGroup() as group:
                group.create_task(holder())
                group.create_task(waiter())
                group.create_task(set_waiter())
                group.create_task(failing())
        assert raised.group_contains(ValueError)

    asyncio.run(scenario())
    assert backend.get(key) is None and backend.get(other_key) is None
    [first] = granted
    assert records_by_token(backend, key) == {first.token: [Outcome.REVOKED]}
    assert all(
        outcomes == [Outcome.SKIPPED] for outcomes in records_by_token(backend, other_key).values()
    )


# -- a blocked loop ------------------------------------------------------------------------


def test_a_loop_blocked_past_the_ttl_reports_the_loss_and_the_next_holder_is_fenced_above(
    store: StoreCase,
) -> None:
    """A coroutine holding a 1 s lease blocks the loop (``time.sleep``) until another
    client has taken the key over. Expected: ``on_lost`` is called once with the lease,
    leaving the block raises ``LockLostError``, the late release takes nothing from the new
    holder and is recorded ``lost``, and the new holder's fence is higher."""
    backend, key = store.backend, fresh_key("blocked")
    other = Lock(store.second(), key, ttl=30, wait=30)
    lost: list[Lease] = []
    taken = threading.Event()

    def take_over() -> None:
        other.acquire()
        taken.set()

    async def scenario() -> Lease:
        lock = AsyncLock(backend, key, ttl=1.0, on_lost=lost.append)
        with pytest.raises(LockLostError):
            async with lock as lease:
                thread = threading.Thread(target=take_over)
                thread.start()
                assert taken.wait(30)  # the loop is blocked until the key changed hands
                thread.join()
                await until(lambda: lock.lost)
        return lease

    ours = asyncio.run(scenario())
    try:
        assert lost == [ours]
        assert other.lease is not None and other.lease.fence > ours.fence
        assert backend.get(key) == other.lease  # the late release took nothing from it
        outcomes = records_by_token(backend, key)[ours.token]
        assert Outcome.LOST in outcomes and outcomes[0] is Outcome.EXPIRED, outcomes
    finally:
        other.release()


# -- a crowd -------------------------------------------------------------------------------


def test_200_coroutines_on_one_key_each_hold_it_alone_in_fence_order(store: StoreCase) -> None:
    """200 coroutines of one loop contend for one key with ``wait=60`` (each holds it for
    one step of the loop): each gets the key (a lost wake-up would leave one waiting out its
    60 s and time out), no two hold it at once, the fences rise in the order they held it,
    and each lease has one ``succeeded`` record."""
    backend, key = store.backend, fresh_key("crowd")
    inside = 0
    fences: list[int] = []
    failures: list[BaseException] = []

    async def contender() -> None:
        nonlocal inside
        try:
            async with celery_dlock.alock(key, backend, ttl=30, wait=60) as lease:
                inside += 1
                assert inside == 1, "two holders at once"
                fences.append(lease.fence)
                await asyncio.sleep(0)
                inside -= 1
        except LockTimeoutError as exc:
            failures.append(exc)

    async def scenario() -> None:
        async with asyncio.timeout(300):  # a guard against a hang
            await asyncio.gather(*(contender() for _ in range(200)))

    asyncio.run(scenario())
    assert failures == []
    assert len(fences) == 200 and fences == sorted(fences) and len(set(fences)) == 200
    recorded = records_by_token(backend, key)
    assert len(recorded) == 200
    assert all(outcomes == [Outcome.SUCCEEDED] for outcomes in recorded.values())
    assert backend.get(key) is None


# -- one lock, several tasks, loops, threads ------------------------------------------------


def test_a_held_async_lock_entered_again_is_refused_and_the_outer_block_records_it(
    store: StoreCase,
) -> None:
    """Re-entry (``async with lock`` inside ``async with lock``) and a second task's
    ``async with`` on the same AsyncLock are refused with ``ConfigurationError``, the lease
    untouched meanwhile; the outer block then ends ``failed``, naming the error."""
    backend, key = store.backend, fresh_key("reenter")
    lock = AsyncLock(backend, key, ttl=30)

    async def other_task() -> None:
        async with lock:
            raise AssertionError("entered a held AsyncLock")

    async def scenario() -> Lease:
        with pytest.raises(ConfigurationError):
            async with lock as lease:
                with pytest.raises(ConfigurationError, match="already held"):
                    await asyncio.ensure_future(other_task())
                assert backend.get(key) == lease
                async with lock:
                    raise AssertionError("entered a held AsyncLock again")
        return lease

    lease = asyncio.run(scenario())
    assert backend.get(key) is None
    [record] = backend.history(key=key)
    assert record.lease.token == lease.token
    assert (
        record.outcome is Outcome.FAILED
        and record.problem == "celery_dlock.errors.ConfigurationError"
    )


def test_one_async_lock_used_by_one_loop_after_another(store: StoreCase) -> None:
    """``asyncio.run`` three times with the same AsyncLock (a ttl, so a renewal task per
    loop): each loop takes and releases its own lease, fences rising, each ``succeeded``."""
    backend, key = store.backend, fresh_key("loops")
    lock = AsyncLock(backend, key, ttl=1.2)

    async def use() -> Lease:
        async with lock as lease:
            assert backend.get(key) == lease
            await asyncio.sleep(0.5)  # a renewal runs
        return lease

    leases = [asyncio.run(use()) for _ in range(3)]
    assert [lease.fence for lease in leases] == sorted({lease.fence for lease in leases})
    assert backend.get(key) is None
    recorded = records_by_token(backend, key)
    assert recorded == {lease.token: [Outcome.SUCCEEDED] for lease in leases}


def test_two_loops_in_two_threads_on_one_key_never_overlap(store: StoreCase) -> None:
    """The main thread's loop and a thread's own loop (each its own connections, on
    Postgres each its own lock session), 40 sections each on one key: never both inside,
    fences rising in the order of the sections, each lease ``succeeded``."""
    backend, key = store.backend, fresh_key("threads")
    inside = 0
    mutex = threading.Lock()
    fences: list[int] = []

    async def sections() -> None:
        nonlocal inside
        for _ in range(40):
            async with celery_dlock.alock(key, backend, ttl=30, wait=60) as lease:
                with mutex:
                    inside += 1
                    assert inside == 1, "two loops inside at once"
                    fences.append(lease.fence)
                await asyncio.sleep(0.001)
                with mutex:
                    inside -= 1

    failed: list[BaseException] = []

    def in_thread() -> None:
        try:
            asyncio.run(sections())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=in_thread)
    thread.start()
    asyncio.run(sections())
    thread.join(120)
    assert not thread.is_alive() and failed == []
    assert len(fences) == 80 and fences == sorted(fences)
    recorded = records_by_token(backend, key)
    assert len(recorded) == 80 and all(o == [Outcome.SUCCEEDED] for o in recorded.values())


def test_threads_that_first_use_a_redis_store_at_once_share_its_asyncio_client() -> None:
    """The asyncio client is made once per store ("one set of connections per event
    loop"): two threads asking for it at the same moment get the same one. The threads are
    switched as often as the interpreter allows, so the race shows within 100 rounds."""
    from celery_dlock.backends.redis import RedisBackend

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    twice = 0
    try:
        for _ in range(100):
            backend = RedisBackend.from_url("redis://127.0.0.1:6379/1?prefix=aio-trial-race")
            got: list[object] = []
            barrier = threading.Barrier(2)

            def ask(
                backend: RedisBackend = backend,
                got: list[object] = got,
                barrier: threading.Barrier = barrier,
            ) -> None:
                barrier.wait()
                got.append(backend.async_store())

            threads = [threading.Thread(target=ask) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            twice += got[0] is not got[1]
            backend.close()
    finally:
        sys.setswitchinterval(previous)
    assert twice == 0, f"{twice} of 100 rounds made two asyncio clients"


def test_a_lease_left_by_a_thread_s_loop_is_freed_and_its_late_release_frees_no_other(
    store: StoreCase, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread's ``asyncio.run`` ends with its AsyncLock still holding a 2 s lease (a
    warning names the key). Another loop waiting on the key gets it (Postgres: the loop's
    session closed with it; Redis: at the ttl) with a higher fence; the first AsyncLock,
    released from the main loop afterwards, takes nothing from it."""
    backend, key = store.backend, fresh_key("left")
    left = AsyncLock(backend, key, ttl=2)
    leases: list[Lease] = []

    with caplog.at_level(logging.WARNING, logger="celery_dlock.aio"):
        thread = threading.Thread(target=lambda: leases.append(asyncio.run(left.acquire())))
        thread.start()
        thread.join(30)
    [ours] = leases
    assert any(key in record.getMessage() for record in caplog.records)

    async def scenario() -> Lease:
        taker = AsyncLock(backend, key, ttl=30, wait=30)
        taken = await taker.acquire()
        assert taken.fence > ours.fence
        await left.release()  # late: the lease is gone
        assert backend.get(key) == taken
        await taker.release()
        return taken

    taken = asyncio.run(scenario())
    assert backend.get(key) is None
    recorded = records_by_token(backend, key)
    assert recorded[taken.token] == [Outcome.SUCCEEDED]
    assert len(recorded[ours.token]) >= 1  # its end recorded (by the taker, or lost)


# -- the store's connections cut -------------------------------------------------------------


def kill_own_redis_connections() -> int:
    """``CLIENT KILL`` every connection of this process to the test Redis (the lock's,
    asyncio's and blocking), as a Redis restart or a proxy would cut them; how many."""
    mine = {
        conn.laddr.port
        for conn in psutil.Process().net_connections(kind="tcp")
        if conn.raddr and conn.raddr.port == 6379
    }
    killer = redis_client("redis://127.0.0.1:6379/1")
    try:
        me = killer.client_id()
        killed = 0
        for client in killer.client_list():
            port = int(client["addr"].rpartition(":")[2])
            if port in mine and int(client["id"]) != me:
                killed += int(killer.client_kill_filter(_id=client["id"]))
        return killed
    finally:
        killer.close()


def test_redis_connections_killed_under_a_holder_and_a_waiter_cost_neither_anything(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Redis: every connection of the process is killed (``CLIENT KILL``) while one
    coroutine holds a 1.5 s lease (renewed) and another waits in ``BLPOP``, three times.
    Expected (replies lost are retried, a wait cut short is a wake-up): the holder keeps
    its lease past several ttls, the waiter gets the key when it is released (fence
    higher), both ``succeeded``."""
    with STORES["redis"].open_store(tmp_path, request) as case:
        backend, key = case.backend, fresh_key("redis-kill")

        async def scenario() -> tuple[Lease, Lease]:
            holder = AsyncLock(backend, key, ttl=1.5)
            lease = await holder.acquire()
            waiter = AsyncLock(backend, key, ttl=30, wait=60)
            waiting = asyncio.ensure_future(waiter.acquire())
            for _ in range(3):
                await asyncio.sleep(0.3)  # the waiter is in its BLPOP
                assert await asyncio.to_thread(kill_own_redis_connections) > 0
                await asyncio.sleep(0.8)  # a renewal comes due on new connections
            current = await asyncio.to_thread(backend.get, key)
            assert current is not None and current.token == lease.token
            assert not holder.lost and not waiting.done()
            assert await holder.release() is not None
            taken = await asyncio.wait_for(waiting, 30)
            assert backend.get(key) == taken
            assert await waiter.release() is not None
            return lease, taken

        try:
            lease, taken = asyncio.run(scenario())
            assert taken.fence > lease.fence
            assert records_by_token(backend, key) == {
                lease.token: [Outcome.SUCCEEDED],
                taken.token: [Outcome.SUCCEEDED],
            }
        finally:
            backend.close()


def terminate_waiters(admin: Any, application: str) -> int:
    """``pg_terminate_backend`` every connection of ``application`` now in a wait."""
    rows = admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = %s AND state = 'active' AND query LIKE '-- wait:%%'",
        [application],
    ).fetchall()
    return len(rows)


def test_postgres_waiter_whose_connection_is_terminated_still_gets_the_key() -> None:
    """Postgres: a waiter's connection is ended by ``pg_terminate_backend`` while it waits
    (twice). Expected: it waits on, and takes the key once the holder releases it."""
    application = f"aio-trial-{uuid.uuid4().hex[:8]}"
    with schema_store(SERVER_URL, application_name=application) as case:
        backend, key = case.backend, fresh_key("pg-waiter")
        admin = admin_connection()
        holder = Lock(case.second(), key, ttl=30)
        first = holder.acquire()

        async def scenario() -> Lease:
            waiter = AsyncLock(backend, key, ttl=30, wait=60)
            waiting = asyncio.ensure_future(waiter.acquire())
            for _ in range(2):
                await until(lambda: terminate_waiters(admin, application) > 0)
                await asyncio.sleep(0.2)
            assert not waiting.done()
            await asyncio.to_thread(holder.release)
            taken = await asyncio.wait_for(waiting, 30)
            assert backend.get(key) == taken
            await waiter.release()
            return taken

        try:
            taken = asyncio.run(scenario())
        finally:
            admin.close()
        assert taken.fence > first.fence
        assert records_by_token(backend, key) == {
            first.token: [Outcome.SUCCEEDED],
            taken.token: [Outcome.SUCCEEDED],
        }


@pytest.mark.parametrize("noticed", ["after the loss is reported", "at once"])
def test_postgres_lock_session_terminated_under_a_holder_then_the_next_acquire_works(
    tmp_path: Path, request: pytest.FixtureRequest, noticed: str
) -> None:
    """Postgres: the loop's lock session is terminated while a coroutine holds a lease.
    Expected (README: a session that held leases reports them lost, the call after that
    gets a new session): ``on_lost`` once, leaving the block raises ``LockLostError``, the
    key is free for others. An acquire on the loop made after the loss was reported gets
    its key; one made at once (before the watcher noticed) raises ``BackendError`` even
    with ``wait=10``, leaving nothing held, and the next acquire gets its key."""
    with STORES["postgres"].open_store(tmp_path, request) as case:
        backend = case.backend
        schema = backend.schema
        key, next_key = fresh_key("pg-session"), fresh_key("pg-next")
        admin = admin_connection()
        lost: list[Lease] = []

        async def scenario() -> tuple[Lease, Lease]:
            lock = AsyncLock(backend, key, on_lost=lost.append)
            with pytest.raises(LockLostError):
                async with lock as lease:
                    [pid] = lease_session_pids(admin, schema, lease.fence)
                    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
                    if noticed != "at once":
                        await until(lambda: lock.lost)
                    else:
                        eventually(
                            lambda: not lease_session_pids(admin, schema, lease.fence),
                            "the session ended",
                        )
                    after = AsyncLock(backend, next_key, ttl=30, wait=10)
                    if noticed == "at once":  # this call meets the ended session: it says so
                        with pytest.raises(BackendError, match="57P01"):
                            await after.acquire()
                        assert backend.get(next_key) is None
                    later = await after.acquire()  # the call after that: a new session
                    assert backend.get(next_key) == later
                    await until(lambda: lock.lost)
                    assert await after.release() is not None
            return lease, later

        try:
            lease, later = asyncio.run(scenario())
        finally:
            admin.close()
        assert lost == [lease]
        other = Lock(case.second(), key)
        taken = other.acquire()
        assert taken.fence > lease.fence
        other.release()
        assert Outcome.DISCONNECTED in records_by_token(backend, key)[lease.token]
        assert later.fence > lease.fence


# -- a process that ends holding a lease ------------------------------------------------------

ENDS_HOLDING = textwrap.dedent(
    """
    import asyncio, json, sys
    from celery_dlock import AsyncLock

    url, key, how = sys.argv[1:4]
    lock = AsyncLock(url, key, ttl=30)
    if how == "asyncio.run":
        lease = asyncio.run(lock.acquire())
    else:  # a loop left open, as a server killed by its own sys.exit
        loop = asyncio.new_event_loop()
        lease = loop.run_until_complete(lock.acquire())
    print(json.dumps({"token": lease.token, "fence": lease.fence}), flush=True)
    """
)


@pytest.mark.parametrize("how", ["asyncio.run", "loop left open"])
def test_a_process_that_ends_holding_an_async_lease_releases_it_abandoned(
    store: StoreCase, tmp_path: Path, how: str
) -> None:
    """A process ends normally with an AsyncLock still holding a 30 s lease. Expected
    (README: a process that ends normally still holding leases releases them, recorded
    ``abandoned``): the key is free as soon as the process is gone, and the lease has one
    record of its end."""
    assert store.url is not None
    key = fresh_key("exit")
    script = tmp_path / "ends_holding.py"
    script.write_text(ENDS_HOLDING)
    done = subprocess.run(
        [sys.executable, "-W", "ignore::ResourceWarning", str(script), store.url, key, how],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).parent.parent),
    )
    assert done.returncode == 0, done.stderr
    token = done.stdout.splitlines()[-1].split('"token": "')[1].split('"')[0]
    assert store.backend.get(key) is None, done.stderr
    outcomes = records_by_token(store.backend, key)[token]
    assert outcomes in ([Outcome.ABANDONED], [Outcome.DISCONNECTED]), (outcomes, done.stderr)
