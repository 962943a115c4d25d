"""Postgres backend on the wire: round trips, waiting by server push with no leaked setting,
the lock_timeout race, replies lost in flight (resolved by reading back the token), and a
transaction-mode pooler (refused).

The proxies here are real TCP proxies on loopback: ``CountingProxy`` (tests/support) counts
round trips, and its ``drop_next_reply`` loses one reply and cuts the connection, as a
network failure after the server committed would; ``TransactionPooler`` hands every
transaction to the next of two server connections, as PgBouncer's ``pool_mode=transaction``
does under load.
"""

# ruff: noqa: F811 - the fixtures imported from test_postgres are redefined as parameters

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from celery_dlock import AsyncLock, BackendError, ConfigurationError, Lock, Locks, Outcome
from celery_dlock.backends.base import Place
from celery_dlock.backends.postgres import PostgresBackend
from celery_dlock.backends.postgres.session import Queued
from celery_dlock.backends.postgres.sql import Names
from tests.backends.stores.postgres import SERVER_URL, with_options
from tests.backends.test_postgres import (
    Backends,
    backend,  # noqa: F401
    holder,
    session_pid,
    url,  # noqa: F401
)
from tests.support import eventually
from tests.support.countingproxy import CountingProxy
from tests.support.freezing_proxy import FreezingProxy
from tests.support.services import lease_lock, lease_session_pids, wait_ended

psycopg = pytest.importorskip("psycopg")

_SERVER = urlsplit(SERVER_URL)
HOST, PORT = _SERVER.hostname or "127.0.0.1", _SERVER.port or 5432


def via(port: int, schema: str, **options: Any) -> str:
    """A URL for the test server through a proxy on ``port``."""
    target = SERVER_URL.replace(f"{HOST}:{PORT}", f"127.0.0.1:{port}", 1)
    return with_options(target, schema=schema, sslmode="disable", gssencmode="disable", **options)


# -- round trips ------------------------------------------------------------------------------


def test_uncontended_acquire_and_release_are_one_round_trip_each(
    backends: Backends, schema: str
) -> None:
    with CountingProxy(HOST, PORT) as proxy:
        backend = backends(via(proxy.port, schema))
        other = backends()  # direct, to hold a key
        for _ in range(2):  # opens the session and prepares the statements
            lease = backend.try_acquire("job:rt", holder("t"), None)
            assert lease is not None
            backend.release(lease, Outcome.SUCCEEDED, result=1)
            backend.release(lease, Outcome.SUCCEEDED)

        proxy.reset()
        lease = backend.try_acquire("job:rt", holder("t"), None)
        assert lease is not None
        assert proxy.round_trips == 1

        proxy.reset()
        assert backend.release(lease, Outcome.SUCCEEDED) is not None
        assert proxy.round_trips == 1

        lease = backend.try_acquire("job:rt", holder("t"), 30)
        assert lease is not None
        proxy.reset()
        assert backend.release(lease, Outcome.SUCCEEDED, result={"once": True}) is not None
        assert proxy.round_trips == 1  # with the result key for once

        assert other.try_acquire("job:rt-busy", holder(), None) is not None
        backend.try_acquire("job:rt-busy", holder(), None)
        proxy.reset()
        assert backend.try_acquire("job:rt-busy", holder(), None) is None
        assert proxy.round_trips == 2  # held: the insert, then the check of its holder


# -- waiting ----------------------------------------------------------------------------------


def waiting_on(admin: Any, schema: str, fence: int) -> bool:
    """Whether some session is queued (not granted) on lease ``fence``'s advisory lock."""
    row = admin.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
        "AND NOT granted AND classid = %s::oid AND objid = %s::oid",
        lease_lock(schema, fence),
    ).fetchone()
    return bool(row[0])


def test_wait_is_one_statement_woken_by_the_release(
    backends: Backends, schema: str, admin: Any
) -> None:
    holder_backend = backends()
    with CountingProxy(HOST, PORT) as proxy:
        waiter = backends(via(proxy.port, schema))
        place = waiter.wait("job:free", 5.0)  # opens the waiter connection
        assert place is not None
        place.leave()
        assert waiter.get("job:free") is None  # opens the lock session
        lease = holder_backend.try_acquire("job:push", holder(), None)
        assert lease is not None
        proxy.reset()
        woken: list[Place | None] = []
        counted = threading.Event()

        def wait() -> None:
            woken.append(waiter.wait("job:push", 60))
            counted.wait(30)  # keep the place (and its leaving) until the count is read

        thread = threading.Thread(target=wait)
        thread.start()
        eventually(lambda: waiting_on(admin, schema, lease.fence), "the waiter in the server")
        assert woken == []
        holder_backend.release(lease, Outcome.SUCCEEDED)
        eventually(lambda: woken or None, "woken by the release")
        [place] = woken
        assert place is not None and place.key == "job:push"
        assert proxy.round_trips == 1  # no polling: one message, answered by the server
        counted.set()
        thread.join(timeout=30)
        place.leave()


def test_wait_wakes_when_the_holder_session_dies(
    backends: Backends, admin: Any, schema: str
) -> None:
    holder_backend, waiter = backends(), backends()
    lease = holder_backend.try_acquire("job:dies", holder(), None)
    assert lease is not None
    woken: list[Place | None] = []
    thread = threading.Thread(target=lambda: woken.append(waiter.wait("job:dies", 60)))
    thread.start()
    eventually(lambda: waiting_on(admin, schema, lease.fence), "the waiter queued in the server")
    admin.execute("SELECT pg_terminate_backend(%s)", (session_pid(holder_backend),))
    thread.join(timeout=30)
    [place] = woken
    assert place is not None
    assert waiter.try_acquire("job:dies", holder(), None, place=place) is not None
    assert not place.held  # used up by the acquire


def test_wait_times_out_while_held_and_leaks_no_setting(backends: Backends) -> None:
    holder_backend, waiter = backends(), backends()
    assert holder_backend.try_acquire("job:held", holder(), None) is not None
    assert waiter.wait("job:held", 0.2) is None  # a timed-out wait keeps no place
    assert waiter.wait("job:held", 0) is None
    place = waiter.wait("job:free-now", 1.0)
    assert isinstance(place, Queued) and place.key == "job:free-now"
    conn = place.conn
    assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    place.leave()
    assert not place.held
    assert waiter.session_info()["lock_timeout"] == "0"
    assert holder_backend.session_info()["lock_timeout"] == "0"


def test_wait_for_a_ttl_lease_ends_at_its_expiry(backends: Backends) -> None:
    holder_backend, waiter = backends(), backends()
    lease = holder_backend.try_acquire("job:ttl", holder(), 0.3)
    assert lease is not None
    returned = threading.Event()
    thread = threading.Thread(target=lambda: (waiter.wait("job:ttl", 600), returned.set()))
    thread.start()
    assert returned.wait(30), "the wait did not end at the lease's expiry"
    assert waiter.try_acquire("job:ttl", holder(), None) is not None


def test_lock_timeout_reported_after_the_key_came_free_still_lets_the_lock_take_it(
    backends: Backends, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Postgres can raise 55P03 just after granting the lock (DistributedLock#147); the
    waiter then leaves the queue (letting go of whatever was granted) and its Lock tries
    the key again. Here the error is forced by a statement that always times out on a lock
    the admin holds."""
    holder_backend, waiter = backends(), backends()
    admin.execute("SELECT pg_advisory_lock(-42)")
    forced = (
        "SELECT set_config('lock_timeout', '10', true);\n"
        "SELECT pg_advisory_xact_lock_shared(-42) FROM (SELECT %(key)s, %(ms)s) AS given"
    )
    monkeypatch.setattr(waiter._sql, "wait", forced)
    lease = holder_backend.try_acquire("job:race", holder(), None)
    assert lease is not None
    assert waiter.wait("job:race", 5) is None  # no place kept after the error
    holder_backend.release(lease, Outcome.SUCCEEDED)
    lock = Lock(waiter, "job:race", wait=5)
    taken = lock.acquire()  # free, despite the 55P03 on each wait
    assert taken.fence > lease.fence
    lock.release()
    admin.execute("SELECT pg_advisory_unlock(-42)")


def test_more_waiting_threads_than_waiter_connections_still_wake(
    backends: Backends, url: str
) -> None:
    holder_backend = backends()
    waiter = backends(with_options(url, max_waiters=1))
    lease = holder_backend.try_acquire("job:many", holder(), None)
    assert lease is not None
    done = threading.Event()
    results: list[bool] = []

    def wait() -> None:
        while not done.is_set():
            if waiter.get("job:many") is None:
                results.append(True)
                return
            waiter.wait("job:many", 0.5)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for thread in threads:
        thread.start()
    holder_backend.release(lease, Outcome.SUCCEEDED)
    for thread in threads:
        thread.join(timeout=30)
    done.set()
    assert results == [True, True, True]


# -- replies lost in flight ------------------------------------------------------------------


def warm_up(backend: PostgresBackend) -> None:
    """Open the session and prepare the statements, so that a cut reply is an execution's."""
    lease = backend.try_acquire("job:warm-up", holder(), None)
    assert lease is not None
    backend.release(lease, Outcome.SUCCEEDED, "none", "ran", {"r": 1})


@pytest.fixture
def cutting() -> Iterator[CountingProxy]:
    with CountingProxy(HOST, PORT) as proxy:
        yield proxy


def test_release_whose_reply_was_lost_is_read_back_by_token(
    backends: Backends, schema: str, cutting: CountingProxy
) -> None:
    backend = backends(via(cutting.port, schema))
    warm_up(backend)
    lease = backend.try_acquire("job:cut", holder(), None)
    assert lease is not None
    cutting.drop_next_reply()
    record = backend.release(lease, Outcome.SUCCEEDED, "none", "ran", {"r": 1})
    assert cutting.dropped == 1
    assert record is not None  # it landed: the record says so
    assert record.lease.token == lease.token and record.result == {"r": 1}
    assert backend.history(key="job:cut") == [record]
    assert backend.get("job:cut") is None


def test_a_ttl_lease_whose_renewal_reply_was_lost_is_not_reported_lost(
    backends: Backends, schema: str, cutting: CountingProxy
) -> None:
    # liveness=ttl: the lease lives by its ttl, not by the session the cut ended, so the
    # renewal fails as an error to try again (the renewer does), not as a lost lease. (That
    # mode has no asyncio client: AsyncLock runs it in threads.)
    backend = backends(via(cutting.port, schema, liveness="ttl", ttl=60))
    lease = backend.try_acquire("job:cut-renew", holder(), 30)
    assert lease is not None and backend.renew(lease, 30) is not None  # prepared
    cutting.drop_next_reply()
    with pytest.raises(BackendError):
        backend.renew(lease, 60)
    assert cutting.dropped == 1
    renewed = backend.renew(lease, 60)
    assert renewed is not None and renewed.token == lease.token
    held = backend.get("job:cut-renew")
    assert held is not None and held.token == lease.token


def passed_on(proxy: FreezingProxy) -> None:
    """Wait until ``proxy`` has passed the server's FATAL "terminating connection" (SQLSTATE
    57P01) on to its client (its thread runs beside the test's) and kept the socket open."""
    eventually(lambda: proxy.ended_saying(b"C57P01\0"), "the proxy passed the FATAL message on")


@pytest.mark.timeout(60)
def test_an_idle_session_the_server_said_it_ended_is_replaced_though_its_socket_stays_open(
    backends: Backends, admin: Any, schema: str
) -> None:
    """The server ends an idle lock session (a restart, a failover, ``pg_terminate_backend``):
    its FATAL message tells, not the end of the socket, which may come later (seen over
    40 ms on a loaded machine). Here a proxy passes the message on and keeps the client's
    socket open: the next acquire opens a new session instead of failing on the old one
    (before the fix, it was sent on the ended session and waited for an answer that never
    came: failed by the timeout mark)."""
    proxy = FreezingProxy(PORT)
    try:
        backend = backends(via(proxy.port, schema))
        warm = backend.try_acquire("job:said-ended", holder(), None)
        assert warm is not None and backend.release(warm, Outcome.SUCCEEDED) is not None
        pid = session_pid(backend)
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_ended(admin, pid)
        passed_on(proxy)

        lease = backend.try_acquire("job:said-ended", holder(), None)  # no BackendError
        assert lease is not None and lease.fence > warm.fence
        assert lease_session_pids(admin, schema, lease.fence) == [session_pid(backend)] != [pid]
        assert backend.release(lease, Outcome.SUCCEEDED) is not None
        assert [r.outcome for r in backend.history(key="job:said-ended")] == [Outcome.SUCCEEDED] * 2
    finally:
        proxy.close()


@pytest.mark.timeout(60)
def test_an_idle_loop_session_the_server_said_it_ended_is_replaced_though_its_socket_stays_open(
    backends: Backends, admin: Any, schema: str
) -> None:
    """The same for a loop's lock session (``AsyncLock``)."""
    proxy = FreezingProxy(PORT)
    backend = backends(via(proxy.port, schema))

    async def scenario() -> tuple[int, list[int]]:
        async with AsyncLock(backend, "job:said-ended-aio") as warm:
            [pid] = lease_session_pids(admin, schema, warm.fence)
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_ended(admin, pid)
        passed_on(proxy)
        async with AsyncLock(backend, "job:said-ended-aio") as lease:  # no BackendError
            assert lease.fence > warm.fence
            return pid, lease_session_pids(admin, schema, lease.fence)

    try:
        pid, now = asyncio.run(scenario())
        assert len(now) == 1 and now != [pid]
        outcomes = [r.outcome for r in backend.history(key="job:said-ended-aio")]
        assert outcomes == [Outcome.SUCCEEDED] * 2
    finally:
        proxy.close()


def test_release_on_a_dead_session_is_lost_and_left_for_reap(
    backends: Backends, schema: str, admin: Any
) -> None:
    backend = backends()
    lease = backend.try_acquire("job:dead", holder(), None)
    assert lease is not None
    admin.execute("SELECT pg_terminate_backend(%s)", (session_pid(backend),))
    eventually(lambda: lease_session_pids(admin, schema, lease.fence) == [], "the session ended")
    assert backend.release(lease, Outcome.SUCCEEDED) is None  # did not land: lost
    assert [r.outcome for r in backend.reap()] == [Outcome.DISCONNECTED]


def test_acquire_whose_reply_was_lost_is_undone(
    backends: Backends, schema: str, cutting: CountingProxy
) -> None:
    backend = backends(via(cutting.port, schema))
    warm_up(backend)
    cutting.drop_next_reply()
    with pytest.raises(BackendError) as caught:
        backend.try_acquire("job:cut-acquire", holder(), None)
    assert isinstance(caught.value.__cause__, psycopg.OperationalError)
    assert backend.get("job:cut-acquire") is None  # the orphan was cleared by its token
    [record] = backend.history(key="job:cut-acquire")
    assert record.outcome is Outcome.DISCONNECTED
    assert record.details == "the lock session was lost while acquiring"
    assert backend.try_acquire("job:cut-acquire", holder(), None) is not None


# -- a transaction-mode pooler ----------------------------------------------------------------


class TransactionPooler:
    """A minimal transaction-mode pooler: the client's startup is replayed to two server
    connections, and each transaction (up to a ReadyForQuery 'idle') goes to the next one."""

    def __init__(self, host: str, port: int, servers: int = 2) -> None:
        self.target = (host, port)
        self.servers = servers
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.closing = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        servers: list[socket.socket] = []
        try:
            startup = self._startup(client)
            for index in range(self.servers):
                server = socket.create_connection(self.target)
                servers.append(server)
                server.sendall(startup)
                for kind, message in _messages(server):
                    if index == 0:
                        client.sendall(message)
                    if kind == b"Z":
                        break
            self._relay(client, servers)
        except OSError:
            pass
        finally:
            for sock in (client, *servers):
                sock.close()

    @staticmethod
    def _startup(client: socket.socket) -> bytes:
        while True:
            length = struct.unpack("!I", _exactly(client, 4))[0]
            body = _exactly(client, length - 4)
            if struct.unpack("!I", body[:4])[0] in (80877103, 80877104):  # SSL / GSS request
                client.sendall(b"N")
                continue
            return struct.pack("!I", length) + body

    @staticmethod
    def _relay(client: socket.socket, servers: list[socket.socket]) -> None:
        current = 0
        incoming = _messages(client)
        while True:
            for kind, message in incoming:
                servers[current].sendall(message)
                if kind in (b"S", b"Q", b"X"):  # Sync, simple Query or Terminate
                    break
            else:
                return
            if kind == b"X":
                return
            for reply_kind, reply in _messages(servers[current]):
                client.sendall(reply)
                if reply_kind == b"Z":
                    if reply[5:6] == b"I":  # idle: the transaction is over
                        current = (current + 1) % len(servers)
                    break


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("connection closed")
        data += chunk
    return data


def _messages(sock: socket.socket) -> Iterator[tuple[bytes, bytes]]:
    """(type, whole message) for each protocol message read from ``sock``."""
    while True:
        head = _exactly(sock, 5)
        length = struct.unpack("!I", head[1:])[0]
        yield head[:1], head + _exactly(sock, length - 4)


@pytest.fixture
def pooler() -> Iterator[TransactionPooler]:
    proxy = TransactionPooler(HOST, PORT)
    yield proxy
    proxy.close()


def test_transaction_mode_pooler_is_refused(
    backends: Backends, schema: str, pooler: TransactionPooler
) -> None:
    backends()  # migrates the schema directly
    pooled = PostgresBackend.from_url(via(pooler.port, schema))
    with pytest.raises(ConfigurationError, match="transaction-mode pooler") as caught:
        pooled.try_acquire("job:pooled", holder(), None)
    assert "pid changed" in str(caught.value)
    pooled.close()


def test_the_fake_pooler_really_switches_server_connections(pooler: TransactionPooler) -> None:
    conn = psycopg.connect(
        f"postgresql://postgres@127.0.0.1:{pooler.port}/test?sslmode=disable&gssencmode=disable",
        autocommit=True,
    )
    try:
        pids = {conn.execute("SELECT pg_backend_pid()").fetchone()[0] for _ in range(4)}
        assert len(pids) == 2
    finally:
        conn.close()


def queue_waiters(admin: Any, schema: str, key: str) -> tuple[int, int]:
    """(granted, waiting) sessions on ``key``'s queue lock (the two-int advisory form)."""
    space = Names(schema, "").key_space("queue") & 0xFFFFFFFF
    row = admin.execute(
        "SELECT count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted) "
        "FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND classid = %s::oid "
        "AND objid = hashtext(%s)::oid",
        (space, key),
    ).fetchone()
    return int(row[0]), int(row[1])


def test_a_release_wakes_the_first_waiter_only_and_the_queue_moves_up(
    backends: Backends, admin: Any, schema: str
) -> None:
    holder_backend = backends()
    waiters = [backends() for _ in range(3)]
    lease = holder_backend.try_acquire("job:queue", holder(), None)
    assert lease is not None
    woken = [threading.Event() for _ in waiters]
    done = threading.Event()
    leases: list[Any] = [None] * len(waiters)

    def wait(index: int) -> None:
        backend = waiters[index]
        place = None  # each waiter keeps its place in the queue, as Lock.acquire does
        while leases[index] is None:
            place = backend.wait("job:queue", 30, place)
            woken[index].set()
            leases[index] = backend.try_acquire("job:queue", holder(), None, place=place)
        done.wait(30)

    first = threading.Thread(target=wait, args=(0,))
    first.start()
    eventually(lambda: waiting_on(admin, schema, lease.fence), "the first waiter on the holder")
    others = [threading.Thread(target=wait, args=(n,)) for n in (1, 2)]
    for thread in others:
        thread.start()
    eventually(lambda: queue_waiters(admin, schema, "job:queue") == (1, 2), "two in the queue")

    holder_backend.release(lease, Outcome.SUCCEEDED)
    eventually(lambda: leases[0], "the first waiter's lease")
    new = leases[0]
    # The next waiter moved up to wait on the new holder, inside the server; the third
    # still sleeps in the queue: one release woke one client.
    eventually(lambda: waiting_on(admin, schema, new.fence), "the second waiter on the new one")
    assert queue_waiters(admin, schema, "job:queue") == (1, 1)
    assert not woken[1].is_set() and not woken[2].is_set()
    done.set()
    waiters[0].release(new, Outcome.SUCCEEDED)
    order: list[int] = []
    for _ in (1, 2):  # the other two, in their order in the queue
        index = eventually(
            lambda: next((n for n in (1, 2) if n not in order and leases[n] is not None), None),
            "the next waiter's lease",
        )
        order.append(index)
        waiters[index].release(leases[index], Outcome.SUCCEEDED)
    assert sorted(order) == [1, 2]
    for thread in [first, *others]:
        thread.join(timeout=30)


def test_a_releaser_lets_a_waiting_process_go_first(
    backends: Backends, admin: Any, schema: str
) -> None:
    releaser, waiter = backends(), backends()
    lease = releaser.try_acquire("job:polite", holder(), None)
    assert lease is not None
    got: list[Any] = []

    def wait() -> None:
        place = waiter.wait("job:polite", 30)
        got.append(waiter.try_acquire("job:polite", holder(), None, place=place))

    thread = threading.Thread(target=wait)
    thread.start()
    eventually(lambda: waiting_on(admin, schema, lease.fence), "the waiter on the holder")
    releaser.release(lease, Outcome.SUCCEEDED)
    # Straight back: the waiter, first in the queue, goes first.
    assert releaser.try_acquire("job:polite", holder(), None) is None
    thread.join(timeout=30)
    assert got and got[0] is not None
    held = releaser.get("job:polite")
    assert held is not None and held.token == got[0].token


def test_a_set_waiter_keeps_its_place_though_it_released_the_key_last(
    backends: Backends, admin: Any, schema: str
) -> None:
    """A ``Locks`` waiter woken first takes the key with its place in the queue, though it
    released the key last while another waited (which makes its own tries yield to a
    waiter for a second). Leaving its place before its try, it let the waiter behind go
    first, and each woken set waiter the next: a second's stall per contended set."""
    mine, other, third = backends(), backends(), backends()
    key = "job:set:polite"
    first = mine.try_acquire(key, holder(), None)
    assert first is not None
    taken: list[Any] = []

    def take_as_other() -> None:
        place = other.wait(key, 30)
        taken.append(other.try_acquire(key, holder(), None, place=place))

    thread = threading.Thread(target=take_as_other)
    thread.start()
    eventually(lambda: waiting_on(admin, schema, first.fence), "the other on the holder")
    mine.release(first, Outcome.SUCCEEDED)  # while the other waited
    thread.join(timeout=30)
    [second] = taken
    assert second is not None
    got: dict[str, Any] = {}
    locks, later = Locks(mine, [key], wait=30), Lock(third, key, wait=30)
    set_thread = threading.Thread(target=lambda: got.setdefault("set", locks.acquire()))
    set_thread.start()
    eventually(lambda: waiting_on(admin, schema, second.fence), "the set on the new holder")
    later_thread = threading.Thread(target=lambda: got.setdefault("later", later.acquire()))
    later_thread.start()
    eventually(lambda: queue_waiters(admin, schema, key) == (1, 1), "a later waiter behind")
    other.release(second, Outcome.SUCCEEDED)
    set_thread.join(timeout=30)
    [lease] = got["set"]
    current = mine.get(key)
    assert current is not None and current.token == lease.token  # first come, first served
    assert "later" not in got
    locks.release()
    later_thread.join(timeout=30)
    assert later.release() is not None
