"""Postgres backend: uncontended pairs against a raw advisory-lock floor, and contended handoff.

    python bench/bench_postgres.py [--url postgresql://postgres@127.0.0.1/test]
        [--rounds 5] [--seconds 1.0] [--processes 8] [--contended-rounds 2]
        [--contended-seconds 4.0]

All in one run, on one server, in a schema of its own (dropped at the end):

Uncontended, interleaved round by round (``benchlib``), pairs/s and p50/p99 of one pair:
- ``raw advisory`` (the floor): psycopg 3, ``SELECT pg_try_advisory_lock(k)`` then
  ``SELECT pg_advisory_unlock(k)``, autocommit, prepared: 2 round trips.
- ``celery_dlock``: ``PostgresBackend.try_acquire`` + ``release`` (fence, locks table,
  history record): 2 round trips.
- ``celery_dlock Lock``: the same through ``with Lock(...)``.
- ``PALs`` (if installed): ``Locker.lock(name).acquire(blocking=False)`` + ``release()``.

Server CPU (``--server-pairs``, or alone with ``--only-server-cpu``): the Postgres backend's
CPU per pair, and the WAL writer's, from ``/proc/<pid>/stat`` (the server on this host),
against the raw advisory pair, the floor of any lease with a visible row (a row inserted and
deleted in an unlogged table, in two transactions: two xids, two commit records, asynchronous
commit as the lock session's), and the floor of such a lease with a history: the same row,
its delete writing a record into a copy of the history table (``RecordFloor``). What
celery_dlock pays beyond the last is its fence and liveness (``nextval``, the grant's and the
lease's advisory locks, the waiters' check).

Contended, ``--processes`` processes on one key, interleaved round by round: each process
takes the lock (waiting without limit), runs a read-modify-write of a shared counter file,
and releases. Handoff = from the holder's ``release()`` returning to another process's acquire
returning (monotonic clock, shared by the processes of this host); with a server push the next
holder can be granted before the old one has its reply, so handoffs can be negative. Also
shown: from the holder *calling* release (the anchor's definition), lost updates, how often the
releasing process took the key straight back, and client CPU per acquisition (a busy poll would
show there).
- ``celery_dlock``: ``Lock(backend, key, wait=None)``: waits on the holder's advisory lock.
- ``raw pg_advisory_lock``: blocking ``pg_advisory_lock(k)`` under ``lock_timeout = 5s``.

Targets (issue 3): celery_dlock >= 0.5x the floor (PALs reaches 0.13-0.18x on this machine
type), handoff p99 <= 2 ms with no busy polling.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import psycopg
from benchlib import interleaved, our_variants, percentile, print_table, ratio_per_round

from celery_dlock import Lock
from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.records import Holder

FLOOR = "raw advisory"
RAW_KEY = 4242
#: Postgres CPU per uncontended acquire+release, backend and WAL writer (issue 14).
SERVER_TARGET_US = 50.0
#: The server-CPU floor of a lease with a row: two transactions that write.
ROWS_FLOOR = "a row inserted + deleted"
#: What a lease with a history costs at least: the row floor, its delete writing a record
#: into a copy of the history table (same columns, keys and indexes) in the same statement.
RECORD_FLOOR = "a row inserted + deleted into a history record"


def uncontended(url: str, schema: str, rounds: int, seconds: float) -> None:
    conn = psycopg.connect(url, autocommit=True)
    cursor = conn.cursor()

    pals_used = [False]

    def raw() -> None:
        if pals_used[0]:  # first call of a round, in the untimed warm-up
            pals_used[0] = False
            if engine is not None:
                # PALs' check-in hook leaves its pooled connection idle in a transaction,
                # whose snapshot would hold back the cleanup of our locks table in the next
                # variants: close it (PALs reconnects in its own warm-up).
                engine.dispose()
        cursor.execute("SELECT pg_try_advisory_lock(%s)", (RAW_KEY,), prepare=True)
        cursor.fetchone()
        cursor.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,), prepare=True)
        cursor.fetchone()

    backend = PostgresBackend.from_url(f"{url}?schema={schema}")
    engine: Any = None
    variants: dict[str, Callable[[], object]] = {
        FLOOR: raw,
        **our_variants(backend),
    }
    try:
        import pals

        engine_url = url.replace("postgresql://", "postgresql+psycopg://", 1)
        locker = pals.Locker("bench", engine_url)
        engine = locker.engine
        pals_lock = locker.lock("job:bench-pals", blocking=False)

        def pals_pair() -> None:
            pals_used[0] = True
            assert pals_lock.acquire()
            pals_lock.release()

        variants["PALs (SQLAlchemy+psycopg3)"] = pals_pair
    except ImportError:
        print("PALs is not installed: pip install pals to compare")

    print(f"uncontended, {rounds} rounds × {seconds} s per variant")
    results = interleaved(variants, rounds, seconds)
    print_table(results, floor=FLOOR)
    ratio = statistics.median(ratio_per_round(results, "celery_dlock", FLOOR))
    verdict = "meets" if ratio >= 0.5 else "MISSES"
    print(f"\ncelery_dlock / {FLOOR} = {ratio:.2f} ({verdict} the target of ≥ 0.50)")
    records = len(backend.history(limit=None))
    print(f"history records written during the run: {records:,}")
    backend.close()
    conn.close()
    if engine is not None:
        engine.dispose()


# -- server CPU -----------------------------------------------------------------------------

#: Clock ticks per second of /proc/<pid>/stat's utime and stime.
_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int) -> float:
    """Seconds of CPU process ``pid`` has used (user + system), from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def server_cpu(url: str, schema: str, rounds: int, pairs: int) -> None:
    """Postgres CPU per uncontended pair (issue 14, item 4): the serving backend's, and the
    WAL writer's, read from ``/proc`` around ``pairs`` pairs (the server runs on this host).
    Variants interleave round by round; medians, min-max beside them."""
    admin = psycopg.connect(url, autocommit=True)
    row = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'"
    ).fetchone()
    walwriter = int(row[0]) if row else None
    raw_conn = psycopg.connect(url, autocommit=True)
    cursor = raw_conn.cursor()

    def raw() -> None:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", (RAW_KEY,), prepare=True)
        cursor.fetchone()
        cursor.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,), prepare=True)
        cursor.fetchone()

    # The floor of any lease with a visible row: two transactions that each write (a row
    # inserted, then deleted, in an unlogged table with a primary key): two xids, two
    # commit records, the WAL writer woken for them.
    rows_conn = psycopg.connect(url, autocommit=True)
    rows_conn.execute("SET synchronous_commit = off")  # as the lock session
    table = f'"{schema}".bench_rows'
    rows_conn.execute(
        f'CREATE UNLOGGED TABLE {table} (key text COLLATE "C" PRIMARY KEY, token text)'
    )
    rows_cursor = rows_conn.cursor()
    tokens = itertools.count()

    def rows() -> None:
        token = str(next(tokens))
        rows_cursor.execute(
            f"INSERT INTO {table} VALUES (%s, %s)", ("job:rows", token), prepare=True
        )
        rows_cursor.execute(
            f"DELETE FROM {table} WHERE key = %s AND token = %s", ("job:rows", token), prepare=True
        )

    backend = PostgresBackend.from_url(f"{url}?schema={schema}")
    ours = our_variants(backend, key="job:server-cpu")["celery_dlock"]
    ours()  # opens the lock session, and migrates: the history table is there
    records = RecordFloor(url, schema)
    pids = {
        FLOOR: int(raw_conn.info.backend_pid),
        ROWS_FLOOR: int(rows_conn.info.backend_pid),
        RECORD_FLOOR: records.pid,
        "celery_dlock": int(backend.session_info()["backend_pid"]),
    }
    calls = {FLOOR: raw, ROWS_FLOOR: rows, RECORD_FLOOR: records, "celery_dlock": ours}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(200):  # warm
                call()
            wal = _cpu_of(walwriter) if walwriter else 0.0
            before = _cpu_of(pids[name])
            for _ in range(pairs):
                call()
            spent = _cpu_of(pids[name]) - before
            wal = (_cpu_of(walwriter) - wal) if walwriter else 0.0
            samples[name].append((spent / pairs * 1e6, wal / pairs * 1e6))
    _print_server_cpu(samples, rounds, pairs)
    backend.close()
    raw_conn.close()
    rows_conn.close()
    records.close()
    admin.close()


class RecordFloor:
    """``RECORD_FLOOR``: a lease row (holder JSON and times, as ours) inserted, then deleted
    by a statement that writes its record into ``bench_history``, a ``LIKE ... INCLUDING
    ALL`` copy of the store's history table; two autocommit statements, asynchronous
    commit. No fence, no advisory lock: what a lease with a history costs without them."""

    def __init__(self, url: str, schema: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute("SET synchronous_commit = off")
        self.pid = int(self.conn.info.backend_pid)
        self.rows, history = f'"{schema}".bench_leases', f'"{schema}".bench_history'
        self.conn.execute(
            f'CREATE UNLOGGED TABLE {self.rows} (LIKE "{schema}".locks INCLUDING ALL)'
        )
        self.conn.execute(f'CREATE TABLE {history} (LIKE "{schema}".history INCLUDING ALL)')
        self.insert = (
            f"INSERT INTO {self.rows} (key, token, fence, holder, acquired_at, expires_at, "
            "backend_pid) VALUES (%(key)s, %(token)s, 1, %(holder)s::json, clock_timestamp(), "
            "NULL, pg_backend_pid())"
        )
        self.delete = (
            f"WITH gone AS (DELETE FROM {self.rows} WHERE key = %(key)s AND token = %(token)s "
            "RETURNING *)\n"
            f"INSERT INTO {history} (key, token, fence, holder, acquired_at, expires_at, "
            "released_at, outcome) SELECT key, token, fence, holder, acquired_at, expires_at, "
            "now(), 'succeeded' FROM gone RETURNING released_at"
        )
        self.holder = Holder.current().to_json()
        self.cursor = self.conn.cursor()
        self.tokens = itertools.count()

    def __call__(self) -> None:
        params = {"key": "job:records", "token": str(next(self.tokens)), "holder": self.holder}
        self.cursor.execute(self.insert, params, prepare=True)
        self.cursor.execute(self.delete, params, prepare=True)
        self.cursor.fetchone()

    def close(self) -> None:
        self.conn.close()


def _print_server_cpu(
    samples: dict[str, list[tuple[float, float]]], rounds: int, pairs: int
) -> None:
    print(f"\nserver CPU per uncontended pair, {rounds} rounds × {pairs:,} pairs (from /proc)")
    print("| variant | backend µs/pair | WAL writer µs/pair | sum |")
    print("|---|---|---|---|")
    for name, values in samples.items():
        own = sorted(v[0] for v in values)
        wal_values = sorted(v[1] for v in values)
        total = sorted(v[0] + v[1] for v in values)
        cells = [
            f"{statistics.median(xs):.1f} ({xs[0]:.1f}–{xs[-1]:.1f})"
            for xs in (own, wal_values, total)
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    total = statistics.median(v[0] + v[1] for v in samples["celery_dlock"])
    for name in (ROWS_FLOOR, RECORD_FLOOR):
        floor = statistics.median(v[0] + v[1] for v in samples[name])
        print(f"\ncelery_dlock / {name} = {total / floor:.2f}x server CPU", end="")
    print()
    verdict = "meets" if total <= SERVER_TARGET_US else "MISSES"
    print(
        f"\ncelery_dlock server CPU = {total:.1f} µs per acquire+release "
        f"({verdict} the target of ≤ {SERVER_TARGET_US:.0f} µs)"
    )


# -- contended ------------------------------------------------------------------------------


def worker(kind: str, url: str, go: str, *, stop_at: float, counter: str, out: str) -> None:
    """One contender: acquire, read-modify-write ``counter``, release, until ``stop_at``."""
    events: list[tuple[float, float, float]] = []
    if kind == "ours":
        backend = PostgresBackend.from_url(url)
        holder = Holder.current()
        backend.get("job:contended")  # connect before the start

        def take() -> Callable[[], object]:
            lock = Lock(backend, "job:contended", wait=None, holder=holder)
            lock.acquire()
            return lock.release

    else:
        conn = psycopg.connect(url, autocommit=True)
        conn.execute("SET lock_timeout = '5s'")
        cursor = conn.cursor()

        def take() -> Callable[[], object]:
            cursor.execute("SELECT pg_advisory_lock(%s)", (RAW_KEY,), prepare=True)
            cursor.fetchone()

            def release() -> None:
                cursor.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,), prepare=True)
                cursor.fetchone()

            return release

    while not os.path.exists(go):
        time.sleep(0.001)
    cpu = time.process_time()
    while time.monotonic() < stop_at:
        release = take()
        acquired = time.monotonic()
        with open(counter, "r+") as f:
            value = int(f.read() or 0)
            f.seek(0)
            f.write(str(value + 1))
            f.truncate()
        calling = time.monotonic()
        release()
        events.append((acquired, calling, time.monotonic()))
    cpu = time.process_time() - cpu
    Path(out).write_text(json.dumps({"pid": os.getpid(), "cpu": cpu, "events": events}))
    if kind == "ours":
        backend.close()
    else:
        conn.close()


def contended_run(kind: str, url: str, processes: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        go, counter = os.path.join(tmp, "go"), os.path.join(tmp, "counter")
        Path(counter).write_text("0")
        stop_at = time.monotonic() + seconds + 2.0  # the processes start within 2 s
        outs = [os.path.join(tmp, f"out{n}") for n in range(processes)]
        me = str(Path(__file__))
        children = [
            subprocess.Popen(
                [sys.executable, me, "--worker", kind, url, go, str(stop_at), counter, out]
            )
            for out in outs
        ]
        time.sleep(1.5)  # imports and connections, before the start line
        Path(go).touch()
        for child in children:
            child.wait(timeout=seconds + 60)
        reports = [json.loads(Path(out).read_text()) for out in outs]
        count = int(Path(counter).read_text())
    return summarise(reports, count, seconds)


def summarise(reports: list[dict[str, Any]], count: int, seconds: float) -> dict[str, Any]:
    grants = sorted(
        (acquired, calling, released, report["pid"])
        for report in reports
        for acquired, calling, released in report["events"]
    )
    handoffs, from_call, same = [], [], 0
    for previous, current in itertools.pairwise(grants):
        if previous[3] == current[3]:
            same += 1
            continue
        handoffs.append(current[0] - previous[2])
        from_call.append(current[0] - previous[1])
    handoffs.sort()
    from_call.sort()
    shares = [len(report["events"]) / max(1, len(grants)) for report in reports]
    return {
        "acquisitions": len(grants),
        "per_s": len(grants) / seconds,
        "lost_updates": len(grants) - count,
        "handoff_p50_us": percentile(handoffs, 0.5) * 1e6,
        "handoff_p99_us": percentile(handoffs, 0.99) * 1e6,
        "from_call_p50_us": percentile(from_call, 0.5) * 1e6,
        "from_call_p99_us": percentile(from_call, 0.99) * 1e6,
        "reacquire": same / max(1, len(grants) - 1),
        "fairness": f"{min(shares):.3f} / {max(shares):.3f}",
        "cpu_ms_per_acq": 1e3 * sum(r["cpu"] for r in reports) / max(1, len(grants)),
    }


def contended(url: str, schema: str, processes: int, rounds: int, seconds: float) -> None:
    kinds = {
        "celery_dlock": ("ours", f"{url}?schema={schema}"),
        "raw pg_advisory_lock": ("raw", url),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in kinds}
    for _ in range(rounds):
        for name, (kind, target) in kinds.items():
            runs[name].append(contended_run(kind, target, processes, seconds))
    print(f"\ncontended: {processes} processes, one key, {rounds} rounds × {seconds} s")
    columns = [
        ("acq/s", "per_s", "{:,.0f}"),
        ("handoff p50 µs", "handoff_p50_us", "{:,.0f}"),
        ("handoff p99 µs", "handoff_p99_us", "{:,.0f}"),
        ("from release call p50 / p99 µs", None, ""),
        ("lost updates", "lost_updates", "{:.0f}"),
        ("reacquire", "reacquire", "{:.2f}"),
        ("client CPU ms/acq", "cpu_ms_per_acq", "{:.2f}"),
    ]
    print("| variant | " + " | ".join(title for title, _, _ in columns) + " | fairness min/max |")
    print("|" + "---|" * (len(columns) + 2))
    for name, samples in runs.items():
        cells = []
        for _, field, form in columns:
            if field is None:
                p50 = statistics.median(s["from_call_p50_us"] for s in samples)
                p99 = statistics.median(s["from_call_p99_us"] for s in samples)
                cells.append(f"{p50:,.0f} / {p99:,.0f}")
                continue
            values = [s[field] for s in samples]
            low, high = form.format(min(values)), form.format(max(values))
            cells.append(f"{form.format(statistics.median(values))} ({low}–{high})")
        print(f"| {name} | " + " | ".join(cells) + f" | {samples[-1]['fairness']} |")
    p99 = statistics.median(s["handoff_p99_us"] for s in runs["celery_dlock"])
    verdict = "meets" if p99 <= 2000 else "MISSES"
    print(f"\ncelery_dlock handoff p99 = {p99:,.0f} µs ({verdict} the target of ≤ 2,000 µs)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, url, go, stop_at, counter, out = sys.argv[2:8]
        worker(kind, url, go, stop_at=float(stop_at), counter=counter, out=out)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--contended-rounds", type=int, default=2)
    parser.add_argument("--contended-seconds", type=float, default=4.0)
    parser.add_argument("--skip-contended", action="store_true")
    parser.add_argument("--server-pairs", type=int, default=5000)
    parser.add_argument("--only-server-cpu", action="store_true")
    options = parser.parse_args()

    schema = f"dlock_bench_{os.urandom(4).hex()}"
    PostgresBackend.from_url(f"{options.url}?schema={schema}").migrate()
    try:
        if options.only_server_cpu:
            server_cpu(options.url, schema, options.rounds, options.server_pairs)
            return
        uncontended(options.url, schema, options.rounds, options.seconds)
        server_cpu(options.url, schema, options.rounds, options.server_pairs)
        if not options.skip_contended:
            contended(
                options.url,
                schema,
                options.processes,
                options.contended_rounds,
                options.contended_seconds,
            )
    finally:
        with psycopg.connect(options.url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


if __name__ == "__main__":
    main()
