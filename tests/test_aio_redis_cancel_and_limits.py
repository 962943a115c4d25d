"""An AsyncLock on Redis's asyncio client at the end of an event loop: an acquire, or a
release, left running in the background when ``asyncio.run`` ends is cancelled with the
call to the store it had under way. Neither may leave a lease on the key, held by no one,
until its ttl. And a crowd of waiters shares a bounded number of connections."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_dlock import AsyncLock, Lease, Lock, Outcome
from celery_dlock.backends.redis import RedisBackend
from celery_dlock.backends.redis import aio as redis_aio
from tests.backends.stores.redis import delete_prefix, store_url
from tests.support.countingproxy import CountingProxy

#: Tasks left running when their loop ends (referenced: the loop holds tasks weakly).
left: list[asyncio.Future[Any]] = []


@contextlib.contextmanager
def redis_store(proxied: bool = True) -> Iterator[tuple[RedisBackend, CountingProxy]]:
    """A Redis store of its own key prefix, reached through a proxy (or directly, the
    proxy unused); emptied afterwards."""
    with CountingProxy("127.0.0.1", 6379) as proxy:
        prefix = f"aio{os.getpid()}-{uuid.uuid4().hex[:6]}"
        base = f"redis://127.0.0.1:{proxy.port}/1" if proxied else "redis://127.0.0.1:6379/1"
        url = store_url(prefix, base=base)
        backend = RedisBackend.from_url(url)
        try:
            yield backend, proxy
        finally:
            backend.close()
            delete_prefix(url, prefix)


def test_a_try_cancelled_by_the_loop_s_end_leaves_no_lease_behind() -> None:
    """The try's script has run on the real Redis, its reply held by the proxy. Found by
    probing: the lease stayed on the key for its whole ttl, held by no one."""
    with redis_store() as (backend, proxy):
        replied, let_go = threading.Event(), threading.Event()
        key = "job:aio-redis:background"

        async def main() -> None:
            lock = AsyncLock(backend, key, ttl=30)
            async with lock:  # a connection of the loop, ready
                pass
            proxy.settle()
            # The next reply (the try's) is held, then lost: the script has run by then.
            proxy.drop_next_reply(then=lambda: (replied.set(), let_go.wait(10)))
            left.append(asyncio.ensure_future(lock.acquire()))  # asyncio.run cancels it
            while not replied.is_set():
                await asyncio.sleep(0.001)

        try:
            asyncio.run(main())
            assert backend.get(key) is None
            records = backend.history(key=key)
            assert [record.outcome for record in records] == [
                Outcome.DISCONNECTED,
                Outcome.SUCCEEDED,
            ]
        finally:
            let_go.set()


def test_a_release_cancelled_by_the_loop_s_end_is_settled_at_the_next_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder's release under way when ``asyncio.run`` ends (held at the store's door
    here: the script never ran) is cancelled with the loop's tasks. Found by probing: the
    lease stayed on the key, held by no one, until its ttl, and its outcome was never
    recorded; now the release is settled at the process's next release to that store."""
    with redis_store() as (backend, _):
        key, other = "job:aio-redis:releasing", "job:aio-redis:next"
        native = backend.async_store()
        assert native is not None
        real = native.release
        at_door = asyncio.Event()

        async def held_at_the_door(*args: Any) -> Any:
            at_door.set()
            await asyncio.Event().wait()  # until cancelled
            return await real(*args)

        async def holder(lock: AsyncLock) -> None:
            async with lock:
                monkeypatch.setattr(native, "release", held_at_the_door)

        async def main() -> Lease:
            lock = AsyncLock(backend, key, ttl=30)
            left.append(asyncio.ensure_future(holder(lock)))  # asyncio.run cancels it
            await at_door.wait()
            assert lock.lease is None  # detached: its release is under way
            [lease] = [found for found in [backend.get(key)] if found is not None]
            return lease

        lease = asyncio.run(main())
        monkeypatch.setattr(native, "release", real)
        assert backend.get(key) == lease  # the release never reached Redis
        with Lock(backend, other):  # the next release to the store settles it
            pass
        assert backend.get(key) is None
        [record] = backend.history(key=key)
        assert record.lease.token == lease.token and record.outcome is Outcome.SUCCEEDED


def open_sockets() -> int:
    """Sockets this process has open (Linux: ``/proc/self/fd``)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # an fd closed while listed
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def test_many_coroutines_waiting_share_a_bounded_number_of_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More coroutines than ``MAX_CONNECTIONS`` wait on a busy key, then take it in turn.
    Found by probing: each held a connection of its own (303 sockets for 300 waiters), and
    every one stayed open, idle, for the loop's life: a burst of waiters could use up the
    process's file descriptors or Redis's ``maxclients``."""
    waiters = redis_aio.MAX_CONNECTIONS + 100
    with redis_store(proxied=False) as (backend, _):  # the proxy's sockets are not counted
        key = "job:aio-redis:crowd"
        other = Lock(backend, key)
        other.acquire()
        taken: list[Lease] = []

        async def waiter() -> None:
            async with AsyncLock(backend, key, wait=None) as lease:
                taken.append(lease)

        async def scenario() -> tuple[int, int, int]:
            before = open_sockets()
            crowd = [asyncio.ensure_future(waiter()) for _ in range(waiters)]
            peak, loop = before, asyncio.get_running_loop()
            waited = loop.time() + 1.0
            async with asyncio.timeout(120):  # a guard against a hang, not a measure
                while len(taken) < waiters:
                    peak = max(peak, open_sockets())
                    crowded = peak >= before + redis_aio.MAX_CONNECTIONS or loop.time() > waited
                    if other.lease is not None and crowded:
                        other.release()  # the crowd is waiting: let it in
                    # Every 50 ms: a count lists the process's fds, 600 of them at the
                    # peak (every 5 ms, the counting took most of the test's CPU).
                    await asyncio.sleep(0.05)
            await asyncio.gather(*crowd)
            monkeypatch.setattr(redis_aio, "IDLE", 0.0)  # as if IDLE seconds went by
            async with AsyncLock(backend, key):  # a call after the burst
                pass
            return before, peak, open_sockets()

        before, peak, after = asyncio.run(scenario())
        assert len({lease.token for lease in taken}) == waiters
        fences = [lease.fence for lease in taken]
        assert fences == sorted(fences)
        assert backend.get(key) is None
        assert peak - before <= redis_aio.MAX_CONNECTIONS + 1  # + the blocking client's
        assert after - before <= redis_aio.MAX_IDLE + 1
