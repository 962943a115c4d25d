"""The SQL functions ``acquire``, ``release`` and ``lease`` that ``migrate()`` creates, driven
from a real ``psql`` while a Python holder contends for the same key: they exclude each
other, fences keep increasing across both, and the history shows both kinds of holder."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import psycopg
import pytest

from celery_dlock import Lock, Outcome
from celery_dlock.backends.base import MAX_TTL
from celery_dlock.backends.postgres import PostgresBackend
from tests.backends.stores.postgres import SERVER_URL
from tests.support import eventually

PSQL = shutil.which("psql")


@pytest.fixture
def store(postgres_backend: PostgresBackend, schema: str) -> tuple[PostgresBackend, str]:
    """A migrated backend and its schema (``tests/backends/conftest.py``)."""
    return postgres_backend, schema


def psql(script: str) -> subprocess.Popen[str]:
    """``psql`` running ``script`` (SQL and meta-commands, from its standard input) on the
    test server in one session, stopping at the first error."""
    if PSQL is None:
        pytest.skip("psql is not installed (Debian: postgresql-client)")
    args = [PSQL, SERVER_URL, "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-f", "-"]
    process = subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdin is not None
    process.stdin.write(script)
    process.stdin.close()
    return process


def finished(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None and process.stderr is not None
    process.wait(timeout=60)
    out, err = process.stdout.read(), process.stderr.read()
    process.stdout.close()
    process.stderr.close()
    assert process.returncode == 0, err
    return out


def test_psql_and_python_exclude_each_other_and_share_fences_and_history(
    store: tuple[PostgresBackend, str], tmp_path: Path
) -> None:
    backend, schema = store
    key = "job:report:daily"
    token_file, go = tmp_path / "token", tmp_path / "go"
    # One psql session: take the key, say so, hold it until ``go`` exists (however slow the
    # machine, the test looks while psql holds), release it as failed.
    holding = psql(
        f"SELECT token, fence FROM {schema}.acquire('{key}', 'nightly report (psql)', NULL) "
        "\\gset\n"
        f"\\o {token_file}\n\\qecho :token :fence\n\\o\n"
        f"\\! until [ -e '{go}' ]; do sleep 0.02; done\n"
        f"SELECT {schema}.release('{key}', :'token', 'failed', 'ReportError', 'row 7 bad');"
    )
    try:
        token, fence = eventually(
            lambda: token_file.exists() and token_file.read_text().split(), "psql holds"
        )
        held = backend.get(key)
        assert held is not None and held.token == token and held.fence == int(fence)
        assert held.holder.task_name == "sql" and held.holder.worker == "nightly report (psql)"
        assert Lock(backend, key).attempt() is None  # Python is kept out while psql holds
    finally:
        go.touch()
    waiter = Lock(backend, key, wait=30)
    lease = waiter.acquire()  # woken when psql's release lets go of the advisory lock
    assert finished(holding).strip() == "failed"
    assert lease.fence > int(fence)

    # Python holds now: psql's acquire answers no row, and its lease() shows Python's lease.
    out = finished(psql(f"SELECT * FROM {schema}.acquire('{key}', 'second psql', 60)"))
    assert out.strip() == ""
    out = finished(psql(f"SELECT token, fence, alive FROM {schema}.lease('{key}')"))
    assert out.strip() == f"{lease.token}|{lease.fence}|t"
    waiter.release()
    out = finished(psql(f"SELECT fence FROM {schema}.acquire('{key}', 'third psql', 60)"))
    assert int(out.strip()) > lease.fence  # free again: psql takes it, with a higher fence

    records = backend.history(key=key)
    by_token = {record.lease.token: record for record in records}
    first = by_token[token]
    assert (first.outcome, first.problem, first.details) == (
        Outcome.FAILED,
        "ReportError",
        "row 7 bad",
    )
    assert first.lease.holder.task_name == "sql"
    assert by_token[lease.token].outcome is Outcome.SUCCEEDED
    assert by_token[lease.token].lease.holder.pid == os.getpid()


def test_contending_psql_sessions_and_python_threads_never_hold_at_once(
    store: tuple[PostgresBackend, str], tmp_path: Path
) -> None:
    """Four psql sessions (100 tries each, 50 ms apart) and four Python threads (10 holds
    each, with a gap between) take one key; every hold writes its start and end, no two
    holds overlap, and both kinds of holder get it."""
    backend, schema = store
    key = "job:shared"
    log = tmp_path / "holds"
    append = f"\\o |cat >> {log}\n"
    take = (
        "SELECT a.token, a.fence FROM (SELECT) AS one "
        f"LEFT JOIN {schema}.acquire('{key}', 'psql', NULL) AS a ON true \\gset\n"
        "\\if :{?token}\n"
        f"{append}\\qecho start :fence\n\\o\n"
        "SELECT pg_sleep(0.02);\n"
        f"{append}\\qecho end :fence\n\\o\n"
        f"SELECT {schema}.release('{key}', :'token');\n"
        "\\unset token\n"
        "\\else\n"
        "SELECT pg_sleep(0.05);\n"
        "\\endif\n"
    )
    sessions = [psql(take * 100) for _ in range(4)]
    lines: list[str] = []
    mutex = threading.Lock()

    def python_holder() -> None:
        own = PostgresBackend.from_url(backend.url)
        try:
            for _ in range(10):
                with Lock(own, key, wait=30) as lease:
                    with mutex, log.open("a") as out:
                        out.write(f"start {lease.fence}\n")
                    threading.Event().wait(0.02)
                    with mutex, log.open("a") as out:
                        out.write(f"end {lease.fence}\n")
                threading.Event().wait(0.03)  # a gap, for the polling psql sessions
        finally:
            own.close()

    threads = [threading.Thread(target=python_holder) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for session in sessions:
        finished(session)
    lines = log.read_text().split("\n")[:-1]
    events = [line.split() for line in lines]
    # Holds never interleave: each start is followed by the end of the same fence.
    for begin, end in zip(events[::2], events[1::2], strict=True):
        assert begin[0] == "start" and end == ["end", begin[1]], (begin, end)
    fences = [int(fence) for kind, fence in events if kind == "start"]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    kinds = {r.lease.holder.task_name for r in backend.history(key=key, limit=None)}
    assert kinds == {"sql", None}  # both kinds of holder took turns
    assert len(fences) >= 40


def test_release_refuses_an_outcome_that_is_not_a_callers(
    store: tuple[PostgresBackend, str],
) -> None:
    backend, schema = store
    with psycopg.connect(SERVER_URL, autocommit=True) as conn:
        [(token, _fence)] = conn.execute(
            f"SELECT * FROM {schema}.acquire('job:x', 'test', 60)"
        ).fetchall()
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="outcome must be one of"):
            conn.execute(f"SELECT {schema}.release('job:x', %s, 'expired')", (token,))
        for ttl in ["-1", "0", "'NaN'", "'infinity'", f"{MAX_TTL + 1}"]:
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="ttl must be"):
                conn.execute(f"SELECT * FROM {schema}.acquire('job:y', 'test', {ttl})")
        [(longest, _)] = conn.execute(
            f"SELECT * FROM {schema}.acquire('job:y', 'test', {MAX_TTL})"
        ).fetchall()
        assert conn.execute(f"SELECT {schema}.release('job:y', %s)", (longest,)).fetchone() == (
            "succeeded",
        )
        assert conn.execute(f"SELECT {schema}.release('job:x', %s)", (token,)).fetchone() == (
            "succeeded",
        )
        assert conn.execute(f"SELECT {schema}.release('job:x', %s)", (token,)).fetchone() == (None,)
    assert backend.get("job:x") is None


def test_the_functions_are_security_invoker_and_build_no_sql_from_arguments(
    store: tuple[PostgresBackend, str],
) -> None:
    _backend, schema = store
    with psycopg.connect(SERVER_URL, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT p.proname, p.prosecdef, p.proconfig, p.prosrc FROM pg_proc p "
            "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s",
            (schema,),
        ).fetchall()
    assert sorted(row[0] for row in rows) == ["acquire", "lease", "release"]
    for _name, definer, config, source in rows:
        assert definer is False  # SECURITY INVOKER
        assert config == ["search_path=pg_catalog, pg_temp"]
        assert "EXECUTE" not in source.upper().replace("EXECUTE ON", "")  # no dynamic SQL


def test_sql_refuses_keys_python_refuses_and_names_its_holder_as_documented(
    store: tuple[PostgresBackend, str],
) -> None:
    # Found by trying the API: SQL took a key with a newline or over 1024 bytes, which the
    # CLI then could not even name to release; and leases showed no holder name.
    backend, schema = store
    with psycopg.connect(SERVER_URL, autocommit=True) as conn:
        for key in ["job:a\nb", "job:" + "x" * 1021, "job:" + "é" * 511, "job:\u2028"]:
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="1024 bytes"):
                conn.execute(f"SELECT * FROM {schema}.acquire(%s, 'report', 60)", (key,))
        with pytest.raises(psycopg.errors.NullValueNotAllowed, match="a key and a holder"):
            conn.execute(f"SELECT * FROM {schema}.acquire('job:k', '', 60)")
        longest = "job:" + "é" * 510  # 1024 bytes
        [(token, _)] = conn.execute(
            f"SELECT * FROM {schema}.acquire(%s, 'nightly report', 60)", (longest,)
        ).fetchall()
        lease = backend.get(longest)
        assert lease is not None and lease.token == token
        assert lease.holder.describe().startswith("sql on nightly report (pid ")
        conn.execute(f"SELECT {schema}.release(%s, %s)", (longest, token))
