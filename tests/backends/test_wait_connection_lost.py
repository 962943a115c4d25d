"""A wait is only a wake-up: a waiter whose wait connection is cut (a killed client, a
terminated backend, a proxy restart) looks at the key again instead of failing its acquire.
Found by trying the API: ``CLIENT KILL`` every 300 ms failed 157 of the waiters' acquires
with ``BackendError``, and a terminated Postgres waiter backend failed its acquire at once."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from celery_dlock import AsyncLock, Lease, Lock, backend_from_url
from tests.support import eventually

redis = pytest.importorskip("redis")
psycopg = pytest.importorskip("psycopg")

from tests.backends.stores.postgres import schema_store  # noqa: E402
from tests.backends.test_redis import open_backend, our_waiters, prefix, via  # noqa: E402, F401
from tests.support.countingproxy import CountingProxy  # noqa: E402
from tests.support.services import POSTGRES_URL, postgres_admin  # noqa: E402

CLIENTS = pytest.mark.parametrize("client", ["blocking", "asyncio"])


def in_thread(acquire: Callable[[], Lease]) -> tuple[threading.Thread, list[Any]]:
    """``acquire()`` in a thread; what it returned or raised, in the list."""
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(acquire())
        except Exception as exc:  # the test asserts there was none
            got.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def waiter(backend: Any, key: str, client: str) -> Callable[[], Lease]:
    """An acquire of ``key`` that waits up to 30 s, blocking or on an event loop; the lock
    is released at once after (the test checks the lease it got)."""
    if client == "blocking":

        def blocking() -> Lease:
            with Lock(backend, key, wait=30) as lease:
                return lease

        return blocking

    async def on_a_loop() -> Lease:
        async with AsyncLock(backend, key, wait=30) as lease:
            return lease

    return lambda: asyncio.run(on_a_loop())


@CLIENTS
def test_a_redis_waiter_whose_connection_is_killed_looks_again(
    prefix: str,  # noqa: F811
    client: str,
) -> None:
    with CountingProxy("127.0.0.1", 6379) as proxy:
        direct, cut = open_backend(prefix), open_backend(prefix, via(proxy))
        held = Lock(direct, "job:cut-waiter")
        first = held.acquire()
        thread, got = in_thread(waiter(cut, "job:cut-waiter", client))
        for _ in range(3):  # each kill lands in a BLPOP (or a look, which retries)
            eventually(lambda: our_waiters(direct), "the waiter blocked")
            proxy.kill_connections()
        held.release()
        thread.join(30)
        assert got and isinstance(got[0], Lease), got
        assert got[0].fence > first.fence
        assert direct.get("job:cut-waiter") is None
        direct.close()
        cut.close()


@CLIENTS
def test_a_postgres_waiter_whose_backend_is_terminated_looks_again(client: str) -> None:
    name = f"dlock_cut_{os.urandom(4).hex()}"
    admin = postgres_admin()
    with schema_store(POSTGRES_URL, application_name=name) as case:
        held = Lock(case.backend, "job:cut-waiter")
        first = held.acquire()
        other = backend_from_url(case.url)
        thread, got = in_thread(waiter(other, "job:cut-waiter", client))

        def blocked() -> list[int]:
            assert not got, f"the waiter ended instead of looking again: {got}"
            rows = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                "AND state = 'active' AND wait_event_type = 'Lock'",
                (name,),
            ).fetchall()
            return [int(row[0]) for row in rows]

        for _ in range(2):
            [pid] = eventually(blocked, "the waiter blocked")
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        held.release()
        thread.join(30)
        assert got and isinstance(got[0], Lease), got
        assert got[0].fence > first.fence
        assert case.backend.get("job:cut-waiter") is None
        other.close()
    admin.close()
