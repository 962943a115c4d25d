"""A trial of the stores for fleets larger than one database's connection limit, as a
production user runs them.

- Postgres ``liveness=ttl`` through a real PgBouncer in transaction pooling mode: 24
  processes over 3 server connections (no overlap, fences in order, no state left on the
  server connections), a holder SIGKILLed, the pooler's ``KILL`` between calls, a server
  connection ended under an acquire and under a release, the doctor, and ``migrate()``
  through the pooler (the SQL functions it makes).
- The session store through a pooler that passes the lock session's startup options over.
- Session liveness near the connection limit: a role's ``CONNECTION LIMIT`` reached by
  lock sessions and by waiter connections, and what the doctor counts.
- The Redis store on a real Redis Cluster: a set of keys on every primary, the namespace
  read and reaped across them, a client whose only named node died, and a primary without
  replica killed and brought back empty.

The tests marked ``xfail(strict=True)`` are defects this trial found: each fails today for
the reason it gives, and passes once the library is fixed (then drop the mark).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import AsyncLock, BackendError, ConfigurationError, Lock, Locks, Outcome
from celery_dlock.backends.postgres import PostgresBackend, PostgresTTLBackend
from celery_dlock.backends.postgres.sql import Names
from celery_dlock.records import Holder, Lease, Record
from tests.support import eventually
from tests.support.doctor import by_name
from tests.support.forked import popen_script
from tests.support.redis_cluster import Cluster, shared_cluster
from tests.support.scale_trial import Bouncer, bouncer, limited_role, server_connections
from tests.support.services import POSTGRES_URL, peak_sessions, wait_ended, with_options

psycopg = pytest.importorskip("psycopg")

SUPPORT = Path(__file__).parent.parent / "support"
#: Server connections of the pooler: far fewer than the processes that share them.
POOL = 3


@pytest.fixture
def pooler() -> Iterator[Bouncer]:
    with bouncer("transaction", POOL) as made:
        yield made


@pytest.fixture
def direct(schema: str) -> Iterator[PostgresBackend]:
    """The store on ``schema`` (migrated), straight to the server, to look at its state."""
    made = PostgresBackend.from_url(with_options(POSTGRES_URL, schema=schema))
    made.migrate()
    yield made
    made.close()


def ttl_url(pooler: Bouncer, schema: str, ttl: float = 30, **options: Any) -> str:
    return with_options(pooler.url, schema=schema, liveness="ttl", ttl=ttl, **options)


def end_server_connection(admin: Any, pid: int) -> None:
    """End the pooler's server connection ``pid`` (as a server restart behind the pooler
    would), and wait until it is gone: what it was running did not land."""
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    wait_ended(admin, pid, "the server connection ended")


# -- liveness=ttl through PgBouncer in transaction pooling mode -------------------------------


def test_24_processes_over_3_server_connections_never_overlap_and_leave_no_session_state(
    pooler: Bouncer, direct: PostgresBackend, schema: str, admin: Any, tmp_path: Path
) -> None:
    """Three keys shared by seven processes each, three keys of one process each: every
    read-modify-write of a key's counter under its lock is kept (none lost to an overlap),
    fences rise per key in the order held, and the pool's server connections are left with
    no prepared statement, no advisory lock and no setting of ours."""
    name = f"dlock_scale_{os.urandom(4).hex()}"  # PgBouncer sets it on the server connections
    url = ttl_url(pooler, schema, application_name=name)
    start = tmp_path / "start"
    rounds = 5
    groups = {f"job:scale:shared:{n}": 7 for n in range(3)}
    groups |= {f"job:scale:own:{n}": 1 for n in range(3)}
    processes, files = [], {}
    for key, count in groups.items():
        counter, log = tmp_path / f"{key}.counter", tmp_path / f"{key}.fences"
        counter.write_text("0")
        log.write_text("")
        files[key] = (counter, log)
        args = [url, key, str(rounds), str(counter), str(log), str(start)]
        processes += [popen_script(SUPPORT / "contend.py", *args) for _ in range(count)]
    assert len(processes) == 24
    start.write_text("go")
    peak = peak_sessions(admin, name, processes)
    assert [p.wait(timeout=120) for p in processes] == [0] * 24
    for key, count in groups.items():
        counter, log = files[key]
        assert int(counter.read_text()) == count * rounds, key  # no update lost
        fences = [int(line) for line in log.read_text().split()]
        assert len(fences) == count * rounds and fences == sorted(set(fences)), key
        records = direct.history(key=key, limit=None)
        assert {r.outcome for r in records} == {Outcome.SUCCEEDED}
        assert sorted(r.lease.fence for r in records) == fences
    assert direct.leases("job:scale:") == []
    assert 0 < peak <= POOL  # 24 clients, at most 3 server connections
    left = server_connections(pooler.url, POOL)
    assert len({c["pid"] for c in left}) == POOL
    for connection in left:
        assert connection["prepared"] == 0 and connection["advisory"] == 0, connection
        assert connection["synchronous_commit"] == "on", connection
        assert connection["lock_timeout"] == "0" and connection["idle"] == "0", connection


def test_a_ttl_holder_killed_frees_its_key_at_expiry_recorded_expired(
    pooler: Bouncer, direct: PostgresBackend, schema: str
) -> None:
    url = ttl_url(pooler, schema, ttl=1)
    command = [sys.executable, str(SUPPORT / "hold.py"), url, "job:scale:killed", "1"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            held = Lease.from_dict(json.loads(holder.stdout.readline()))
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
    pooled = PostgresBackend.from_url(url)
    try:
        lock = Lock(pooled, "job:scale:killed", wait=30)
        taken = lock.acquire()
        assert taken.fence > held.fence
        [record] = direct.history(key="job:scale:killed")
        assert record.lease.token == held.token and record.outcome is Outcome.EXPIRED
        assert lock.release() is not None
    finally:
        pooled.close()


def test_a_pooler_kill_between_calls_loses_no_ttl_lease(
    pooler: Bouncer, direct: PostgresBackend, schema: str
) -> None:
    """PgBouncer's ``KILL`` drops every client and server connection; a ttl lease lives by
    its ttl, so its holder's next call, on a new connection, still releases it."""
    pooled = PostgresBackend.from_url(ttl_url(pooler, schema))
    try:
        lock = Lock(pooled, "job:scale:bounced", renew=False)
        lease = lock.acquire()
        pooler.console("KILL test")
        pooler.console("RESUME test")
        held = direct.get("job:scale:bounced")
        assert held is not None and held.token == lease.token
        record = lock.release()
        assert record is not None and record.outcome is Outcome.SUCCEEDED
        assert direct.get("job:scale:bounced") is None
        assert [r.lease.token for r in direct.history(key="job:scale:bounced")] == [lease.token]
    finally:
        pooled.close()


def test_a_ttl_acquire_whose_server_connection_ends_under_it_is_an_error_and_grants_nothing(
    pooler: Bouncer, direct: PostgresBackend, schema: str, admin: Any
) -> None:
    """The acquire waits on the key's grant lock (held here) when its server connection is
    ended: ``BackendError``, no lease left behind, and the key is granted once, later."""
    pooled = PostgresBackend.from_url(ttl_url(pooler, schema, application_name="dlock_cut_a"))
    blocker = psycopg.connect(POSTGRES_URL, autocommit=True)
    try:
        assert pooled.get("job:scale:cut-acquire") is None  # the client is connected
        space = Names(schema, "").key_space("grant")
        blocker.execute(
            "SELECT pg_advisory_lock(%s, hashtext(%s))", (space, "job:scale:cut-acquire")
        )
        answer: dict[str, Any] = {}

        def acquire() -> None:
            try:
                answer["lease"] = Lock(pooled, "job:scale:cut-acquire").acquire()
            except BackendError as exc:
                answer["error"] = exc

        acquiring = threading.Thread(target=acquire)
        acquiring.start()
        waiting = eventually(
            lambda: admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '-- acquire%%' AND application_name = 'dlock_cut_a'"
            ).fetchall(),
            "the acquire waits on the grant lock",
        )
        end_server_connection(admin, waiting[0][0])
        blocker.execute("SELECT pg_advisory_unlock_all()")
        acquiring.join(30)
        assert "error" in answer, answer
        assert direct.get("job:scale:cut-acquire") is None
        lease = pooled.try_acquire("job:scale:cut-acquire", Holder.current(), 30)
        assert (
            lease is not None
            and direct.try_acquire("job:scale:cut-acquire", Holder.current(), 30) is None
        )
        assert pooled.release(lease, Outcome.SUCCEEDED) is not None
        assert [r.outcome for r in direct.history(key="job:scale:cut-acquire")] == [
            Outcome.SUCCEEDED
        ]
    finally:
        blocker.close()
        pooled.close()


def test_doctor_through_the_pooler_passes_ttl_and_fails_session_naming_liveness_ttl(
    pooler: Bouncer, direct: PostgresBackend, schema: str
) -> None:
    ttl = PostgresBackend.from_url(ttl_url(pooler, schema))
    session = PostgresBackend.from_url(with_options(pooler.url, schema=schema))
    try:
        assert isinstance(ttl, PostgresTTLBackend)
        checks = by_name(ttl.diagnose())
        assert checks["pooler"].ok and checks["connections"].ok, checks
        assert "transaction pooling" in checks["pooler"].detail
        refused = by_name(session.diagnose())["pooler"]
        assert not refused.ok and "liveness=ttl" in refused.detail
    finally:
        ttl.close()
        session.close()


def test_migrate_through_the_pooler_keeps_the_sql_functions_bound_to_their_session(
    pooler: Bouncer, schema: str, admin: Any
) -> None:
    """A fleet on ``liveness=ttl`` migrates through its pooler (``auto_migrate=1``, or
    ``celery dlock migrate`` with the app's URL). The SQL functions are for psql and other
    languages, whose lease "lives while the calling session does (its advisory lock)". A
    report that takes a key without a ttl and whose session then ends must free it."""
    url = ttl_url(pooler, schema, auto_migrate=1)
    pooled = PostgresBackend.from_url(url)
    try:
        pooled.migrate()
        report = psycopg.connect(POSTGRES_URL, autocommit=True)
        token, _ = report.execute(
            f"SELECT token, fence FROM \"{schema}\".acquire('job:scale:sql', 'nightly', NULL)"
        ).fetchone()
        pid = report.info.backend_pid
        report.close()  # the report's session ends: its lease with it
        wait_ended(admin, pid, "the report's session ended")
        session = PostgresBackend.from_url(with_options(POSTGRES_URL, schema=schema))
        try:
            taken = session.try_acquire("job:scale:sql", Holder.current(), None)
            assert taken is not None, "an SQL client's lease outlived its session"
            [record] = session.history(key="job:scale:sql")
            assert record.lease.token == token and record.outcome is Outcome.DISCONNECTED
        finally:
            session.close()
        assert by_name(pooled.diagnose())["schema"].ok
    finally:
        pooled.close()


def cut_off(admin: Any, schema: str, lease: Lease, statement: str, call: Any) -> dict[str, Any]:
    """Run ``call()`` while another session holds ``lease``'s row, so that the statement
    named ``statement`` waits on it; end the server connection it waits on, let the row go;
    what ``call`` returned (``answer``) or raised (``error``)."""
    blocker = psycopg.connect(POSTGRES_URL)  # holds the row: the statement waits on it
    blocker.execute(f'SELECT FROM "{schema}".locks WHERE key = %s FOR UPDATE', (lease.key,))
    found: dict[str, Any] = {}

    def run() -> None:
        try:
            found["answer"] = call()
        except BackendError as exc:
            found["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    waiting = eventually(
        lambda: admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE %s AND application_name = 'dlock_cut'",
            (f"-- {statement}%",),
        ).fetchall(),
        f"the {statement} waits on the row",
    )
    end_server_connection(admin, waiting[0][0])
    blocker.rollback()  # a statement tried again on a new connection may go on
    blocker.close()
    thread.join(30)
    assert found, f"the {statement} returned"
    return found


def test_a_ttl_release_cut_off_mid_statement_is_never_reported_lost_while_it_holds_the_key(
    pooler: Bouncer, direct: PostgresBackend, schema: str, admin: Any
) -> None:
    """The server connection that runs a release ends under it (a server restart behind
    the pooler, ``pg_terminate_backend``): the release did not land. With ``liveness=ttl``
    the lease does not die with a connection, so the release must land on a new one or
    raise ``BackendError`` (``release``'s contract: None only when the lease was no longer
    ours). It said None: the ``Lock`` recorded ``lost`` instead of ``succeeded``, and the
    key stayed held until the ttl ran out, to be recorded ``expired`` as well."""
    pooled = PostgresBackend.from_url(ttl_url(pooler, schema, application_name="dlock_cut"))
    try:
        lease = pooled.try_acquire("job:scale:cut", Holder.current(), 60)
        assert lease is not None
        found = cut_off(
            admin, schema, lease, "release", lambda: pooled.release(lease, Outcome.SUCCEEDED)
        )
        assert "error" not in found, found
        record, current = found["answer"], direct.get("job:scale:cut")
        assert record is not None, f"a live lease's release came back as lost; now {current}"
        assert record.outcome is Outcome.SUCCEEDED and current is None
        records = direct.history(key="job:scale:cut", limit=None)
        assert [(r.outcome, r.lease.token) for r in records] == [(Outcome.SUCCEEDED, lease.token)]
    finally:
        pooled.close()


def test_a_ttl_hand_over_cut_off_mid_statement_lands_on_a_new_connection(
    pooler: Bouncer, direct: PostgresBackend, schema: str, admin: Any
) -> None:
    """The same for the hand-over of a dedupe mark to its message: it came back as None
    ("the lease died with the session"), logged as a mark lost while its message was
    sent, and the mark kept only its short send ttl, though the lease lived on."""
    pooled = PostgresBackend.from_url(ttl_url(pooler, schema, application_name="dlock_cut"))
    try:
        lease = pooled.try_acquire("job:scale:handed", Holder.current(), 30)
        assert lease is not None
        found = cut_off(admin, schema, lease, "hand_over", lambda: pooled.hand_over(lease, 600))
        assert "error" not in found, found
        handed = found["answer"]
        assert handed is not None, "a live lease's hand-over came back as lost"
        current = direct.get("job:scale:handed")
        assert current is not None and current.token == lease.token
        assert (current.expires_at or 0) > time.time() + 500  # the message's ttl, not 30 s
        assert pooled.release(handed, Outcome.SUCCEEDED) is not None
    finally:
        pooled.close()


def test_session_liveness_through_a_pooler_that_ignores_startup_options_is_refused(
    direct: PostgresBackend, schema: str
) -> None:
    """A common PgBouncer setting lets clients that send ``options`` in (JDBC, psql ``-c``
    settings) by ignoring the parameter. Through it the lock session's two-transaction pid
    check passes (an idle pool hands back the server connection just freed) and the lease
    is granted, its advisory lock taken on a pooled server connection that outlives the
    holder: the key is never freed by liveness (nor by ``reap``)."""
    with bouncer("transaction", POOL, ignore_startup_parameters="options") as lenient:
        pooled = PostgresBackend.from_url(with_options(lenient.url, schema=schema))
        try:
            lease = pooled.try_acquire("job:scale:lenient", Holder.current(), None)
        except ConfigurationError as refused:
            assert "liveness=ttl" in str(refused)
            return
        finally:
            pooled.close()  # the holder's process ends: its lease must die with it
        assert lease is not None
        taken = direct.try_acquire("job:scale:lenient", Holder.current(), None)
        assert taken is not None, "the dead holder's key is still held by the pool"


def test_an_asyncio_lock_session_through_a_pooler_that_ignores_startup_options_is_refused(
    schema: str,
) -> None:
    """The same pooler, the asyncio client (``AsyncLock`` opens a lock session of its own)."""

    async def acquire(backend: PostgresBackend) -> None:
        async with AsyncLock(backend, "job:scale:lenient-aio"):
            pass

    with bouncer("transaction", POOL, ignore_startup_parameters="options") as lenient:
        pooled = PostgresBackend.from_url(with_options(lenient.url, schema=schema))
        try:
            with pytest.raises(ConfigurationError, match="ignore_startup_parameters") as refused:
                asyncio.run(acquire(pooled))
        finally:
            pooled.close()
    assert "liveness=ttl" in str(refused.value)


# -- session liveness near the connection limit -----------------------------------------------


@pytest.fixture
def two_sessions(admin: Any, direct: PostgresBackend, schema: str) -> Iterator[str]:
    """The URL of a role that may open two sessions at once, on ``schema``."""
    with limited_role(admin, schema, 2) as role:
        yield with_options(f"postgresql://{role}@127.0.0.1:5432/test", schema=schema)


def test_a_lock_session_refused_by_the_role_limit_is_a_backend_error_and_grants_nothing(
    two_sessions: str, direct: PostgresBackend
) -> None:
    stores = [PostgresBackend.from_url(two_sessions) for _ in range(3)]
    try:
        for n, store in enumerate(stores[:2]):
            assert store.try_acquire(f"job:scale:limit:{n}", Holder.current(), None) is not None
        with pytest.raises(BackendError, match="too many connections") as refused:
            Lock(stores[2], "job:scale:limit:2").acquire()
        assert "too many connections" in str(refused.value)
        assert direct.get("job:scale:limit:2") is None
        assert len(direct.leases("job:scale:limit:")) == 2
    finally:
        for store in stores:
            store.close()


def test_a_waiter_refused_a_waiter_connection_polls_instead_of_failing(
    two_sessions: str,
) -> None:
    """Each process has its lock session; near the limit, a process that waits for a busy
    key cannot open a waiter connection. It polls when its ``max_waiters`` are busy; a
    connection the server refuses should be the same, not an error that re-queues the
    task (and tries a new connection at every attempt)."""
    holder_store = PostgresBackend.from_url(two_sessions)
    waiter_store = PostgresBackend.from_url(two_sessions)
    try:
        held = Lock(holder_store, "job:scale:crowded")
        held.acquire()
        letting_go = threading.Timer(0.3, held.release)
        letting_go.start()
        waiter = Lock(waiter_store, "job:scale:crowded", wait=30)
        try:
            lease = waiter.acquire()
        finally:
            letting_go.join(10)
        assert lease.key == "job:scale:crowded"
        assert waiter.release() is not None  # a Lock dropped while held warns when collected
    finally:
        holder_store.close()
        waiter_store.close()


def test_doctor_fails_connections_when_the_role_limit_is_used_up(
    admin: Any, direct: PostgresBackend, schema: str
) -> None:
    """The role may open twelve sessions and ten are open (its workers): the doctor's own
    takes the eleventh, so one is left, under the 10 % the doctor asks of the server. The
    server has room, the role hardly any; the doctor said the connections are fine,
    counting against ``max_connections`` only."""
    with limited_role(admin, schema, 12) as role:
        url = with_options(f"postgresql://{role}@127.0.0.1:5432/test", schema=schema)
        workers = [psycopg.connect(url.partition("?")[0]) for _ in range(10)]
        doctor = PostgresBackend.from_url(url)
        try:
            check = by_name(doctor.diagnose())["connections"]
        finally:
            doctor.close()
            for conn in workers:
                conn.close()
    assert not check.ok and "connection limit" in check.detail.lower(), check


def test_doctor_counts_other_roles_sessions_for_a_role_without_stats_rights(
    admin: Any, direct: PostgresBackend, schema: str
) -> None:
    """Workers run as an application role, not a superuser. Five sessions of another role
    are open while the doctor looks (and its own): "sessions in use against
    max_connections" must count at least those six."""
    others = [psycopg.connect(POSTGRES_URL) for _ in range(5)]
    try:
        with limited_role(admin, schema, 10) as role:
            url = with_options(f"postgresql://{role}@127.0.0.1:5432/test", schema=schema)
            doctor = PostgresBackend.from_url(url)
            try:
                check = by_name(doctor.diagnose())["connections"]
            finally:
                doctor.close()
    finally:
        for conn in others:
            conn.close()
    found = re.match(r"(\d+) of \d+ usable sessions in use", check.detail)
    assert found is not None, check
    assert int(found.group(1)) >= len(others) + 1, check  # and the doctor's own


# -- the Redis store on a Redis Cluster --------------------------------------------------------


def cluster_store(
    cluster: Cluster, prefix: str, seeds: str | None = None, restart_delay: float = 0
) -> Any:
    """The Redis store on ``cluster`` (learnt from ``seeds``, by default two nodes)."""
    from celery_dlock.backends.redis import RedisBackend

    nodes = cluster.url if seeds is None else seeds
    return RedisBackend.from_url(f"{nodes}?prefix={prefix}&restart_delay={restart_delay}")


def on_primaries(cluster: Cluster, store: Any, candidates: list[str]) -> dict[int, list[str]]:
    """``candidates`` by the port of the primary that serves their lock's slot."""
    found: dict[int, list[str]] = {}
    for key in candidates:
        found.setdefault(cluster.primary_of(store._layout.names(key).lock), []).append(key)
    return found


@pytest.fixture
def cluster_prefix() -> Iterator[tuple[Cluster, str]]:
    """The run's Redis Cluster and a key prefix of this test, deleted afterwards."""
    from redis.cluster import ClusterNode, RedisCluster

    cluster = shared_cluster()
    prefix = f"scale{os.getpid()}-{os.urandom(3).hex()}"
    yield cluster, prefix
    admin = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster.ports[0])])
    for name in admin.scan_iter(match=f"{{{prefix}*", count=1000):
        admin.delete(name)
    admin.close()


def test_a_set_of_keys_on_every_primary_is_all_or_none_and_read_across_nodes(
    cluster_prefix: tuple[Cluster, str],
) -> None:
    cluster, prefix = cluster_prefix
    first, second = cluster_store(cluster, prefix), cluster_store(cluster, prefix)
    try:
        spread = on_primaries(cluster, first, [f"job:set:{n}" for n in range(24)])
        assert len(spread) == 3  # the set spans the three primaries
        keys = [found[0] for found in spread.values()]
        together = Locks(first, keys, ttl=30)
        leases = together.acquire()
        assert {lease.key for lease in leases} == set(keys)
        assert {lease.key for lease in second.leases("job:set:")} == set(keys)
        blocked = Locks(second, [*keys, "job:set:free"], ttl=30)
        with pytest.raises(Exception, match="job:set"):
            blocked.acquire(wait=0)
        assert second.get("job:set:free") is None  # all or none: nothing kept
        records = together.release()
        assert records is not None and {r.outcome for r in records} == {Outcome.SUCCEEDED}
        tokens = {lease.token for lease in leases}
        assert tokens <= {r.lease.token for r in second.history(limit=None)}
        for key in keys:
            assert [r.lease.key for r in second.history(key=key)] == [key]
        expiring = [found[1] for found in spread.values()]
        for key in expiring:
            assert first.try_acquire(key, Holder.current(), 0.2) is not None
        reaped: list[Record] = []

        def all_reaped() -> bool:  # one reap may come before the last key's expiry
            reaped.extend(r for r in second.reap() if r.key in expiring)
            return len({r.key for r in reaped}) == len(expiring)

        eventually(all_reaped, "every expired lease reaped")
        assert sorted(r.key for r in reaped) == sorted(expiring)
        assert {r.outcome for r in reaped} == {Outcome.EXPIRED}
        assert second.leases("job:set:") == []
    finally:
        first.close()
        second.close()


def test_a_cluster_client_whose_only_named_node_died_reaches_the_survivors(
    private_cluster: Cluster,
) -> None:
    """``redis+cluster://host:port`` names any node to learn the cluster from. That node
    is SIGKILLed and its replica takes over: the client knew every node, yet each call,
    also for keys of the two primaries that never failed, is a ``BackendError`` until the
    process restarts (a new client with another node works at once)."""
    cluster = private_cluster
    seed = cluster.ports[0]
    store = cluster_store(cluster, "seed", f"redis+cluster://127.0.0.1:{seed}")
    try:
        spread = on_primaries(cluster, store, [f"job:seed:{n}" for n in range(24)])
        assert seed in spread and len(spread) == 3
        for keys in spread.values():  # the client knows every primary
            lease = store.try_acquire(keys[0], Holder.current(), 30)
            assert lease is not None and store.release(lease, Outcome.SUCCEEDED) is not None
        cluster.kill(seed)
        cluster.ports.remove(seed)
        victim_key = spread[seed][0]
        eventually(
            lambda: cluster.primary_of(store._layout.names(victim_key).lock) not in (seed, 0),
            "a replica takes over",
        )
        eventually(
            lambda: all(
                "cluster_state:ok" in cluster.cli(p, "CLUSTER", "INFO") for p in cluster.ports
            ),
            "the cluster is ok",
        )
        _try(store, victim_key)  # its connection to the dead node is refused
        survivor = next(keys[1] for port, keys in spread.items() if port != seed)
        lease = eventually(
            lambda: _try(store, survivor), "a key of a surviving primary is granted", timeout=5
        )
        assert lease.key == survivor
    finally:
        store.close()


def _try(store: Any, key: str) -> Lease | None:
    try:
        lease: Lease | None = store.try_acquire(key, Holder.current(), 30)
    except BackendError:
        return None
    return lease


def test_a_primary_without_replica_killed_is_an_error_everywhere_and_grants_nothing_twice(
    private_cluster: Cluster,
) -> None:
    """The replica of one primary is gone, then the primary is SIGKILLed: its slots have
    no server, the cluster goes down, and every call is a ``BackendError`` (no key granted
    to a second client, none reported free). The primary comes back empty (no
    persistence): the leases it held are lost (their renewal says so) and granted again
    (after ``restart_delay``) with higher fences; the others live on, refused to others."""
    cluster = private_cluster
    first = cluster_store(cluster, "down", restart_delay=2)
    second = cluster_store(cluster, "down", restart_delay=2)
    try:
        spread = on_primaries(cluster, first, [f"job:down:{n}" for n in range(24)])
        assert len(spread) == 3
        victim = cluster.ports[2]
        assert victim in spread
        replica = cluster.replica_of(victim)
        cluster.kill(replica)
        leases = {
            key: first.try_acquire(key, Holder.current(), 30)
            for keys in spread.values()
            for key in keys
        }
        assert all(leases.values())
        cluster.kill(victim)
        live = [port for port in cluster.ports if port not in (victim, replica)]
        eventually(
            lambda: all("cluster_state:fail" in cluster.cli(p, "CLUSTER", "INFO") for p in live),
            "every live node says the cluster is down",
        )
        for key in leases:
            with pytest.raises(BackendError):
                second.try_acquire(key, Holder.current(), 30)
        cluster.spawn(victim)
        eventually(
            lambda: "cluster_state:ok" in cluster.cli(cluster.ports[0], "CLUSTER", "INFO"),
            "the cluster is up",
        )
        for key, lease in leases.items():
            assert lease is not None
            renewed = eventually(lambda lease=lease: _renewal(first, lease), "a renewal answers")
            if key in spread[victim]:
                assert renewed == (None,), key  # lost with the primary's data
                taken = eventually(lambda key=key: _try(second, key), "granted again")
                assert taken.fence > lease.fence
            else:
                assert renewed[0] is not None and renewed[0].token == lease.token, key
                assert second.try_acquire(key, Holder.current(), 30) is None
    finally:
        first.close()
        second.close()


def _renewal(store: Any, lease: Lease) -> tuple[Lease | None] | None:
    """``(renew's answer,)``, or None while the cluster still settles."""
    try:
        return (store.renew(lease, 30),)
    except BackendError:
        return None
