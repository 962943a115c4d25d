"""The contract through the asyncio API (:class:`AsyncLock`, ``alock``), on every store:
holding, busy keys, waiting, failures and cancellation recorded, renewal by an asyncio task,
slots, metadata; and 50 coroutines of one loop with 4 processes on one key, with the loop's
lag measured meanwhile."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import celery_dlock
from celery_dlock import (
    AsyncLock,
    Lock,
    LockNotAcquiredError,
    LockTimeoutError,
    Outcome,
)
from tests.backends.storecase import StoreCase
from tests.backends.test_contract import holder, needs_processes
from tests.support.forked import popen_script

HELPERS = Path(__file__).parent.parent / "support"


def test_async_with_holds_the_key_and_records_success(store: StoreCase) -> None:
    backend = store.backend

    async def scenario() -> None:
        async with celery_dlock.alock("job:aio:ok", backend, metadata={"n": 1}) as lease:
            held = backend.get("job:aio:ok")
            assert held is not None and held.token == lease.token
            assert await AsyncLock(backend, "job:aio:ok").attempt() is None

    asyncio.run(scenario())
    assert backend.get("job:aio:ok") is None
    [record] = backend.history(key="job:aio:ok")
    assert record.outcome is Outcome.SUCCEEDED and record.lease.metadata == {"n": 1}


def test_a_busy_key_raises_naming_the_holder_and_a_limited_wait_times_out(
    store: StoreCase,
) -> None:
    backend = store.backend
    first = Lock(store.second(), "job:aio:busy")
    first.acquire()

    async def scenario() -> None:
        with pytest.raises(LockNotAcquiredError) as busy:
            await AsyncLock(backend, "job:aio:busy").acquire()
        assert busy.value.holder is not None
        started = time.monotonic()
        with pytest.raises(LockTimeoutError):
            await AsyncLock(backend, "job:aio:busy", wait=0.6).acquire()
        assert time.monotonic() - started >= 0.6

    try:
        asyncio.run(scenario())
    finally:
        first.release()


def test_a_waiting_coroutine_takes_the_key_when_it_is_freed(store: StoreCase) -> None:
    backend = store.backend
    first = Lock(store.second(), "job:aio:wait")
    first.acquire()
    threading.Timer(0.4, first.release).start()

    async def scenario() -> None:
        lock = AsyncLock(backend, "job:aio:wait", wait=30)
        lease = await lock.acquire()
        assert lease.fence > 0 and first.lease is None
        await lock.release()

    asyncio.run(scenario())
    outcomes = [r.outcome for r in backend.history(key="job:aio:wait")]
    assert outcomes == [Outcome.SUCCEEDED, Outcome.SUCCEEDED]


def test_an_exception_in_the_block_is_recorded_failed_with_its_traceback(
    store: StoreCase,
) -> None:
    async def scenario() -> None:
        async with celery_dlock.alock("job:aio:fail", store.backend):
            await asyncio.sleep(0)
            raise KeyError("order 42")

    with pytest.raises(KeyError):
        asyncio.run(scenario())
    [record] = store.backend.history(key="job:aio:fail")
    assert record.outcome is Outcome.FAILED and record.problem == "KeyError"
    assert "order 42" in (record.details or "") and "scenario" in (record.details or "")


def test_a_cancelled_waiter_leaves_nothing_held_or_queued(store: StoreCase) -> None:
    backend = store.backend
    first = Lock(store.second(), "job:aio:cancel-wait")
    first_lease = first.acquire()

    async def scenario() -> None:
        waiter = asyncio.ensure_future(AsyncLock(backend, "job:aio:cancel-wait", wait=60).acquire())
        await asyncio.sleep(0.8)  # waiting on the store by now
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(scenario())
    first.release()
    # Nothing of the cancelled waiter holds the key, or stands before a new waiter.
    after = Lock(backend, "job:aio:cancel-wait", wait=10)
    lease = after.acquire()
    assert lease.fence > 0
    after.release()
    time.sleep(0.6)  # a step of the cancelled waiter still under way ends within SLICE
    assert backend.get("job:aio:cancel-wait") is None
    # The two sync holders; and the cancelled waiter only through a try that was under way
    # when it was cancelled (it runs to its end: on a loaded machine it can land after the
    # first release), whose lease is then released at once as revoked.
    records = backend.history(key="job:aio:cancel-wait")
    ours = {first_lease.holder.nonce, lease.holder.nonce}
    assert ours <= {r.lease.holder.nonce for r in records}
    late = [r.outcome for r in records if r.lease.holder.nonce not in ours]
    assert late in ([], [Outcome.REVOKED]), late


def test_a_cancelled_holder_releases_as_revoked(store: StoreCase) -> None:
    backend = store.backend

    async def holding(entered: asyncio.Event) -> None:
        async with celery_dlock.alock("job:aio:cancel-hold", backend):
            entered.set()
            await asyncio.sleep(60)

    async def scenario() -> None:
        entered = asyncio.Event()
        task = asyncio.ensure_future(holding(entered))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert backend.get("job:aio:cancel-hold") is None
    [record] = backend.history(key="job:aio:cancel-hold")
    assert record.outcome is Outcome.REVOKED and record.problem == "CancelledError"


def test_renewal_is_an_asyncio_task_that_keeps_the_lease_past_its_ttl(store: StoreCase) -> None:
    backend = store.backend

    async def scenario() -> None:
        # A renewal every 0.8 s, each with 1.6 s to land: an object store's calls on a
        # loaded machine took over 0.8 s (with ttl=1.2 the lease was lost, rightly).
        lock = AsyncLock(backend, "job:aio:renew", ttl=2.4)
        first = await lock.acquire()
        assert lock._renewal is not None
        if store.clock is None:  # the store's own clock: outlive the ttl for real
            await asyncio.sleep(5)
            assert backend.try_acquire("job:aio:renew", holder(), None) is None
            assert lock.lease is not None and lock.lease.expires_at > first.expires_at
        renewed = await lock.renew(60)
        assert renewed.expires_at is not None and first.expires_at is not None
        assert renewed.expires_at > first.expires_at and renewed.token == first.token
        assert await lock.release() is not None
        assert lock._renewal is None

    asyncio.run(scenario())
    [record] = store.backend.history(key="job:aio:renew")
    assert record.outcome is Outcome.SUCCEEDED


def test_a_limit_gives_each_holder_a_slot(store: StoreCase) -> None:
    backend = store.backend

    async def scenario() -> None:
        locks = [AsyncLock(backend, "job:aio:slots", limit=2) for _ in range(3)]
        leases = [await lock.attempt() for lock in locks]
        assert sorted(lease.key for lease in leases if lease is not None) == [
            "job:aio:slots#0",
            "job:aio:slots#1",
        ]
        assert leases[2] is None
        for lock in locks[:2]:
            await lock.release()

    asyncio.run(scenario())


def test_coroutines_and_4_processes_on_one_key_never_overlap(
    store: StoreCase, tmp_path: Path
) -> None:
    url = needs_processes(store)
    key = "job:aio:contended"
    counter, log, start = tmp_path / "counter", tmp_path / "fences", tmp_path / "start"
    counter.write_text("0")
    log.write_text("")
    # A store whose waits poll (the object stores) hands the key over in tens of ms: fewer
    # contenders there keep the test under 20 s, and the overlap check just as strict.
    rounds, coroutines = (10, 50) if store.backend.capabilities.push_wait else (5, 20)
    args = [url, key, str(rounds), str(counter), str(log), str(start)]
    script = str(HELPERS / "contend.py")
    processes = [popen_script(script, *args) for _ in range(4)]
    lags: list[float] = []

    async def contender() -> None:
        async with celery_dlock.alock(key, url, wait=None) as lease:
            value = int(counter.read_text() or 0)
            await asyncio.sleep(0)  # another coroutine would run here if it held the key too
            counter.write_text(str(value + 1))
            with log.open("a") as out:
                out.write(f"{lease.fence}\n")

    async def ticker(stop: asyncio.Event) -> None:
        while not stop.is_set():
            before = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - before - 0.01)

    async def scenario() -> None:
        stop = asyncio.Event()
        ticking = asyncio.ensure_future(ticker(stop))
        start.write_text("go")
        await asyncio.gather(*(contender() for _ in range(coroutines)))
        stop.set()
        await ticking

    asyncio.run(scenario())
    assert [p.wait(timeout=240) for p in processes] == [0] * 4
    assert int(counter.read_text()) == coroutines + 4 * rounds
    fences = [int(line) for line in log.read_text().split()]
    assert len(fences) == coroutines + 4 * rounds
    assert all(a < b for a, b in itertools.pairwise(fences)), "fences out of order"
    lags.sort()
    print(
        f"\n{store.backend.name}: loop lag under contention, {len(lags)} ticks: "
        f"median {lags[len(lags) // 2] * 1000:.2f} ms, max {lags[-1] * 1000:.2f} ms"
    )


def test_a_store_with_an_asyncio_client_uses_it_and_the_others_the_pool(
    store: StoreCase,
) -> None:
    url = needs_processes(store)
    script = str(HELPERS / "aio_paths.py")
    # -X dev -W error: an asyncio connection left open when its loop ends warns, and fails.
    ran = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", script, url, "job:aio:paths"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr == ""
    found = json.loads(ran.stdout)
    assert found["native"] is (store.backend.async_store() is not None)
    # Redis and Postgres have their own (not a cluster, not liveness=ttl: the pool there).
    scheme = url.split("://", 1)[0]
    assert found["native"] is (scheme in ("redis", "postgresql") and "liveness=ttl" not in url)
    if found["native"]:
        assert found["pool_threads"] == []  # no call went through a thread
    else:
        assert any(name.startswith("dlock-calls") for name in found["pool_threads"])
    records = store.backend.history(key="job:aio:paths")
    assert [r.outcome for r in records] == [Outcome.SUCCEEDED] * 3
