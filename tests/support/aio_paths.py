"""Run one AsyncLock life on a store in a fresh interpreter and print, as JSON, which
threads of celery_dlock's offload pool it started and whether the store has an asyncio
client of its own: ``python aio_paths.py URL KEY``."""

from __future__ import annotations

import asyncio
import json
import sys
import threading

from celery_dlock import AsyncLock, Lock, LockTimeoutError, backend_from_url
from celery_dlock.backends.base import LockBackend


async def life(backend: LockBackend, key: str) -> None:
    # -X dev also logs each step of the loop over 0.1 s: on a loaded 2-core machine the
    # first offload's thread start took 0.14 s (CI). What this checks is warnings and
    # threads, not the loop's lag (bench/bench_asyncio.py measures that).
    asyncio.get_running_loop().slow_callback_duration = 60.0
    holder = AsyncLock(backend, key, ttl=30)
    lease = await holder.acquire()
    renewed = await holder.renew()
    assert renewed.expires_at is not None and lease.expires_at is not None
    assert (await holder.current()) is not None
    try:
        await AsyncLock(backend, key, wait=0.3).acquire()  # a busy key: waits, times out
    except LockTimeoutError:
        pass
    else:
        raise AssertionError("a held key was acquired twice")
    assert await holder.release() is not None
    async with AsyncLock(backend, key) as again:
        assert again.fence > lease.fence


def main() -> None:
    url, key = sys.argv[1:3]
    backend = backend_from_url(url)
    asyncio.run(life(backend, key))
    # The lease is free for the blocking API too, and its record is there.
    with Lock(backend, key):
        pass
    backend.close()  # the blocking client's connections, some opened by the pool's threads
    print(
        json.dumps(
            {
                "native": backend.async_store() is not None,
                "pool_threads": sorted(
                    t.name for t in threading.enumerate() if t.name.startswith("dlock-")
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
