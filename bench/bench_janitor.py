"""The janitor at scale (issue 17, item 5): reaping 10,000 dead leases, and pruning 1,000,000
history records past retention while acquires run, on Postgres and on Redis.

    python bench/bench_janitor.py [--postgres URL] [--redis URL] [--stores postgres,redis]
        [--leases 10000] [--batches 100,1000] [--history 1000000] [--seconds 5]
        [--marks 100] [--rounds 5]

Everything happens in a schema (Postgres) or key prefix (Redis) of its own, dropped or
deleted at the end.

Reap: ``--leases`` dead leases, then one janitor run (``celery_dlock.reap.reap``, the
function the beat task runs, with its lock, logging and counts) with ``batch`` leases per
``backend.reap(limit=batch)`` call and enough batches to clear them all; timed from the call
to its return, for each ``--batches`` size. The janitor's log lines (one warning per lease)
go to a handler that writes to /dev/null, so their formatting is paid as in production.
- Postgres: the leases of processes that exited. Children acquire ``1,000`` keys each (one
  at a time: the server's shared lock table has room for ``max_locks_per_transaction ×
  max_connections`` advisory locks) and end with ``os._exit``; their sessions end, and the
  leases are dead by the store's own rule (no session holds their advisory lock). Each batch
  is one autocommit statement, so the row locks it takes last one batch.
- Redis: leases whose ttl (1 s) ran out on Redis's clock.

Prune: ``--history`` records released 40 to 10 days ago (written straight into the store:
one ``INSERT ... SELECT generate_series`` on Postgres, then ``VACUUM ANALYZE`` as autovacuum
would; ``XADD`` with explicit ids in a pipeline on Redis, with ``history_maxlen`` raised so
that the acquires' own records do not trim them). A child process acquires and releases
(50 keys in turn) all along; its ``try_acquire`` latency is summed up over ``--seconds``
before the prune and over the prune itself, which is one janitor run with a retention of
7 days (an acquire counts in a window when it was under way at some moment of it; the
longest release under way is shown beside).

Marks (``--marks``): ``--leases`` live leases of which ``--marks`` are dedupe marks of
queued messages (no run of theirs: each costs the look one history query of its lock key),
then ``--rounds`` looks of the janitor at them (``celery_dlock.marks.ran_marks``, what the
beat task runs at most every 150 s per worker process), each beside its floor: the listing
of the namespace's leases that a look starts with. Postgres with ``liveness=ttl`` (one
process cannot hold 10,000 session locks).

Targets (issue 17, item 5): a janitor run clears 10,000 dead leases in < 1 s on each store;
the prune does not block acquires. For the marks, none was set; the look's cost is printed
beside its listing's.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import psycopg
import redis
from benchlib import percentile

from celery_dlock.backends import backend_from_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.redis.fields import record_fields
from celery_dlock.backends.redis.layout import Layout
from celery_dlock.celery.dedupe import mark_key
from celery_dlock.marks import ran_marks
from celery_dlock.reap import reap
from celery_dlock.records import Holder, Lease, Outcome, Record

NAMESPACE = "bench"
PER_CHILD = 1_000
RETENTION = 7 * 86400.0
FORK = multiprocessing.get_context("fork")


# -- the stores --------------------------------------------------------------------------


@contextmanager
def postgres_store(server: str) -> Iterator[str]:
    """A migrated schema of its own; its URL. Dropped afterwards."""
    schema = f"dlock_bench_{os.urandom(4).hex()}"
    url = f"{server}{'&' if '?' in server else '?'}schema={schema}"
    backend = backend_from_url(url)
    backend.migrate()  # type: ignore[attr-defined]
    backend.close()
    try:
        yield url
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@contextmanager
def redis_store(server: str) -> Iterator[str]:
    """A key prefix of its own; its URL. Its keys are deleted afterwards."""
    prefix = f"dlock-bench-{os.urandom(4).hex()}"
    url = f"{server}{'&' if '?' in server else '?'}prefix={prefix}&history_maxlen=2000000"
    try:
        yield url
    finally:
        client = redis.Redis.from_url(server)
        for name in client.scan_iter(match=f"{{{prefix}}}*", count=10_000):
            client.unlink(name)
        client.close()


def prefix_of(url: str) -> str:
    return url.split("prefix=", 1)[1].split("&", 1)[0]


# -- reap ------------------------------------------------------------------------------------


def _hold_and_exit(url: str, first: int, count: int) -> None:
    """In a child: take ``count`` keys and end without releasing them."""
    backend = backend_from_url(url)
    holder = Holder.current()
    for i in range(first, first + count):
        assert backend.try_acquire(f"{NAMESPACE}:lease:{i}", holder, None) is not None
    os._exit(0)  # no release, no close: the server sees the session end


def dead_postgres_leases(url: str, count: int) -> None:
    for first in range(0, count, PER_CHILD):
        child = FORK.Process(
            target=_hold_and_exit, args=(url, first, min(PER_CHILD, count - first))
        )
        child.start()
        child.join()
        assert child.exitcode == 0
    schema = url.split("schema=", 1)[1].split("&", 1)[0]
    with psycopg.connect(url.split("?", 1)[0], autocommit=True) as admin:
        while admin.execute(  # their sessions' ends have reached the server
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'celery_dlock lock' "
            "AND pid IN (SELECT backend_pid FROM " + f'"{schema}".locks)'
        ).fetchone() != (0,):
            time.sleep(0.01)


def dead_redis_leases(url: str, count: int) -> None:
    backend = backend_from_url(url)
    holder = Holder.current()
    leases = [backend.try_acquire(f"{NAMESPACE}:lease:{i}", holder, 1.0) for i in range(count)]
    last = max(lease.expires_at or 0.0 for lease in leases if lease is not None)
    while backend.server_time() <= last + 0.01:  # type: ignore[attr-defined]
        time.sleep(0.05)
    backend.close()


def timed_reap(
    backend: LockBackend, batch: int, count: int
) -> tuple[float, dict[str, int], list[float]]:
    """One janitor run that can clear ``count`` leases; its seconds, counts and the seconds
    of each ``backend.reap`` batch."""
    batches: list[float] = []
    store_reap = backend.reap

    def timed(limit: int = 100) -> list[Record]:
        started = time.perf_counter()
        try:
            return store_reap(limit)
        finally:
            batches.append(time.perf_counter() - started)

    backend.reap = timed  # type: ignore[method-assign]
    backend.get(f"{NAMESPACE}:warm")  # connected before the clock starts
    started = time.perf_counter()
    counts = reap(
        backend, namespace=NAMESPACE, batch=batch, max_batches=math.ceil(count / batch) + 1
    )
    took = time.perf_counter() - started
    backend.reap = store_reap  # type: ignore[method-assign]
    return took, counts, batches


def bench_reap(name: str, url: str, count: int, batch: int) -> None:
    if name == "postgres":
        dead_postgres_leases(url, count)
    else:
        dead_redis_leases(url, count)
    backend = backend_from_url(url)
    # Redis lists no expired lease; Postgres lists the dead ones until they are reaped.
    assert len(backend.leases(f"{NAMESPACE}:lease:")) == (count if name == "postgres" else 0)
    took, counts, batches = timed_reap(backend, batch, count)
    assert counts["reaped"] == count, counts
    assert backend.leases(f"{NAMESPACE}:lease:") == []
    kind = "disconnected" if name == "postgres" else "expired"
    assert counts[kind] == count, counts
    verdict = "meets" if took < 1.0 else "MISSES"
    print(
        f"| {name} | {count:,} {kind} | {batch} | {took:.3f} s ({verdict} < 1 s) "
        f"| {len(batches)} | {statistics.median(batches) * 1000:.1f} / {max(batches) * 1000:.1f} "
        f"| {sum(batches):.3f} s |"
    )
    backend.close()


# -- marks -----------------------------------------------------------------------------------


def bench_marks(name: str, url: str, count: int, marks: int, rounds: int) -> None:
    """``rounds`` looks at ``marks`` queued marks among ``count`` live leases, each after the
    listing alone; medians."""
    backend = backend_from_url(url + ("&liveness=ttl&ttl=600" if name == "postgres" else ""))
    holder = Holder.current()
    for i in range(count - marks):
        assert backend.try_acquire(f"{NAMESPACE}:lease:{i}", holder, 600.0) is not None
    for i in range(marks):
        queued = Holder.current(task_id=f"m{i}", task_name="bench.sync")
        lease = backend.try_acquire(mark_key(f"{NAMESPACE}:sync:{i}", "bench.sync"), queued, 60)
        assert lease is not None and backend.hand_over(lease, 3600.0) is not None
    listing, look = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        listed = backend.leases(f"{NAMESPACE}:")
        listing.append(time.perf_counter() - started)
        started = time.perf_counter()
        found = ran_marks(backend, f"{NAMESPACE}:", sample=marks)
        look.append(time.perf_counter() - started)
        assert len(listed) == count and found == [], (len(listed), found)
    ms = [statistics.median(times) * 1000 for times in (look, listing)]
    print(
        f"| {name} | {count:,} ({marks} marks) | {ms[0]:.1f} ms ({min(look) * 1000:.1f}"
        f"-{max(look) * 1000:.1f}) | {ms[1]:.1f} ms | {ms[0] / ms[1]:.2f} "
        f"| {(ms[0] - ms[1]) / marks:.2f} ms |"
    )
    backend.close()


# -- prune -----------------------------------------------------------------------------------


def holder_json() -> str:
    return json.dumps(Holder.current().to_dict(), separators=(",", ":"))


def old_history_postgres(url: str, count: int) -> None:
    schema = url.split("schema=", 1)[1].split("&", 1)[0]
    with psycopg.connect(url.split("?", 1)[0], autocommit=True) as admin:
        admin.execute(
            f'INSERT INTO "{schema}".history (token, key, fence, holder, acquired_at, '
            "expires_at, released_at, outcome, problem, details, result) "
            f"SELECT md5(g::text), '{NAMESPACE}:order:' || (g %% 20000), g, %s::json, "
            "at - interval '2 seconds', NULL, at, 'succeeded', NULL, NULL, NULL "
            "FROM generate_series(1, %s::int8) AS g, "
            "LATERAL (SELECT now() - interval '40 days' + g * (interval '30 days' / %s)) AS t(at)",
            (holder_json(), count, count),
        )
        admin.execute(f'VACUUM ANALYZE "{schema}".history')


def old_history_redis(url: str, count: int) -> None:
    client = redis.Redis.from_url(url.split("?", 1)[0])
    stream = Layout(prefix_of(url)).history(0)
    holder = Holder.current()
    start = time.time() - 40 * 86400
    step = 30 * 86400 / count
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        released = round(start + i * step, 6)
        lease = Lease(
            f"{NAMESPACE}:order:{i % 20000}",
            os.urandom(16).hex(),
            i + 1,
            holder,
            released - 2,
            None,
        )
        record = Record(lease, released, Outcome.SUCCEEDED, None, None, None)
        fields = record_fields(record)
        pipe.xadd(
            stream,
            dict(zip(fields[::2], fields[1::2], strict=True)),
            id=f"{int(released * 1000)}-{i}",
        )
        if len(pipe) >= 10_000:
            pipe.execute()
    pipe.execute()
    assert client.xlen(stream) == count
    client.close()


def _acquirer(url: str, ready: Any, stop: Any, out: Connection) -> None:
    """In a child: acquire and release until ``stop``; send (start, acquire seconds, release
    seconds) per pair."""
    backend = backend_from_url(url)
    holder = Holder.current()
    backend.get(f"{NAMESPACE}:warm")
    samples: list[tuple[float, float, float]] = []
    ready.set()
    i = 0
    while not stop.is_set():
        started = time.monotonic()
        lease = backend.try_acquire(f"{NAMESPACE}:acquire:{i % 50}", holder, 60.0)
        acquired = time.monotonic()
        assert lease is not None
        backend.release(lease, Outcome.SUCCEEDED)
        samples.append((started, acquired - started, time.monotonic() - acquired))
        i += 1
    out.send(samples)
    backend.close()


def summary(samples: list[tuple[float, float, float]], low: float, high: float) -> str:
    """Latency of the acquires under way at some time between ``low`` and ``high``, and the
    longest release under way then."""
    window = sorted(took for at, took, _ in samples if at <= high and at + took >= low)
    releases = [
        took for at, acquire, took in samples if at + acquire <= high and at + acquire + took >= low
    ]
    if not window:
        return "no acquire in this window"
    return (
        f"{len(window):,} acquires, p50 {percentile(window, 0.5) * 1e3:.2f} ms, "
        f"p99 {percentile(window, 0.99) * 1e3:.2f} ms, max {window[-1] * 1e3:.2f} ms; "
        f"longest release {max(releases, default=0.0) * 1e3:.2f} ms"
    )


def bench_prune(name: str, url: str, count: int, seconds: float) -> None:
    started = time.perf_counter()
    (old_history_postgres if name == "postgres" else old_history_redis)(url, count)
    print(f"\n{name}: {count:,} old records written in {time.perf_counter() - started:.1f} s")
    ready, stop = FORK.Event(), FORK.Event()
    receive, send = FORK.Pipe(duplex=False)
    child = FORK.Process(target=_acquirer, args=(url, ready, stop, send))
    child.start()
    ready.wait(30)
    backend = backend_from_url(url)
    backend.get(f"{NAMESPACE}:warm")
    time.sleep(1.0)
    quiet = (time.monotonic(), time.monotonic() + seconds)
    time.sleep(seconds)
    began = time.monotonic()
    counts = reap(backend, namespace=NAMESPACE, retention=RETENTION)
    ended = time.monotonic()
    time.sleep(0.5)
    stop.set()
    samples = receive.recv()
    child.join()
    assert counts["pruned"] == count, counts
    print(f"{name}: pruned {counts['pruned']:,} records in {ended - began:.3f} s")
    print(f"  without the prune ({seconds:g} s): {summary(samples, *quiet)}")
    print(f"  during the prune ({ended - began:.3f} s): {summary(samples, began, ended)}")
    backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--postgres",
        default=os.environ.get("DLOCK_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--stores", default="postgres,redis")
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--batches", default="100,1000")
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--marks", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.marks > args.leases:
        parser.error(f"--marks {args.marks} is more than --leases {args.leases}: marks are leases")
    logger = logging.getLogger("celery_dlock.janitor")
    logger.propagate = False
    logger.addHandler(logging.StreamHandler(open(os.devnull, "w")))  # noqa: SIM115
    stores: dict[str, Callable[[], Any]] = {
        "postgres": lambda: postgres_store(args.postgres),
        "redis": lambda: redis_store(args.redis),
    }
    chosen = args.stores.split(",")
    if args.leases:
        print(f"reap: {args.leases:,} dead leases, one janitor run")
        columns = ["store", "leases", "batch", "janitor run", "batches", "batch ms median / max"]
        print(f"| {' | '.join(columns)} | in backend.reap |")
        print("|---|---|---|---|---|---|---|")
        for name in chosen:
            for batch in (int(size) for size in args.batches.split(",")):
                with stores[name]() as url:
                    bench_reap(name, url, args.leases, batch)
    if args.marks:
        print(f"\nmarks: a janitor's look at {args.marks} queued marks, {args.rounds} rounds")
        print("| store | live leases | look, median (min-max) | its listing | ratio | per mark |")
        print("|---|---|---|---|---|---|")
        for name in chosen:
            with stores[name]() as url:
                bench_marks(name, url, args.leases, args.marks, args.rounds)
    if args.history:
        for name in chosen:
            with stores[name]() as url:
                bench_prune(name, url, args.history, args.seconds)


if __name__ == "__main__":
    main()
