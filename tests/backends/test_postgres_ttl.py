"""``liveness=ttl`` on Postgres (``PostgresTTLBackend``) beyond the contract suite, which
runs on it through a real PgBouncer in transaction pooling mode: the URL's rules, no state
left on any session, locks without a ttl renewed by their ``Lock``, 12 processes over 4
server connections never overlapping, and the session store refused through the pooler
with an error that names the option."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import ConfigurationError, Lock, Outcome
from celery_dlock.backends.postgres import PostgresBackend, PostgresTTLBackend
from celery_dlock.backends.postgres.sql import Names
from tests.support.pgbouncer import POOL_SIZE, pgbouncer_url
from tests.support.services import peak_sessions, with_options

pytest.importorskip("psycopg")

CONTEND = str(Path(__file__).parent.parent / "support" / "contend.py")


@pytest.fixture
def url(schema: str) -> str:
    return with_options(pgbouncer_url(), schema=schema, liveness="ttl", ttl=30)


@pytest.fixture
def backend(url: str) -> Iterator[PostgresBackend]:
    made = PostgresBackend.from_url(url)
    made.migrate()
    yield made
    made.close()


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("liveness=ttl", ["liveness=ttl needs ttl=SECONDS"]),
        ("ttl=30", ["ttl= applies to liveness=ttl only"]),
        ("liveness=lease&ttl=3", ["liveness", "session or ttl"]),
        ("liveness=ttl&ttl=0", ["ttl", "positive"]),
    ],
)
def test_the_url_must_pair_liveness_ttl_with_a_ttl(query: str, words: list[str]) -> None:
    with pytest.raises(ConfigurationError) as refused:
        PostgresBackend.from_url(f"postgresql://postgres@127.0.0.1/test?{query}")
    for word in words:
        assert word in str(refused.value)


def test_from_url_gives_the_ttl_store_with_lease_liveness(backend: PostgresBackend) -> None:
    assert isinstance(backend, PostgresTTLBackend)
    assert backend.capabilities.liveness == "lease" and not backend.capabilities.push_wait
    assert backend.default_ttl == 30
    assert backend.async_store() is None  # AsyncLock goes through the pool


def test_no_advisory_lock_and_no_session_stands_for_a_lease(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    lock = Lock(backend, "job:ttl:stateless")
    lease = lock.acquire()
    row = admin.execute(
        f'SELECT backend_pid FROM "{schema}".locks WHERE key = %s', ("job:ttl:stateless",)
    ).fetchone()
    assert row == (0,)  # no session: alive by its ttl
    # Nothing left on any server connection in this schema's advisory key spaces (other
    # tests may hold theirs meanwhile).
    spaces = [Names(schema, "").key_space(s) & 0xFFFFFFFF for s in ("lease", "grant", "queue")]
    held = admin.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND classid = ANY(%s::oid[])",
        (spaces,),
    ).fetchone()
    assert held == (0,)
    assert lease.expires_at is not None
    assert lease.expires_at - lease.acquired_at == pytest.approx(30, abs=1e-3)
    assert lock.release() is not None


def test_a_lock_without_ttl_is_renewed_at_the_urls_ttl(schema: str) -> None:
    url = with_options(pgbouncer_url(), schema=schema, liveness="ttl", ttl=1)
    backend = PostgresBackend.from_url(url)
    backend.migrate()
    try:
        lock = Lock(backend, "job:ttl:renewed")
        assert lock.ttl == 1 and lock.renew_in_background
        first = lock.acquire()
        time.sleep(2.5)  # past two ttls: only the renewals keep it
        current = backend.get("job:ttl:renewed")
        assert current is not None and current.token == first.token
        assert not lock.lost
        record = lock.release()
        assert record is not None and record.outcome is Outcome.SUCCEEDED
    finally:
        backend.close()


def test_12_processes_over_4_server_connections_never_overlap(
    url: str, admin: Any, tmp_path: Path
) -> None:
    """Each process has a client connection of its own to PgBouncer, which runs their
    statements on its 4 server connections: no lost update, fences in the order granted."""
    name = f"dlock_ttl_{os.urandom(4).hex()}"  # PgBouncer sets it on the server connections
    url = with_options(url, application_name=name)
    PostgresBackend.from_url(url).migrate()
    counter, log, start = tmp_path / "counter", tmp_path / "fences", tmp_path / "start"
    counter.write_text("0")
    log.write_text("")
    rounds = 10
    args = [url, "job:ttl:contended", str(rounds), str(counter), str(log), str(start)]
    processes = [subprocess.Popen([sys.executable, CONTEND, *args]) for _ in range(12)]
    start.write_text("go")
    peak = peak_sessions(admin, name, processes)
    assert [p.wait(timeout=120) for p in processes] == [0] * 12
    assert int(counter.read_text()) == 12 * rounds  # no update lost: never two at once
    fences = [int(line) for line in log.read_text().split()]
    assert len(fences) == 12 * rounds and fences == sorted(fences)
    assert 0 < peak <= POOL_SIZE  # 12 clients, at most 4 server connections


def test_the_session_store_through_the_pooler_is_refused_naming_liveness_ttl(
    schema: str,
) -> None:
    # Stock PgBouncer refuses the lock session's startup options outright; a pooler that
    # passes them on meets the backend-pid check, whose message names liveness=ttl.
    backend = PostgresBackend.from_url(with_options(pgbouncer_url(), schema=schema))
    try:
        with pytest.raises(Exception) as refused:
            Lock(backend, "job:ttl:refused").acquire()
        assert "options" in str(refused.value) or "liveness=ttl" in str(refused.value)
    finally:
        backend.close()
