"""Postgres backend promises beyond the contract: URL and options, schema and migrate,
liveness through advisory locks, lost sessions, keepalives, waiting, round trips, fork,
what is stored (verbatim, bounded), and the fence guard.

Every test works in a schema of its own on the server of ``DLOCK_POSTGRES_URL``.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from celery_dlock import ConfigurationError, Holder, Lease, Lock, Outcome
from celery_dlock.backends import backend_from_url
from celery_dlock.records import DETAILS_LIMIT
from tests.backends.stores.postgres import SERVER_URL, with_options
from tests.support import eventually, force_release
from tests.support.holders import kill, spawn_holder
from tests.support.services import lease_session_pids, promote_a_standby_without, wait_ended

psycopg = pytest.importorskip("psycopg")

from celery_dlock.backends.postgres import PostgresBackend  # noqa: E402
from celery_dlock.backends.postgres.sql import FENCE_GAP, FENCE_START  # noqa: E402

T = TypeVar("T")
Backends = Callable[..., PostgresBackend]


@pytest.fixture
def url(schema: str) -> str:
    return with_options(SERVER_URL, schema=schema)


@pytest.fixture
def backend(backends: Backends) -> PostgresBackend:
    return backends()


def holder(task_name: str | None = None) -> Holder:
    return Holder.current(task_name=task_name)


def session_pid(backend: PostgresBackend) -> int:
    return int(backend.session_info()["backend_pid"])


# -- URL and options -------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["postgresql", "postgresql+psycopg", "postgres"])
def test_every_scheme_reaches_the_server(scheme: str, schema: str, backends: Backends) -> None:
    target = with_options(SERVER_URL.replace("postgresql", scheme, 1), schema=schema)
    backend = backend_from_url(target)
    assert isinstance(backend, PostgresBackend)
    backends(target)  # migrates the schema
    lease = backend.try_acquire("job:scheme", holder(), None)
    assert lease is not None
    assert backend.release(lease, Outcome.SUCCEEDED) is not None
    backend.close()


def test_the_schema_is_dlock_unless_the_url_says() -> None:
    # That from_url does no I/O is a contract check (test_contract_url.py).
    assert PostgresBackend.from_url("postgresql://nobody@127.0.0.1:1/none").schema == "dlock"
    named = PostgresBackend.from_url("postgresql://nobody@127.0.0.1:1/none?schema=locks")
    assert named.schema == "locks"


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("bogus=1", ["'bogus'", "schema", "sslmode"]),
        ("keepalives=0", ["'keepalives'"]),
        ("auto_migrate=maybe", ["auto_migrate", "maybe"]),
        ("schema=Bad-Name", ["schema", "Bad-Name"]),
        ("schema=a&schema=b", ["given twice"]),
        ("table_prefix=x;drop", ["table_prefix"]),
        ("max_waiters=0", ["max_waiters"]),
    ],
)
def test_bad_url_options_are_refused_by_name(query: str, words: list[str]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        PostgresBackend.from_url(f"postgresql://u:secret@127.0.0.1/db?{query}")
    message = str(caught.value)
    for word in words:
        assert word in message
    assert "secret" not in message


def test_bad_option_passed_as_override_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="'nonsense'"):
        PostgresBackend.from_url("postgresql://127.0.0.1/db", nonsense=1)


def test_url_password_is_masked() -> None:
    backend = PostgresBackend.from_url("postgresql://me:hunter2@127.0.0.1/db")
    assert "hunter2" not in backend.url and "hunter2" not in repr(backend)


def test_libpq_parameters_pass_through(url: str, backends: Backends, admin: Any) -> None:
    backend = backends(with_options(url, application_name="dlock-test-app"))
    pid = session_pid(backend)
    row = admin.execute("SELECT application_name FROM pg_stat_activity WHERE pid = %s", (pid,))
    assert row.fetchone() == ("dlock-test-app",)


def test_missing_tables_give_a_clear_error(url: str) -> None:
    backend = PostgresBackend.from_url(url)
    with pytest.raises(ConfigurationError) as caught:
        backend.try_acquire("job:x", holder(), None)
    assert "migrate()" in str(caught.value) and "auto_migrate=1" in str(caught.value)
    backend.close()


def test_auto_migrate_creates_the_tables_on_first_use(url: str, admin: Any, schema: str) -> None:
    backend = PostgresBackend.from_url(with_options(url, auto_migrate=1))
    try:
        lease = backend.try_acquire("job:auto", holder(), None)
        assert lease is not None and lease.fence == FENCE_START
        tables = admin.execute(
            "SELECT relname FROM pg_class JOIN pg_namespace n ON n.oid = relnamespace "
            "WHERE nspname = %s AND relkind = 'r' ORDER BY relname",
            (schema,),
        ).fetchall()
        assert [t[0] for t in tables] == ["fence_guard", "history", "locks", "successes"]
    finally:
        backend.close()


def test_table_prefix_names_every_table(url: str, admin: Any, schema: str) -> None:
    backend = PostgresBackend.from_url(with_options(url, table_prefix="app1_"))
    backend.migrate()
    backend.migrate()  # idempotent
    names = admin.execute(
        "SELECT relname FROM pg_class JOIN pg_namespace n ON n.oid = relnamespace "
        "WHERE nspname = %s ORDER BY relname",
        (schema,),
    ).fetchall()
    assert names and all(name[0].startswith("app1_") for name in names)
    backend.close()


def test_concurrent_migrations_from_two_processes_both_succeed(url: str) -> None:
    code = (
        "import sys; from celery_dlock.backends.postgres import PostgresBackend; "
        "b = PostgresBackend.from_url(sys.argv[1]); b.migrate(); b.close()"
    )
    processes = [subprocess.Popen([sys.executable, "-c", code, url]) for _ in range(3)]
    assert [p.wait(timeout=60) for p in processes] == [0, 0, 0]
    backend = PostgresBackend.from_url(url)
    assert backend.try_acquire("job:migrated", holder(), None) is not None
    backend.close()


# -- liveness --------------------------------------------------------------------------


def test_each_lease_holds_an_advisory_lock_on_its_fence(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    lease = backend.try_acquire("job:advisory", holder(), None)
    assert lease is not None
    assert lease_session_pids(admin, schema, lease.fence) == [session_pid(backend)]
    row = admin.execute(
        f'SELECT backend_pid FROM "{backend.schema}".locks WHERE key = %s', ("job:advisory",)
    ).fetchone()
    assert row == (session_pid(backend),)
    backend.release(lease, Outcome.SUCCEEDED)
    assert lease_session_pids(admin, schema, lease.fence) == []


def test_killed_holder_process_loses_its_advisory_lock_and_is_recorded_disconnected(
    url: str, backend: PostgresBackend, admin: Any, schema: str
) -> None:
    process, old = spawn_holder(url, "job:sigkill")
    [holder_pid] = lease_session_pids(admin, schema, old.fence)
    assert backend.try_acquire("job:sigkill", holder(), None) is None
    kill(process)
    new = eventually(lambda: backend.try_acquire("job:sigkill", holder(), None), "takeover")
    assert lease_session_pids(admin, schema, old.fence) == []
    [record] = [r for r in backend.history(key="job:sigkill") if r.lease.token == old.token]
    assert record.outcome is Outcome.DISCONNECTED and record.problem == "disconnected"
    assert f"backend pid {holder_pid}" in (record.details or "")
    assert new.fence > old.fence


def test_terminated_session_loses_its_leases_and_reap_records_them(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    lease = backend.try_acquire("job:terminated", holder(), None)
    kept = backend.try_acquire("job:terminated:2", holder(), 60)
    assert lease is not None and kept is not None
    pid = session_pid(backend)
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    eventually(lambda: lease_session_pids(admin, schema, lease.fence) == [], "the session ended")

    assert backend.release(lease, Outcome.SUCCEEDED) is None  # lost with the session
    assert backend.renew(kept, 60) is None
    held = backend.get("job:terminated")  # the row stays for the janitor
    assert held is not None and held.token == lease.token
    assert session_pid(backend) != pid  # a new session serves the backend

    reaped = {r.lease.token: r for r in backend.reap()}
    assert set(reaped) == {lease.token, kept.token}
    assert reaped[lease.token].outcome is Outcome.DISCONNECTED
    assert backend.get("job:terminated") is None
    assert backend.release(kept, Outcome.SUCCEEDED) is None
    assert [r.outcome for r in backend.history(key="job:terminated")] == [Outcome.DISCONNECTED]


def test_an_idle_session_the_server_ended_is_replaced_before_the_next_acquire(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    # A restart or failover while a worker is idle: its first acquire after must not fail.
    warm = backend.try_acquire("job:idle-ended", holder(), None)
    assert warm is not None and backend.release(warm, Outcome.SUCCEEDED) is not None
    pid = session_pid(backend)
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    wait_ended(admin, pid)

    lease = backend.try_acquire("job:idle-ended", holder(), None)
    assert lease is not None and lease.fence > warm.fence
    assert lease_session_pids(admin, schema, lease.fence) == [session_pid(backend)] != [pid]
    assert backend.release(lease, Outcome.SUCCEEDED) is not None
    outcomes = [r.outcome for r in backend.history(key="job:idle-ended")]
    assert outcomes == [Outcome.SUCCEEDED, Outcome.SUCCEEDED]


def test_a_lease_without_ttl_is_reported_lost_soon_after_its_session_ends(
    backends: Backends, admin: Any
) -> None:
    backend, other = backends(), backends()
    lost: list[Lease] = []
    lock = Lock(backend, "job:watched", None, on_lost=lost.append)
    lease = lock.acquire()
    assert not lock.lost
    admin.execute("SELECT pg_terminate_backend(%s)", (session_pid(backend),))
    eventually(lambda: lost, "on_lost after the lock session was terminated", timeout=5)
    assert lost == [lease] and lock.lost
    taken = other.try_acquire("job:watched", holder(), None)
    assert taken is not None and taken.fence > lease.fence
    assert lock.release() is None  # its lease died with the session


def test_leases_let_go_of_are_not_watched(backends: Backends, admin: Any) -> None:
    backend = backends()
    lost: list[Lease] = []
    with Lock(backend, "job:done", None, on_lost=lost.append):
        assert watchers()  # watched while held
    kept = Lock(backend, "job:kept", None, on_lost=lost.append)
    kept.acquire()
    kept.detach()  # kept for a retry elsewhere: no longer this Lock's to report
    admin.execute("SELECT pg_terminate_backend(%s)", (session_pid(backend),))
    eventually(lambda: not watchers(), "the idle watcher thread ended", timeout=5)
    assert lost == []


def test_the_watcher_keeps_a_healthy_session_on_a_high_descriptor(backends: Backends) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"not applicable: this process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        backend = backends()
        lost: list[Lease] = []
        lock = Lock(backend, "job:high-fd", None, on_lost=lost.append)
        lock.acquire()
        pid = session_pid(backend)
        client = backend._clients.get()
        session = client.session
        assert session is not None and session.conn.pgconn.socket > 1023  # beyond select()
        for _ in range(2):  # two looks, as the watcher thread takes them
            with client.mutex:
                client._look()
        assert not lost and not lock.lost and session_pid(backend) == pid
        assert lock.release() is not None
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def watchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "celery_dlock session watcher"]


def test_live_holder_in_this_process_is_never_reaped(backends: Backends) -> None:
    first, second = backends(), backends()
    lease = first.try_acquire("job:live", holder(), None)
    assert lease is not None
    assert second.reap() == [] and first.reap() == []
    assert second.try_acquire("job:live", holder(), None) is None


def test_retry_taking_over_from_another_client_frees_the_old_advisory_lock(
    backends: Backends, admin: Any, monkeypatch: pytest.MonkeyPatch, schema: str
) -> None:
    import celery_dlock.backends.postgres.store as module

    monkeypatch.setattr(module, "SWEEP_EVERY", 0.0)
    first, second = backends(), backends()
    old = first.try_acquire("job:retry", holder("t"), None)
    assert old is not None
    new = second.try_acquire("job:retry", holder("t"), None, replace=old.token)
    assert new is not None
    assert lease_session_pids(admin, schema, old.fence) == [
        session_pid(first)
    ]  # first cannot know yet
    assert first.try_acquire("job:other", holder(), None) is not None  # sweeps on the way
    assert lease_session_pids(admin, schema, old.fence) == []
    assert lease_session_pids(admin, schema, new.fence) == [session_pid(second)]


def test_retry_in_the_same_process_lets_go_of_the_old_advisory_lock(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    old = backend.try_acquire("job:retry-here", holder("t"), None)
    assert old is not None
    new = backend.try_acquire("job:retry-here", holder("t"), None, replace=old.token)
    assert new is not None
    assert lease_session_pids(admin, schema, old.fence) == []
    assert lease_session_pids(admin, schema, new.fence) == [session_pid(backend)]


def test_expired_lease_of_this_session_is_unlocked_when_reaped(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    lease = backend.try_acquire("job:expire-here", holder(), 0.2)
    assert lease is not None
    reaped = eventually(lambda: backend.reap() or None, "reap after the ttl")
    assert [(r.lease.token, r.outcome) for r in reaped] == [(lease.token, Outcome.EXPIRED)]
    assert lease_session_pids(admin, schema, lease.fence) == []


def test_force_release_is_conditional_and_frees_our_advisory_lock(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    lease = backend.try_acquire("job:force", holder(), None)
    assert lease is not None
    record = force_release(backend, "job:force", "operator")
    assert record is not None and record.lease.token == lease.token
    assert lease_session_pids(admin, schema, lease.fence) == []
    assert backend.release(lease, Outcome.SUCCEEDED) is None


# -- the lock session ---------------------------------------------------------------------


def test_keepalives_are_set_on_both_ends_of_the_lock_session(backends: Backends, url: str) -> None:
    backend = backends(with_options(url, keepalives_idle=7, keepalives_interval=3))
    info = backend.session_info()
    assert info["tcp_keepalives_idle"] == "7"
    assert info["tcp_keepalives_interval"] == "3"
    assert info["tcp_keepalives_count"] == "3"
    assert info["tcp_user_timeout"] == "30000"
    assert info["idle_session_timeout"] == "0"
    assert info["idle_in_transaction_session_timeout"] == "0"
    session = backend._clients.get().session
    assert session is not None
    sock = socket.socket(fileno=os.dup(session.conn.pgconn.socket))
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30000
    finally:
        sock.close()


def test_lock_session_commits_asynchronously_unless_told(backends: Backends, url: str) -> None:
    assert backends().session_info()["synchronous_commit"] == "off"
    durable = backends(with_options(url, synchronous_commit=1))
    assert durable.session_info()["synchronous_commit"] == "on"


@pytest.mark.exclusive  # reads the server's WAL positions: no other test may write WAL
def test_a_once_result_is_committed_durably_on_an_asynchronous_session(
    backend: PostgresBackend, admin: Any
) -> None:
    """A success kept for ``once`` waits for the WAL flush; a plain release does not.

    Right after each release, every WAL byte written so far is flushed only if that commit
    waited for the flush: the plain releases are the control showing the check can fail.
    """

    def flushed_after(result: Any) -> bool:
        lease = backend.try_acquire("job:durable", holder("tasks.charge"), None)
        assert lease is not None
        assert backend.release(lease, Outcome.SUCCEEDED, result=result) is not None
        row = admin.execute(
            "SELECT pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn()"
        ).fetchone()
        return bool(row[0])

    durable = sum(flushed_after({"value": n}) for n in range(20))
    plain = sum(flushed_after(None) for _ in range(20))
    assert durable >= 16, f"only {durable} of 20 once results were flushed at commit"
    assert plain <= 4, f"{plain} of 20 asynchronous commits looked flushed: the check is blind"


def test_threads_share_one_lock_session(backend: PostgresBackend, admin: Any, schema: str) -> None:
    fences: list[int] = []

    def take(n: int) -> None:
        lease = backend.try_acquire(f"job:thread:{n}", holder(), None)
        assert lease is not None
        fences.append(lease.fence)

    threads = [threading.Thread(target=take, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pids = {pid for fence in fences for pid in lease_session_pids(admin, schema, fence)}
    assert pids == {session_pid(backend)}


def test_the_lock_session_passes_every_value_type_through_its_prepared_statements(
    backend: PostgresBackend,
) -> None:
    client = backend._clients.get()
    statement = (
        "SELECT %(big)s::int8, %(float)s::float8, %(flag)s::bool, %(text)s::text, "
        "%(doc)s::json, %(none)s::text, %(fences)s::int8[] = ARRAY[1, 2, -3]::int8[], "
        "%(big)s::int8 - 1, count(*) FROM pg_prepared_statements WHERE name LIKE 'celery_dlock_%'"
    )
    values = {
        "big": -(2**62),
        "float": 0.1 + 0.2,
        "flag": False,
        "text": "ünï'\"\\ code",
        "doc": '{"a": [1, null]}',
        "none": None,
        "fences": [1, 2, -3],
    }
    with client.mutex:
        session = client.open()
        first = session.one(statement, values)
        again = session.one(statement, values)
        with pytest.raises(TypeError, match="no text format for a object parameter"):
            session.one(statement, {**values, "text": object()})
        with pytest.raises(psycopg.errors.DivisionByZero):
            session.one("SELECT 1 / %(zero)s::int", {"zero": 0})
        assert session.one("SELECT %(one)s::int", {"one": 1}) == (1,)  # still usable
    assert first is not None and again is not None
    assert first[:8] == (-(2**62), 0.1 + 0.2, False, values["text"], {"a": [1, None]}, None,
                         True, -(2**62) - 1)  # fmt: skip
    assert again[8] == first[8]  # prepared once per session, not once per call


def test_forked_child_opens_its_own_session_and_leaves_the_parents_alone(
    backend: PostgresBackend, admin: Any, tmp_path: Path, schema: str
) -> None:
    lease = backend.try_acquire("job:fork", holder(), None)
    assert lease is not None
    parent_pid = session_pid(backend)
    out = tmp_path / "child"
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            mine = backend.try_acquire("job:fork:child", holder(), None)
            busy = backend.try_acquire("job:fork", holder(), None)
            out.write_text(json.dumps([session_pid(backend), mine is not None, busy is None]))
            backend.close()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    child_pid, got_own, refused = json.loads(out.read_text())
    assert child_pid != parent_pid and got_own and refused
    assert session_pid(backend) == parent_pid
    assert lease_session_pids(admin, schema, lease.fence) == [parent_pid]
    assert backend.release(lease, Outcome.SUCCEEDED) is not None


# -- what is stored --------------------------------------------------------------------------

AWKWARD = [
    'it\'s "quoted" and back\\slashed \\\\ \\x00 %s %(name)s {0}',
    "'; DROP TABLE locks; --",
    "ünïcödé ✓ 中文 😀 \u2028",
    "$1 $$dollar$$ E'\\n' U&'\\0041'",
]


@pytest.mark.parametrize("text", AWKWARD)
def test_keys_and_details_are_stored_verbatim(
    backend: PostgresBackend, admin: Any, text: str
) -> None:
    key = f"job:{text}"
    lease = backend.try_acquire(key, holder(), None)
    assert lease is not None
    assert backend.get(key) == lease
    record = backend.release(lease, Outcome.FAILED, text, text, {"echo": text})
    assert record is not None and record.details == text and record.problem == text
    row = admin.execute(
        f'SELECT key, problem, details, result FROM "{backend.schema}".history WHERE token = %s',
        (lease.token,),
    ).fetchone()
    assert row == (key, text, text, {"echo": text})
    assert backend.history(key=key) == [record]


def test_details_over_the_bound_are_truncated_not_refused(backend: PostgresBackend) -> None:
    details = "head " + "é" * 20_000 + " tail"
    lease = backend.try_acquire("job:long", holder(), None)
    assert lease is not None
    record = backend.release(lease, Outcome.FAILED, "x" * 5000, details)
    assert record is not None and record.details is not None
    assert len(record.details.encode()) <= DETAILS_LIMIT
    assert record.details.startswith("head ") and record.details.endswith(" tail")
    assert backend.history(key="job:long") == [record]
    assert backend.get("job:long") is None


def test_text_postgres_cannot_hold_is_replaced_a_result_kept(backend: PostgresBackend) -> None:
    lease = backend.try_acquire("job:nul", holder("t"), None)
    assert lease is not None
    record = backend.release(lease, Outcome.SUCCEEDED, "a\x00b", "c\x00d\ud800", {"v": "e\x00f"})
    assert record is not None
    assert (record.problem, record.details) == ("a\ufffdb", "c\ufffdd?")
    # found by trying: a once replay gave U+FFFD for a NUL (bytes included); json keeps it
    assert record.result == {"v": "e\x00f"}
    assert backend.history(key="job:nul") == [record]
    assert backend.last_success("job:nul", "t") == record


def test_results_must_be_json(backend: PostgresBackend) -> None:
    lease = backend.try_acquire("job:json", holder(), None)
    assert lease is not None
    with pytest.raises(ConfigurationError, match="JSON"):
        backend.release(lease, Outcome.SUCCEEDED, result={1, 2})
    held = backend.get("job:json")
    assert held is not None and held.token == lease.token  # nothing changed
    assert backend.release(lease, Outcome.SUCCEEDED, result=[1, 2]) is not None


def test_history_since_is_exact_to_the_microsecond(backend: PostgresBackend) -> None:
    records = []
    for _ in range(3):
        lease = backend.try_acquire("job:since", holder(), None)
        assert lease is not None
        record = backend.release(lease, Outcome.SUCCEEDED)
        assert record is not None
        records.append(record)
    for index, record in enumerate(records):
        expected = list(reversed(records[index:]))
        assert backend.history(key="job:since", since=record.released_at) == expected


def test_prune_keeps_the_results_for_once(backend: PostgresBackend) -> None:
    lease = backend.try_acquire("job:prune", holder("t"), None)
    assert lease is not None
    success = backend.release(lease, Outcome.SUCCEEDED, result=1)
    assert success is not None
    assert backend.prune_history(success.released_at + 1) == 1
    assert backend.history() == []
    assert backend.last_success("job:prune", "t") == success


# -- fences ------------------------------------------------------------------------------------


def test_fences_move_up_after_a_crash_empties_the_guard(
    backends: Backends, admin: Any, schema: str
) -> None:
    backend = backends()
    lease = backend.try_acquire("job:guard", holder(), None)
    assert lease is not None and lease.fence == FENCE_START
    backend.release(lease, Outcome.SUCCEEDED)
    backend.close()
    # Crash recovery empties UNLOGGED tables; a TRUNCATE does the same to the guard.
    admin.execute(f'TRUNCATE "{schema}".fence_guard')
    again = backends()
    assert again.try_acquire("job:guard", holder(), None) is not None
    lease = again.try_acquire("job:guard:2", holder(), None)
    assert lease is not None and lease.fence > FENCE_START + FENCE_GAP
    assert admin.execute(f'SELECT count(*) FROM "{schema}".fence_guard').fetchone() == (1,)
    third = backends()  # the guard is back: no further jump
    nxt = third.try_acquire("job:guard:3", holder(), None)
    assert nxt is not None and lease.fence < nxt.fence < lease.fence + 10


@pytest.mark.parametrize("path", ["fresh", "take_over"])
@pytest.mark.parametrize("liveness", ["session", "ttl"])
def test_no_fence_is_given_twice_when_the_server_fails_over_under_an_open_session(
    backends: Backends, admin: Any, schema: str, url: str, *, liveness: str, path: str
) -> None:
    """A standby promoted by a failover (asynchronous replication) lacks the newest grants:
    its sequence is behind them, and its UNLOGGED guard is empty. A process whose connection
    outlived the failover (behind a pooler, ``liveness=ttl``) never opens a new session to
    check the guard; its next grant, of a fresh key or of a key taken over, must still get a
    fence above every lost grant's."""
    backend = backends(url + ("&liveness=ttl&ttl=30" if liveness == "ttl" else ""))
    old = backend.try_acquire("job:promoted", holder(), 0.3)
    lost = [backend.try_acquire(f"job:promoted:lost:{n}", holder(), None) for n in range(2)]
    assert old is not None and all(lease is not None for lease in lost)
    fences = [lease.fence for lease in lost if lease is not None]
    promote_a_standby_without(admin, schema, fences)
    if path == "take_over":  # the old lease expired: the grant takes its key over
        eventually(lambda: time.time() > old.expires_at + 0.05, "the old lease expires")  # type: ignore[operator]
        new = backend.try_acquire("job:promoted", holder(), None)
    else:
        new = backend.try_acquire("job:promoted:fresh", holder(), None)
    assert new is not None and new.fence > max(fences), (fences, new.fence)
    assert admin.execute(f'SELECT count(*) FROM "{schema}".fence_guard').fetchone() == (1,)


# -- errors ------------------------------------------------------------------------------------


def test_driver_errors_become_backend_errors_with_the_cause(
    backend: PostgresBackend, admin: Any, schema: str
) -> None:
    assert backend.try_acquire("job:before", holder(), None) is not None
    admin.execute(f'ALTER TABLE "{schema}".history RENAME TO history_gone')
    lease = backend.try_acquire("job:error", holder(), None)
    assert lease is not None
    with pytest.raises(ConfigurationError, match="migrate") as caught:
        backend.release(lease, Outcome.SUCCEEDED)
    assert isinstance(caught.value.__cause__, psycopg.errors.UndefinedTable)
    admin.execute(f'ALTER TABLE "{schema}".history_gone RENAME TO history')
    assert backend.release(lease, Outcome.SUCCEEDED) is not None  # still held, still ours


def test_fences_follow_the_order_of_grants_under_contention(backends: Backends) -> None:
    """An INSERT ... ON CONFLICT draws its fence before it waits on a conflicting row; an
    acquirer that waited must not be granted with a fence older than its predecessor's."""
    clients = [backends() for _ in range(4)]
    grants: list[tuple[float, float, int]] = []
    mutex = threading.Lock()
    deadline = time.monotonic() + 3.0

    def contend(client: PostgresBackend) -> None:
        me = holder()
        while time.monotonic() < deadline:
            lease = client.try_acquire("job:order", me, None)
            if lease is None:
                continue
            taken = time.monotonic()
            with mutex:
                grants.append((taken, time.monotonic(), lease.fence))
            assert client.release(lease, Outcome.SUCCEEDED) is not None

    threads = [threading.Thread(target=contend, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    grants.sort()
    assert len(grants) > 100
    fences = [fence for _, _, fence in grants]
    assert fences == sorted(fences)


def test_the_backend_needs_no_sqlalchemy() -> None:
    code = (
        "import sys; import celery_dlock.backends.postgres; "
        "assert 'sqlalchemy' not in sys.modules, 'sqlalchemy imported'"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
