"""The asyncio API against its floor, and the event loop's lag while it works.

    python bench/bench_asyncio.py [--store postgres|redis|file] [--ops 2000] [--rounds 3]

For one store, in one process:

- ``sync``: ``Lock`` acquire + release on one thread, uncontended (the floor: the store's
  own round trips);
- ``async``: ``AsyncLock`` acquire + release from one coroutine, uncontended, on the store's
  own asyncio client where it has one (Redis: redis-py's asyncio connections; Postgres:
  psycopg's ``AsyncConnection``), else the floor plus the hop to the offload thread and back
  (file); the path is printed. Sync and async alternate within each round, and the ratio is
  the median of the rounds' ratios, so a machine whose speed drifts skews both alike;
- ``contended``: 50 coroutines of one loop taking 10 keys (hot spots) with ``wait``, while a
  ticker coroutine measures how late each 10 ms sleep wakes: the loop's lag (median, p99,
  max), against the same ticker on an idle loop in the same run. A store call on the loop
  would show as lag of a round trip or more.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
import uuid

from celery_dlock import AsyncLock, Lock, backend_from_url

URLS = {
    "postgres": os.environ.get("DLOCK_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"),
    "redis": os.environ.get("DLOCK_BENCH_REDIS", "redis://127.0.0.1:6379/6"),
    "file": "file:///tmp/dlock-bench-asyncio",
}
TICK = 0.01


def sync_rate(url: str, ops: int) -> float:
    backend = backend_from_url(url)
    key = f"bench:aio:{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    for _ in range(ops):
        lock = Lock(backend, key)
        lock.acquire()
        lock.release()
    return ops / (time.perf_counter() - started)


async def async_rate(url: str, ops: int) -> float:
    backend = backend_from_url(url)
    key = f"bench:aio:{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    for _ in range(ops):
        lock = AsyncLock(backend, key)
        await lock.acquire()
        await lock.release()
    return ops / (time.perf_counter() - started)


async def ticker(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(TICK)
        lags.append(time.perf_counter() - before - TICK)


async def idle_lag(seconds: float) -> list[float]:
    lags: list[float] = []
    stop = asyncio.Event()
    task = asyncio.ensure_future(ticker(stop, lags))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    return lags


async def contended(url: str, ops: int) -> tuple[float, list[float]]:
    backend = backend_from_url(url)
    keys = [f"bench:aio:hot:{uuid.uuid4().hex[:6]}:{n}" for n in range(10)]
    lags: list[float] = []
    stop = asyncio.Event()
    done = 0

    async def worker(count: int) -> None:
        nonlocal done
        for _ in range(count):
            key = random.choice(keys[:3]) if random.random() < 0.5 else random.choice(keys)
            async with AsyncLock(backend, key, wait=None):
                await asyncio.sleep(0)
            done += 1

    task = asyncio.ensure_future(ticker(stop, lags))
    started = time.perf_counter()
    await asyncio.gather(*(worker(ops // 50) for _ in range(50)))
    elapsed = time.perf_counter() - started
    stop.set()
    await task
    return done / elapsed, lags


def summary(lags: list[float]) -> str:
    ordered = sorted(lags)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"median {statistics.median(ordered) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms, "
        f"max {ordered[-1] * 1000:.2f} ms ({len(ordered)} ticks)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=sorted(URLS), default="postgres")
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    url = URLS[options.store]
    if url.startswith("postgres"):
        backend_from_url(url).migrate()  # type: ignore[attr-defined]
    syncs, asyncs, ratios, loads = [], [], [], []
    busy: list[float] = []
    idle: list[float] = []
    for _ in range(options.rounds):
        syncs.append(sync_rate(url, options.ops))
        asyncs.append(asyncio.run(async_rate(url, options.ops)))
        ratios.append(asyncs[-1] / syncs[-1])
        rate, lags = asyncio.run(contended(url, options.ops))
        loads.append(rate)
        busy += lags
        idle += asyncio.run(idle_lag(2.0))
    sync, aio = statistics.median(syncs), statistics.median(asyncs)
    native = backend_from_url(url).async_store() is not None
    path = "the store's asyncio client" if native else "the offload threads"
    print(f"store {options.store} ({url}), {options.ops} ops x {options.rounds} rounds, medians")
    print(f"sync Lock acquire+release:          {sync:9.0f} /s  (floor)")
    print(
        f"AsyncLock acquire+release:          {aio:9.0f} /s  = "
        f"{statistics.median(ratios):.2f}x the floor (per-round ratios "
        f"{', '.join(f'{r:.2f}' for r in ratios)}), through {path}"
    )
    print(f"50 coroutines, 10 hot keys (async): {statistics.median(loads):9.0f} /s")
    print(f"loop lag, idle loop:        {summary(idle)}")
    print(f"loop lag, 50 coroutines:    {summary(busy)}")


if __name__ == "__main__":
    main()
