"""How soon a waiter for a key with a ``limit`` gets a slot another holder frees.

    python bench/bench_limit_wait.py [--store postgres|redis|file|memory] [--rounds 40]

For one store, in one process, each round: holders fill the key (``limit=2``: both slots;
``limit=1``: the key itself), a waiter thread blocks in ``acquire``, and one holder releases
(with ``limit=2``, a slot picked at random). The wake latency is the time from the start of
the release (its round trip included) to the waiter's acquire returning. ``limit=1`` is the
floor: a waiter on the very key released, woken by the store's push. Rounds of the two
kinds alternate. p50, p99 and max. Run from a checkout with ``PYTHONPATH=.`` to measure
that checkout's package.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
import uuid

from celery_dlock import Lock, backend_from_url
from celery_dlock.backends.base import LockBackend

URLS = {
    "postgres": os.environ.get("DLOCK_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"),
    "redis": os.environ.get("DLOCK_BENCH_REDIS", "redis://127.0.0.1:6379/6"),
    "file": "file:///tmp/dlock-bench-limit-wait",
    "memory": "memory://",
}


def one_round(holders: LockBackend, waiters: LockBackend, limit: int) -> float:
    """Seconds from a release to the acquire of the waiting thread."""
    key = f"bench:limit-wait:{uuid.uuid4().hex}"
    held = [Lock(holders, key, limit=limit) for _ in range(limit)]
    for lock in held:
        lock.acquire()
    waiter = Lock(waiters, key, wait=30, limit=limit)
    got = threading.Event()
    woke: list[float] = []

    def wait() -> None:
        waiter.acquire()
        woke.append(time.perf_counter())
        got.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.05)  # the waiter is blocked in the store's wait by now (or soon after)
    freed = random.choice(held)
    released = time.perf_counter()
    freed.release()
    got.wait(30)
    thread.join(30)
    waiter.release()
    for lock in held:
        if lock is not freed:
            lock.release()
    return woke[0] - released


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=sorted(URLS), default="redis")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    url = URLS[args.store]
    holders = backend_from_url(url)
    if args.store == "postgres":
        holders.migrate()  # type: ignore[attr-defined]
    waiters = holders if args.store == "memory" else backend_from_url(url)
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for limit in (1, 2):
            times[limit].append(one_round(holders, waiters, limit))
    for limit, found in times.items():
        found.sort()
        p50 = statistics.median(found) * 1000
        p99 = found[min(len(found) - 1, int(len(found) * 0.99))] * 1000
        label = "limit=1 (floor)" if limit == 1 else "limit=2"
        print(
            f"{args.store:8} {label:16} wake p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  "
            f"max {found[-1] * 1000:7.2f} ms  ({len(found)} rounds)"
        )


if __name__ == "__main__":
    main()
