"""Many lock holders, few server connections: Postgres ``liveness=ttl`` through PgBouncer in
transaction mode, beside the session store where it fits under ``max_connections``.

    python bench/bench_scale.py [--processes 40] [--threads 10] [--seconds 20] [--pool 20]

Clients are threads across processes: ``--processes`` worker processes of ``--threads``
threads each (400 by default), every thread a lock-holding client of its own ``Lock``s.
Each process's blocking client has one connection (its threads take turns on it), so 40
processes are 40 client connections, which PgBouncer serves with ``--pool`` (20) server
connections. The threads contend for 1,000 keys with hot spots (half of all acquires go to
the 10 hottest keys) for a fixed time, each holding its key about 1 ms, and log every
critical section (key, fence, start, end on the host's monotonic clock, shared by all its
processes). The run prints throughput and acquire latency, and the check of the log: no
two sections of a key overlap, and fences rise in the order the sections ran.

The session store runs the same load directly (40 lock sessions and at most one waiter
connection each: 80 of the server's connections), side by side. PgBouncer is Debian's
``pgbouncer``, started here on a free port and stopped at the end; the schemas are made
and dropped here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from celery_dlock import Lock, LockTimeoutError, backend_from_url

SERVER = os.environ.get("DLOCK_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
KEYS = [f"bench:scale:{n}" for n in range(1000)]
HOT = KEYS[:10]


def worker(url: str, threads: int, seconds: float, start_file: str, log: str) -> None:
    """One worker process: ``threads`` clients until ``seconds`` after the start file."""
    backend = backend_from_url(url)
    sections: list[tuple[str, int, float, float, float]] = []
    timeouts = 0
    mutex = threading.Lock()
    while not os.path.exists(start_file):
        time.sleep(0.005)
    deadline = time.monotonic() + seconds

    def client() -> None:
        nonlocal timeouts
        rng = random.Random()
        while time.monotonic() < deadline:
            key = rng.choice(HOT) if rng.random() < 0.5 else rng.choice(KEYS)
            asked = time.monotonic()
            lock = Lock(backend, key, wait=10)
            try:
                lease = lock.acquire()
            except LockTimeoutError:
                with mutex:
                    timeouts += 1
                continue
            began = time.monotonic()
            time.sleep(0.001)
            ended = time.monotonic()
            lock.release()
            with mutex:
                sections.append((key, lease.fence, began, ended, began - asked))

    pool = [threading.Thread(target=client) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    backend.close()
    Path(log).write_text(json.dumps({"sections": sections, "timeouts": timeouts}))


def check(sections: list[tuple[str, int, float, float, float]]) -> tuple[int, int]:
    """(overlaps, fences out of order) among ``sections``, key by key."""
    by_key: dict[str, list[tuple[str, int, float, float, float]]] = {}
    for section in sections:
        by_key.setdefault(section[0], []).append(section)
    overlaps = disorder = 0
    for taken in by_key.values():
        taken.sort(key=lambda s: s[2])
        for before, after in itertools.pairwise(taken):
            overlaps += after[2] < before[3]
            disorder += after[1] <= before[1]
    return overlaps, disorder


def run(url: str, options: argparse.Namespace) -> dict[str, float]:
    backend = backend_from_url(url)
    backend.migrate()  # type: ignore[attr-defined]
    backend.close()
    with tempfile.TemporaryDirectory() as folder:
        start = os.path.join(folder, "start")
        logs = [os.path.join(folder, f"log{n}") for n in range(options.processes)]
        args = [str(options.threads), str(options.seconds), start]
        processes = [
            subprocess.Popen([sys.executable, __file__, "--worker", url, *args, log])
            for log in logs
        ]
        time.sleep(2.0)  # imports and connections before the start
        Path(start).write_text("go")
        for process in processes:
            if process.wait(timeout=options.seconds + 120) != 0:
                raise SystemExit(f"a worker failed with exit code {process.returncode}")
        found = [json.loads(Path(log).read_text()) for log in logs]
    sections = [tuple(s) for f in found for s in f["sections"]]
    overlaps, disorder = check(sections)
    waits = sorted(s[4] for s in sections)
    return {
        "acquires": len(sections),
        "per_s": len(sections) / options.seconds,
        "p50_ms": statistics.median(waits) * 1000,
        "p99_ms": waits[int(len(waits) * 0.99)] * 1000,
        "timeouts": sum(f["timeouts"] for f in found),
        "overlaps": overlaps,
        "disorder": disorder,
    }


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        url, threads, seconds, start, log = sys.argv[2:7]
        worker(url, int(threads), float(seconds), start, log)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=40)
    parser.add_argument("--threads", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--pool", type=int, default=20, help="PgBouncer's server connections")
    options = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.support.pgbouncer import pgbouncer  # a real PgBouncer, as the tests start it
    from tests.support.services import drop_schema, postgres_admin

    admin = postgres_admin()
    schema = f"dlock_scale_{os.urandom(4).hex()}"
    clients = options.processes * options.threads
    print(
        f"{clients} clients ({options.processes} processes x {options.threads} threads), "
        f"1,000 keys (half the acquires on 10 hot ones), {options.seconds:.0f} s each"
    )
    try:
        with pgbouncer("transaction", options.pool) as pooled:
            ttl = run(f"{pooled}?schema={schema}&liveness=ttl&ttl=30", options)
        session = run(f"{SERVER}?schema={schema}&max_waiters=1", options)
    finally:
        drop_schema(admin, schema)
        admin.close()
    rows = [
        (f"liveness=ttl via PgBouncer, {options.pool} server conns", ttl),
        (f"session, direct ({options.processes} + up to {options.processes} waiters)", session),
    ]
    for name, got in rows:
        print(
            f"{name:<52} {got['per_s']:8.0f} acquires/s  acquire p50 {got['p50_ms']:6.1f} ms  "
            f"p99 {got['p99_ms']:7.1f} ms  timeouts {got['timeouts']:.0f}  "
            f"overlaps {got['overlaps']:.0f}  fences out of order {got['disorder']:.0f}  "
            f"({got['acquires']:.0f} sections)"
        )


if __name__ == "__main__":
    main()
