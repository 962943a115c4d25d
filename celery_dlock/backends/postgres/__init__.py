"""Locks in PostgreSQL: a visible locks table, kept alive by advisory locks.

URL
    ``postgresql://user:password@host:5432/dbname?schema=dlock`` (also
    ``postgresql+psycopg://`` and ``postgres://``; libpq's URI rules apply, e.g.
    ``?host=/var/run/postgresql`` for a Unix socket).

Options
    ``schema`` (default ``dlock``) and ``table_prefix`` (default empty): where the tables
    live; lower-case letters, digits and ``_``.
    ``auto_migrate`` (bool, default false): create missing tables on first use instead of
    raising; otherwise call :meth:`PostgresBackend.migrate` (idempotent) once.
    ``synchronous_commit`` (bool, default false): wait for the WAL flush on every acquire and
    release (see durability below).
    ``keepalives_idle``, ``keepalives_interval``, ``keepalives_count`` (seconds, seconds,
    probes; default 10, 5, 3) and ``tcp_user_timeout`` (milliseconds, default 30000): libpq's
    own parameters and units, set on our connections and mirrored to the server's
    ``tcp_keepalives_*`` and ``tcp_user_timeout``, so each end notices a vanished peer in
    about 30 s (measured 30.5 s: on Linux ``tcp_user_timeout`` bounds the keepalive probes
    too, so lower it, not only the keepalives, to notice sooner).
    ``max_waiters`` (default 8): waiter connections per process; more threads waiting at
    once than that poll every 25-50 ms instead.
    ``liveness`` (``session``, the default, or ``ttl``) and ``ttl`` (seconds, required with
    ``liveness=ttl`` and only then): see "liveness=ttl" below.
    libpq parameters pass through unchanged: ``sslmode``, ``sslrootcert``, ``sslcert``,
    ``sslkey``, ``application_name``, ``connect_timeout`` (default 10), ``options``,
    ``target_session_attrs``... (``LIBPQ_PARAMETERS``). Anything else is an error naming it.

Guarantees
    liveness: each lease's holder also holds an advisory lock keyed on the lease's fence
    (over a 32-bit space from the schema's name, so schemas can share a database) on its lock
    session: one dedicated, unpooled connection per process. A lease is dead once no session
    holds that lock (``pg_locks``): its process died, its connection broke, or the server
    ended the session. ``try_acquire`` then takes the key over and records
    ``disconnected``; until then ``get`` and ``leases`` give its holder as gone
    (``is_gone()``, whatever its host; one read of ``pg_locks`` per call). An optional
    ``ttl`` (judged by the server's clock) also frees a hung but connected holder
    (``expired``). Server-side TCP keepalives and ``tcp_user_timeout``
    notice a vanished host in about 30 s. A transaction-mode pooler (the backend pid
    changes between transactions) is refused.
    fences: from one sequence (``CACHE 1``); grants of a key are serialised, so fences
    increase per key in the order of grants, across clients and restarts.
    crash: when the lock session ends, every lease it held is lost: its ``release`` and
    ``renew`` return None, and the next taker or ``reap()`` records it ``disconnected``.
    clock skew: expiry uses the server's clock only.
    partition: a holder cut off from the server keeps its lease until the server notices
    (keepalives); then the lease is taken over, and the holder's release returns None.
    durability: the lock session commits asynchronously unless ``synchronous_commit`` is on.
    Mutual exclusion does not depend on it: the UNLOGGED locks table and the advisory locks
    both die with a server crash. A crash of the server can lose the last ~0.6 s
    (3 x ``wal_writer_delay``) of history records; ``once`` kept results are committed
    durably all the same (their release waits for the WAL flush), so a task that succeeded
    never runs again because of a crash. Fences never
    repeat: a crash empties the UNLOGGED ``fence_guard`` table (so does a failover: a promoted
    standby's unlogged tables start empty), and a grant finds it empty (no fence is drawn
    then) and first moves the sequence up by 10**9 with a synchronous commit, on any session,
    also one that outlived the failover behind a pooler.
    wait: woken by the server, first come first served: the waiters of a key queue on a
    per-key advisory lock, the first of them waits on the holder's advisory lock (under a
    transaction-local ``lock_timeout``), and a release wakes that one only. A process that
    releases a key others wait for lets them have it before it takes it again. A waiter
    for any slot of a ``limit`` waits so on each slot in turn, 100 ms at a time (a
    statement waits on one lock only), without a place in any queue.

liveness=ttl (``PostgresTTLBackend``)
    For fleets with more worker processes than the server has connections to spare: no
    session state at all (no advisory lock, no server-side prepared statement, no startup
    ``options``, nothing ``SET`` beyond a transaction), so every statement may run on
    another server connection of a transaction-mode pooler (PgBouncer
    ``pool_mode=transaction``). A lease lives by its ttl alone, judged by the server's
    clock, as on Redis: a holder that stops renewing (SIGKILL, lost host, partition) loses
    its key at expiry, recorded ``expired``. A lock that gives no ttl gets the URL's
    ``ttl``; ``Lock`` renews it every ``ttl / 3`` while held. Waiting polls the key, with
    pauses doubling from 50 ms to 1 s.
    The lease row (its backend pid 0), fences, history and ``once`` are the same, and both
    kinds of lease may share one schema. Commits are synchronous (no ``-c`` option can
    turn that off through a pooler).

Install
    ``pip install 'celery-dlock[postgres]'`` (psycopg 3); PostgreSQL 12 or newer. Optional:
    SQLAlchemy for :func:`celery_dlock.backends.postgres.schema.metadata` (Alembic).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from celery_dlock.backends.base import Capabilities, Place
from celery_dlock.backends.postgres.aio import AsyncPostgres
from celery_dlock.backends.postgres.config import LIBPQ_PARAMETERS, parse_url
from celery_dlock.backends.postgres.store import PostgresStore
from celery_dlock.records import Holder, Lease

__all__ = ["LIBPQ_PARAMETERS", "PostgresBackend", "PostgresTTLBackend"]

#: First and longest pause of a ``liveness=ttl`` waiter's polling.
_POLL_FIRST = 0.05
_POLL_LONGEST = 1.0


class PostgresBackend(PostgresStore):
    """Locks in a PostgreSQL table, alive while their holder's lock session holds an
    advisory lock on the lease's fence. ``from_url`` gives a :class:`PostgresTTLBackend`
    for a URL with ``liveness=ttl``. Makes no connection until first used."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        liveness="session",
        push_wait=True,
        cross_process=True,
        cross_host=True,
        durable_history=True,
        server_clock=True,
    )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresBackend:
        if cls is PostgresBackend and parse_url(url, options).liveness == "ttl":
            return PostgresTTLBackend(url, **options)
        return cls(url, **options)


class PostgresTTLBackend(PostgresBackend):
    """``liveness=ttl``: leases alive by their ttl alone (the URL's ``ttl`` when a lock
    gives none), no state on any session, so that it runs through a transaction-mode
    pooler; waiters poll."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        liveness="lease",
        push_wait=False,
        cross_process=True,
        cross_host=True,
        durable_history=True,
        server_clock=True,
    )

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.default_ttl = self._config.ttl

    def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None:
        ttl = self.default_ttl if ttl is None else ttl
        return super().try_acquire(key, holder, ttl, replace, place)

    def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        return super().renew(lease, self.default_ttl if ttl is None else ttl)

    def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None:
        """Poll ``key``: see :meth:`wait_any`."""
        self.wait_any((key,), timeout)
        return None

    def wait_any(self, keys: Sequence[str], timeout: float) -> None:
        """Poll ``keys`` (one read each) with jittered pauses doubling from 50 ms to 1 s,
        until one is free or its lease ran out (by this host's clock: an early return costs
        one more try), or ``timeout`` seconds passed: nothing on the server pushes."""
        deadline = time.monotonic() + timeout
        pause = _POLL_FIRST
        while True:
            leases = [self.get(key) for key in keys]
            remaining = deadline - time.monotonic()
            if None in leases or remaining <= 0:
                return
            ends = [x.expires_at for x in leases if x is not None and x.expires_at is not None]
            until_expiry = min(ends) - time.time() if ends else None
            if until_expiry is not None and until_expiry <= 0:
                return
            nap = min(remaining, pause * random.uniform(0.5, 1.0))
            time.sleep(nap if until_expiry is None else min(nap, until_expiry + 0.001))
            pause = min(pause * 2, _POLL_LONGEST)

    def watch(self, lease: Lease, on_lost: Callable[[Lease], None]) -> None:
        return None  # a lease expires; renewal reports its loss

    def async_store(self) -> AsyncPostgres | None:
        return None  # the asyncio client keeps a lock session; AsyncLock uses the pool
