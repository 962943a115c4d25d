"""History at 10,000,000 records on Postgres (issue 17, item 6): the time of ``history --key K``
and of the newest-first listing, their query plans, and the table's bytes per record.

    python bench/bench_history.py [--url postgresql://postgres@127.0.0.1/test]
        [--records 10000000] [--keys 100000] [--repeat 200]

In a schema of its own, dropped at the end. The records are written straight into the
history table, ``1,000,000`` per ``INSERT ... SELECT generate_series`` with the indexes in
place (so they grow as they do in use), then ``VACUUM ANALYZE`` as autovacuum would. They
look like a Celery worker's: released over the last 30 days in order, ``--keys`` keys in
turn (100 records per key by default), a holder with host, pid, worker, task id and task
name (~270 bytes of JSON), 1 % ``failed`` with a short message and traceback, 1 %
``retried``, the rest ``succeeded`` without a result.

Timed, warm, ``--repeat`` times each through ``PostgresBackend.history`` (the call the CLI,
the web page and the API make; prepared statements, as in use), with the CLI's default limit
of 50: ``--key K`` (a key in the middle of the table), the newest-first listing (no filter),
``--outcome failed`` (the store's query per outcome of ``--problems``), ``--key K
--since 1d``, and ``--key`` with another key each run (its pages not in shared_buffers
yet). Each plan is printed from ``EXPLAIN (ANALYZE, BUFFERS)`` of the backend's own
statement, once as a custom plan and once as the generic plan a prepared statement may
switch to after five runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import psycopg
from benchlib import percentile

from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.backends.postgres.sql import Names
from celery_dlock.backends.postgres.statements import Statements
from celery_dlock.records import Outcome

CHUNK = 1_000_000
TARGET_MS = 10.0
#: A holder as a Celery worker writes it (see ``Holder.to_dict``), varied per record.
HOLDER = (
    "json_build_object('host', 'worker-' || (g %% 40), 'pid', 1000 + g %% 5000, "
    "'started', 949.3, 'host_id', 'a9f9bd8e-fdc9-42f1-a7bc-f3a454138e43/pid:[4026531836]', "
    "'nonce', substr(md5(g::text), 1, 16), 'worker', "
    "'celery@worker-' || (g %% 40) || '.prod.example.com', 'task_id', "
    "md5('task' || g)::uuid::text, 'task_name', 'proj.billing.tasks.charge_order')"
)
DETAILS = (
    "'ValueError: card declined for order ' || g || E'\\nTraceback (most recent call last):\\n"
    '  File "/srv/proj/billing/tasks.py", line 42, in charge_order\\n'
    "    gateway.charge(order)\\nValueError: card declined'"
)


def load(admin: psycopg.Connection[Any], schema: str, records: int, keys: int) -> None:
    history = f'"{schema}".history'
    for first in range(1, records + 1, CHUNK):
        last = min(records, first + CHUNK - 1)
        started = time.perf_counter()
        admin.execute(
            f"INSERT INTO {history} (token, key, fence, holder, acquired_at, expires_at, "
            "released_at, outcome, problem, details, result) "
            f"SELECT md5('token' || g), 'job:order:' || (g %% %(keys)s), g, {HOLDER}, "
            "at - (g %% 10) * interval '1 second', NULL, at, "
            "CASE g %% 100 WHEN 0 THEN 'failed' WHEN 1 THEN 'retried' ELSE 'succeeded' END, "
            "CASE g %% 100 WHEN 0 THEN 'ValueError' END, "
            f"CASE g %% 100 WHEN 0 THEN {DETAILS} END, NULL "
            "FROM generate_series(%(first)s::int8, %(last)s::int8) AS g, "
            "LATERAL (SELECT now() - interval '30 days' "
            "+ g * (interval '30 days' / %(records)s)) AS t(at)",
            {"keys": keys, "first": first, "last": last, "records": records},
        )
        print(f"  records {first:,}-{last:,} in {time.perf_counter() - started:.1f} s", flush=True)
    started = time.perf_counter()
    admin.execute(f"VACUUM ANALYZE {history}")
    print(f"  VACUUM ANALYZE in {time.perf_counter() - started:.1f} s")


def sizes(admin: psycopg.Connection[Any], schema: str, records: int) -> None:
    history = f'"{schema}".history'
    rows = admin.execute(
        "SELECT pg_table_size(%(t)s::regclass), pg_indexes_size(%(t)s::regclass), "
        "pg_total_relation_size(%(t)s::regclass)",
        {"t": history},
    ).fetchone()
    assert rows is not None
    table, indexes, total = rows
    print(f"\nsize of {records:,} records")
    print("| part | bytes | bytes per record | per million records |")
    print("|---|---|---|---|")
    parts = [("table (heap, TOAST, maps)", table)]
    for name, size in admin.execute(
        "SELECT c.relname, pg_relation_size(c.oid) FROM pg_index AS i "
        "JOIN pg_class AS c ON c.oid = i.indexrelid WHERE i.indrelid = %s::regclass "
        "ORDER BY c.relname",
        (history,),
    ).fetchall():
        parts.append((f"index {name}", size))
    parts += [("indexes, all", indexes), ("total", total)]
    for name, size in parts:
        per_million = size / records * 1e6 / 2**20
        print(f"| {name} | {size:,} | {size / records:.0f} | {per_million:,.0f} MiB |")


def explain(admin: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> None:
    for mode in ("force_custom_plan", "force_generic_plan"):
        admin.execute(f"SET plan_cache_mode = {mode}")
        plan = admin.execute(f"EXPLAIN (ANALYZE, BUFFERS) {statement}", params).fetchall()
        print(f"  -- {mode.removeprefix('force_').replace('_', ' ')}:")
        for (line,) in plan:
            print(f"    {line}")
    admin.execute("RESET plan_cache_mode")


def timed(operation: Any, repeat: int) -> tuple[float, float, int]:
    """(median ms, p99 ms, rows) of ``operation`` run ``repeat`` times after a warm-up."""
    for _ in range(5):
        found = operation()
    durations = []
    for _ in range(repeat):
        started = time.perf_counter()
        found = operation()
        durations.append(time.perf_counter() - started)
    durations.sort()
    return statistics.median(durations) * 1e3, percentile(durations, 0.99) * 1e3, len(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url",
        default=os.environ.get("DLOCK_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    schema = f"dlock_bench_{os.urandom(4).hex()}"
    admin = psycopg.connect(args.url, autocommit=True)
    admin.execute("SET synchronous_commit = off")
    backend = PostgresBackend.from_url(
        f"{args.url}{'&' if '?' in args.url else '?'}schema={schema}"
    )
    try:
        backend.migrate()
        print(f"writing {args.records:,} records into schema {schema}")
        load(admin, schema, args.records, args.keys)
        sizes(admin, schema, args.records)
        key = f"job:order:{args.keys // 2}"
        day_ago = time.time() - 86400
        cases: list[tuple[str, dict[str, Any]]] = [
            (f"history --key {key}", {"key": key}),
            ("history (newest first)", {}),
            ("history --outcome failed", {"outcome": Outcome.FAILED}),
            (f"history --key {key} --since 1d", {"key": key, "since": day_ago}),
        ]
        statements = Statements(Names(schema, ""))
        print(f"\nwarm, {args.repeat} runs each, limit 50, through PostgresBackend.history")
        print("| query | median ms | p99 ms | records | target |")
        print("|---|---|---|---|---|")
        for name, filters in cases:
            median, p99, found = timed(
                lambda f=filters: backend.history(limit=50, **f), args.repeat
            )
            verdict = "meets" if p99 < TARGET_MS else "MISSES"
            print(f"| {name} | {median:.2f} | {p99:.2f} | {found} | {verdict} < {TARGET_MS:g} ms |")
        # Another key each run, none of them read before: its index and heap pages are not
        # in shared_buffers (they may be in the OS's page cache).
        unread = (f"job:order:{(7919 * i) % args.keys}" for i in itertools.count(1))
        median, p99, found = timed(lambda: backend.history(key=next(unread), limit=50), args.repeat)
        verdict = "meets" if p99 < TARGET_MS else "MISSES"
        name = "history --key (another key each run)"
        print(f"| {name} | {median:.2f} | {p99:.2f} | {found} | {verdict} < {TARGET_MS:g} ms |")
        print("\nplans (the backend's statements, EXPLAIN (ANALYZE, BUFFERS))")
        cases.append(
            (
                f"history --key job:order:{args.keys - 1} (read first here)",
                {"key": f"job:order:{args.keys - 1}"},
            )
        )
        for name, filters in cases:
            since = filters.get("since")
            statement, params = statements.history_of(
                filters.get("key"),
                None if "outcome" not in filters else Outcome(filters["outcome"]).value,
                None if since is None else datetime.fromtimestamp(since, tz=timezone.utc),
                50,
            )
            print(f"\n{name}:")
            explain(admin, statement, params)
    finally:
        backend.close()
        admin.close()
        with psycopg.connect(args.url, autocommit=True) as cleaner:  # even after a restart
            cleaner.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


if __name__ == "__main__":
    main()
