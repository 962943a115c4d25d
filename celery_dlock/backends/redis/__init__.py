"""Locks in Redis: one Lua script per change, fences, a capped history stream, push wakeups.

URL
    ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS),
    ``unix:///path/to/redis.sock?db=N`` and ``redis+cluster://host:port,host:port`` (a Redis
    Cluster), e.g. ``redis://:s3cret@cache:6379/1?prefix=jobs``.

Options
    ``prefix`` (default ``dlock``): the namespace of our Redis keys; no braces.
    ``history_maxlen`` (default 100000): the history stream is capped near this length
    (``XADD MAXLEN ~``: trimmed in whole stream nodes, so it may run ~100 over).
    ``success_ttl`` (seconds, default 30 days): how long ``last_success`` results (for
    ``once``) live; they are not history and ``prune_history`` leaves them.
    ``gc_after`` (seconds, default 1 day): a free key's state (its fence) is dropped this
    long after its last release; its next fence then starts from Redis's clock.
    ``restart_delay`` (seconds, default 30): after Redis lost its data, restarted or failed
    over, no lock is granted for this long (see Guarantees); 0 turns it off.
    ``buckets`` (default 1): hash slots the namespace is spread over (Redis Cluster).
    ``retries`` (default 2): retries of a command whose connection failed, after 50 ms,
    100 ms...; each script is safe to run twice.
    ``replicas`` (default 0): a release, a record and a kept or forgotten ``once`` success
    count once this many replicas have them (``WAIT``, within ``replicas_timeout``
    seconds, default 1): a failover then cannot bring back a lease released or lose a
    success (:mod:`celery_dlock.backends.redis.replicas`).
    ``socket_timeout``, ``socket_connect_timeout`` (seconds, default 5), ``db`` (for
    ``unix://``), and for ``rediss://``: ``ssl_ca_certs``, ``ssl_certfile``,
    ``ssl_keyfile``, ``ssl_cert_reqs`` (``none``/``optional``/``required``),
    ``ssl_check_hostname``. Unknown options are errors.

Layout
    See :mod:`celery_dlock.backends.redis.layout`: every key of a lock, and the index and
    history stream it writes, are in one cluster hash slot; no command scans the keyspace.

Guarantees
    liveness: a lease expires by Redis's own clock (``SET PXAT``), so client clock skew
    does not matter; a holder that stops renewing (SIGKILL, lost host) loses its key at
    expiry. A lease that Redis expired is recorded ``expired`` by the next ``try_acquire``,
    ``release``, ``renew`` or ``reap`` that sees it, exactly once (the check and the record
    are one script). A lease taken with ``ttl=None`` gets the URL's ``ttl`` (default 60 s),
    which a ``Lock`` renews: a lease never lives here without an expiry.
    partition: a holder cut off from Redis cannot renew; its lease expires on Redis's
    clock while it may still run. Fences make that detectable: hand ``lease.fence`` to
    the resource and have it refuse lower ones.
    restart: with no persistence a restart loses every lock and the history. Holders then
    see ``release`` return None and ``renew`` fail (``lost``). Fences stay increasing: a
    fence is Redis's clock in microseconds at the grant (at least the key's last fence +
    1), above any fence issued before, unless Redis's clock went back by more than the
    outage. A client that saw the
    old data notices the loss (the epoch key is gone) and no lock is granted for
    ``restart_delay`` seconds, so that holders of lost locks notice at their next renewal
    (keep ``restart_delay`` above ``ttl / 3``). A process that never talked to Redis before
    cannot tell a loss from a first use: it waits until the server has been up for
    ``restart_delay``, which covers a restart; a FLUSHDB or a failover to an empty replica
    met first by such a process is seen once an older client comes by. A restart that
    kept its data (an RDB snapshot, an AOF) may have lost the leases granted after its
    last write to disk: each bucket notes the server process that granted its leases
    (``run_id``, read when ``LASTSAVE`` changes), and after a start within
    ``restart_delay`` no lock is granted until ``restart_delay`` from the start. AOF
    ``appendfsync always`` keeps every lock and record across restarts.
    failover: replication is asynchronous; a replica promoted before it received a lock
    may have lost it (redis.io, "distlock"). A promoted replica is another process: no
    lock is granted for ``restart_delay`` from the first acquire it serves. The fence,
    from the promoted node's clock, is higher than the lost lease's (the nodes' clocks
    must agree within the seconds a failover takes).
    eviction: Redis must run with ``maxmemory-policy noeviction``: an evicted lock key is
    a lock given away.
    cluster: each script touches one hash slot, so the layout is cluster-legal; a
    ``redis+cluster://host:port,host:port`` URL routes each command to its slot's primary,
    following ``MOVED`` and ``ASK`` (``buckets`` defaults to 16 there); a failover to a
    replica that lacked the last writes loses those leases (the fence shows it).
    durability: ``durable_history`` is False: history is as durable as Redis's
    persistence, which this backend cannot see.
    wait: ``BLPOP`` on the key's signal list, which each release fills for the first
    waiter (Redis serves blocked clients first come, first served); bounded by the lease's
    expiry and by a 15 s fallback, since a wake-up can go to a waiter that then gives up.
    A waiter for any slot of a ``limit`` blocks on all its slots' lists in one ``BLPOP``;
    on a cluster, where they hash to different slots, on each bucket's in turn (100 ms).

Install
    ``pip install 'celery-dlock[redis]'`` (redis-py 5 or newer; hiredis optional). Redis
    7.0 or newer (``XADD <ms>-*``; ``SET PXAT``, ``XTRIM MINID``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

from celery_dlock.backends import mask_url
from celery_dlock.backends.base import (
    Capabilities,
    Check,
    LockBackend,
    Place,
    hand_over_ttl,
    remembered,
    success_task,
)
from celery_dlock.backends.redis import history
from celery_dlock.backends.redis.aio import AsyncRedis
from celery_dlock.backends.redis.calls import TURN, Calls
from celery_dlock.backends.redis.client import Client, Connections, Wire, doubt
from celery_dlock.backends.redis.cluster import ClusterConnections
from celery_dlock.backends.redis.doctor import checks
from celery_dlock.backends.redis.fields import (
    lease_from_state,
    record_fields,
    record_from_fields,
)
from celery_dlock.backends.redis.history import ms_floor
from celery_dlock.backends.redis.history_scripts import ADD, FORGET, PRUNE, REMEMBER
from celery_dlock.backends.redis.layout import Layout
from celery_dlock.backends.redis.replicas import Replicas
from celery_dlock.backends.redis.resp import bulks
from celery_dlock.backends.redis.scripts import ACQUIRE, DUE, EXPIRE, PEEK, PROBE, RELEASE, RENEW
from celery_dlock.backends.redis.url import parse_url
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.records import Holder, Lease, Outcome, Record, describe_exception, new_token

__all__ = ["RedisBackend"]

_DAY = 86400.0
#: Leases read per pipelined round trip by ``leases()``.
PEEK_BATCH = 1000
#: The ttl of a ``Lock`` given none (``ttl`` option): a lease's only liveness here is its
#: ttl, so one without would outlive a killed holder for good.
DEFAULT_TTL = 60.0
#: How long the mark of a forget lives: longer than the client's retries of its script.
FORGET_MARK_MS = 60_000


class RedisBackend(LockBackend):
    """Locks in one Redis (or a proxy to it); liveness is the lease's expiry."""

    name = "redis"
    capabilities: ClassVar[Capabilities] = Capabilities(
        liveness="lease",
        push_wait=True,
        cross_process=True,
        cross_host=True,
        durable_history=False,
        server_clock=True,
    )

    def __init__(
        self,
        connection: dict[str, Any] | None = None,
        *,
        prefix: str = "dlock",
        buckets: int = 1,
        history_maxlen: int = 100_000,
        success_ttl: float = 30 * _DAY,
        gc_after: float = _DAY,
        restart_delay: float = 30.0,
        ttl: float = DEFAULT_TTL,
        retries: int = 2,
        replicas: int = 0,
        replicas_timeout: float | None = None,
        url: str = "redis://localhost:6379/0",
    ) -> None:
        for option, value in (("success_ttl", success_ttl), ("gc_after", gc_after), ("ttl", ttl)):
            if not value > 0:
                raise ConfigurationError(f"{option} must be positive seconds, not {value!r}")
        if not restart_delay >= 0:
            raise ConfigurationError(f"restart_delay must be seconds >= 0, not {restart_delay!r}")
        if history_maxlen < 1 or retries < 0:
            raise ConfigurationError(
                f"history_maxlen must be >= 1 and retries >= 0, not {history_maxlen}, {retries}"
            )
        if not isinstance(connection, Mapping | None):
            raise ConfigurationError(
                f"RedisBackend takes redis-py connection settings as a dict, not {connection!r}"
                " (for a URL: RedisBackend.from_url or backend_from_url)"
            )
        self.url = url
        # A lease lives by its ttl alone here: a Lock without one gets this, renewed.
        self.default_ttl = float(ttl)
        settings = dict(connection or {})
        nodes = settings.pop("cluster_nodes", None)
        made = Connections if nodes is None else partial(ClusterConnections, nodes=nodes)
        self._layout = layout = Layout(prefix, buckets, cluster=nodes is not None)
        self._client = Client(
            settings, retries, url, made, claims=layout.claims(), check=layout.check_all
        )
        self.calls = Calls(
            layout,
            history_maxlen=history_maxlen,
            gc_after=gc_after,
            restart_delay=restart_delay,
            success_ttl=success_ttl,
            slack=self._client.slack,
            default_ttl=self.default_ttl,
        )
        self._replicas = Replicas.of(replicas, replicas_timeout, self._client.slack)
        self._async: AsyncRedis | None = None
        self._async_made = threading.Lock()  # two loops' threads may ask at once

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBackend:
        connection, settings = parse_url(url, options)
        return cls(connection, url=mask_url(url), **settings)

    # -- the contract ----------------------------------------------------------------

    def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None:
        connections = self._client.connections()
        if self.calls.refused is not None:
            self._claim_again(None, connections)  # refused until the marker is ours again
        if connections.doubtful:
            self._settle(connections, key)
        tokens, count, tail, again = self.calls.acquire_call(key, holder, ttl, replace)
        try:
            reply = self._client.run(
                ACQUIRE, count, tail, operation="acquire", key=key, again=again, wire=connections
            )
        except BackendError as exc:
            doubt(connections.doubtful, exc, key, tokens)
            raise
        lease = self.calls.acquired(key, holder, tokens[-1], reply)
        if self.calls.lost_data:
            self._claim_again(lease, connections)
        return lease

    def _claim_again(self, lease: Lease | None, connections: Wire) -> None:
        """Redis lost its data (an acquire met a new epoch), the layout's markers with it:
        claim them again before a lease is granted on the new data (the loss's quarantine
        grants none), so that a process started since with another ``buckets`` is refused,
        or refuses this one. A lease that reply granted all the same (``restart_delay=0``)
        is released if this one is refused, and once Redis answers if the claim failed:
        no caller holds it."""
        try:
            self.calls.judge(self._client.claim())
        except ConfigurationError as exc:
            if lease is not None:
                self.release(lease, Outcome.FAILED, *describe_exception(exc))
            raise
        except BackendError:
            if lease is not None:
                connections.doubtful.append((lease.key, lease.token))
            raise

    def _settle(self, connections: Wire, acquiring: str) -> None:
        """Release the leases of acquires whose reply was lost, recorded ``disconnected``,
        before the acquire of ``acquiring`` (whose error a failure is)."""
        while connections.doubtful:
            key, token = connections.doubtful[0]
            keys, args = self.calls.settle_call(key, token)
            self._client.eval(RELEASE, keys, args, operation="acquire", key=acquiring)
            connections.doubtful.pop(0)

    def release(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None:
        outcome = outcome if type(outcome) is Outcome else Outcome(outcome)
        count, tail, again = self.calls.release_call(lease, outcome, problem, details, result)
        if self._replicas is None:
            reply = self._client.run(
                RELEASE, count, tail, operation="release", key=lease.key, again=again
            )
        else:
            synced = self._layout.synced(lease.key)
            parts = (count, tail, again)
            reply = self._replicas.run(self._client, synced, RELEASE, parts, lease.key)
        return self.calls.released(
            reply, lease, outcome=outcome, problem=problem, details=details, result=result
        )

    def add_record(self, record: Record) -> None:
        keys = [self._layout.history(self._layout.bucket(record.key))]
        result_ms = ""
        task_name = remembered(record.outcome, record.result, record.lease.holder.task_name)
        if task_name is not None:
            keys.append(self._layout.result(record.key, task_name))
            result_ms = self.calls.success_ms
        first_id = max(0, ms_floor(record.released_at) + 2)
        args = [self.calls.common[0], first_id, result_ms, *record_fields(record)]
        self._client.eval(ADD, keys, args, operation="add_record", key=record.key)
        self._confirm(record.key, "add_record")

    def remember(self, record: Record) -> bool:
        result_key = self._layout.result(record.key, success_task(record))
        args = [self.calls.success_ms, *record_fields(record)]
        kept = self._client.eval(REMEMBER, [result_key], args, operation="remember", key=record.key)
        self._confirm(record.key, "remember")
        return bool(kept)

    def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        count, tail = self.calls.renew_call(lease, ttl)
        reply = self._client.run(RENEW, count, tail, operation="renew", key=lease.key)
        return self.calls.renewed(lease, reply)

    def hand_over(self, lease: Lease, ttl: float, if_unchanged: bool = False) -> Lease | None:
        """:meth:`renew` that never shortens: leases here live by their ttl alone."""
        count, tail = self.calls.renew_call(lease, hand_over_ttl(ttl), True, if_unchanged)
        reply = self._client.run(RENEW, count, tail, operation="hand_over", key=lease.key)
        return self.calls.renewed(lease, reply)

    def get(self, key: str) -> Lease | None:
        state = self._client.eval(PEEK, self.calls.peek_keys(key), [], operation="get", key=key)
        return lease_from_state(key, state) if state else None

    def leases(self, prefix: str = "") -> list[Lease]:
        """The leases of the index's keys under ``prefix``, read in pipelined batches of
        :data:`PEEK_BATCH` (one round trip per lease took 12 s for 50,000 leases)."""
        found = []
        for bucket in range(self._layout.buckets):
            members = self._client.command("leases", "ZRANGE", self._layout.index(bucket), 0, -1)
            keys = [m.decode("utf-8", "surrogatepass") for m in members]
            keys = [key for key in keys if key.startswith(prefix)]
            for start in range(0, len(keys), PEEK_BATCH):
                batch = keys[start : start + PEEK_BATCH]
                peeks = [self.calls.peek_keys(key) for key in batch]
                calls = [(1 + len(k), bulks([len(k), *k])) for k in peeks]
                states = self._client.run_all(PEEK, calls, operation="leases")
                found += [
                    lease_from_state(k, st) for k, st in zip(batch, states, strict=True) if st
                ]
        return sorted(found, key=lambda lease: lease.key)

    def history(
        self,
        key: str | None = None,
        outcome: Outcome | None = None,
        since: float | None = None,
        limit: int | None = 100,
    ) -> list[Record]:
        """Records newest first, read with ``XREVRANGE`` back to ``since``; a filter by key
        or outcome runs in Redis, 500 records per call, and only what matches travels (a
        rare key among 100,000 records: 1 s, 10 s before). Records are in the order Redis
        released them."""
        return history.read(
            self._client, self._layout, key=key, outcome=outcome, since=since, limit=limit
        )

    def last_success(self, key: str, task_name: str) -> Record | None:
        fields = self._client.command(
            "last_success", "HGETALL", self._layout.result(key, task_name)
        )
        return record_from_fields(fields) if fields else None

    def forget_success(self, key: str, task_name: str, token: str) -> bool:
        result_key = self._layout.result(key, task_name)
        # The call's nonce, left in a mark: a retry of a run whose reply was lost finds the
        # success gone and its own nonce, not a forget by someone else (the client retries).
        keys = [result_key, self._layout.forget_mark(key, task_name)]
        args = [token, new_token(), FORGET_MARK_MS]
        forgotten = self._client.eval(FORGET, keys, args, operation="forget", key=key)
        self._confirm(key, "forget")
        return bool(forgotten)

    def _confirm(self, key: str, operation: str) -> None:
        """With ``replicas``: return once that many replicas have what was written in
        ``key``'s slot so far (see :mod:`celery_dlock.backends.redis.replicas`).

        Raises:
            BackendError: fewer acknowledged it in time, or the store failed.
        """
        if self._replicas is not None:
            self._replicas.confirm(self._client, self._layout.synced(key), operation, key)

    def reap(self, limit: int = 100) -> list[Record]:
        """Records ``expired`` the leases that Redis expired, found through the index (by
        expiry, by Redis's clock), never by scanning keys, a batch of up to ``limit`` per
        round trip. Concurrent reapers record each lease once: the check and the record are
        one script."""
        reaped: list[Record] = []
        for bucket in range(self._layout.buckets):
            room = limit - len(reaped)
            if room <= 0:
                break
            due = self._client.eval(DUE, [self._layout.index(bucket)], [room], operation="reap")
            calls = []
            for member in due:
                names = self._layout.names(member.decode("utf-8", "surrogatepass"))
                parts = [5, *names[:5], *self.calls.common, member]
                calls.append((len(parts), bulks(parts)))
            # One round trip for the batch (the scripts are safe to run twice).
            for fields in self._client.run_all(EXPIRE, calls, operation="reap") if calls else []:
                if fields:
                    reaped.append(record_from_fields(fields))
        return reaped

    def prune_history(self, before: float) -> int:
        """Trims each stream by id (``XTRIM MINID``) and checks the records of the cut's
        last few milliseconds one by one; kept results are other keys and stay."""
        first = max(0, ms_floor(before))
        args = [repr(float(before)), first, first + 4]
        return sum(
            int(
                self._client.eval(
                    PRUNE, [self._layout.history(bucket)], args, operation="prune_history"
                )
            )
            for bucket in range(self._layout.buckets)
        )

    def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None:
        """Block on the key's signal list until a release pushes a wake-up, the lease
        expires (by Redis's clock), ``timeout`` passes, or the 15 s fallback."""
        self.wait_any((key,), timeout)
        return None  # no queue: nothing to keep

    def wait_any(self, keys: Sequence[str], timeout: float) -> None:
        """``wait`` on the signal lists of all of ``keys`` at once, in one ``BLPOP``. On a
        cluster, whose commands stay in one hash slot, the buckets of ``keys`` take turns
        of up to ``TURN`` seconds each (a lock's slots are in different buckets)."""
        deadline = time.monotonic() + timeout
        groups = self._layout.by_bucket(keys) if self._client.cluster else [list(keys)]
        turn = random.randrange(len(groups))
        while (left := deadline - time.monotonic()) > 0:
            group = groups[turn % len(groups)]
            if self._woken(group, left if len(groups) == 1 else min(left, TURN)):
                return
            turn += 1

    def _woken(self, keys: list[str], timeout: float) -> bool:
        """One wait on ``keys`` of one bucket: True when one is free or a wake-up came."""
        calls = [self.calls.probe_call(key, timeout) for key in keys]
        lefts = self._client.run_all(
            PROBE, [(1 + len(k) + len(a), bulks([len(k), *k, *a])) for k, a in calls],
            operation="wait", key=", ".join(keys),
        )  # fmt: skip
        pauses = [self.calls.pause(left, timeout) for left in lefts]
        if None in pauses:
            return True
        signals = [self._layout.names(key).signal for key in keys]
        return self._client.blpop(signals, min(p for p in pauses if p is not None), keys[0])

    def async_store(self) -> AsyncRedis | None:
        """The asyncio client of this backend: the same scripts on redis-py's asyncio
        connections (one set per event loop); None for a cluster, and with ``replicas``
        (the pool then)."""
        if self._client.cluster or self._replicas is not None:
            return None
        with self._async_made:
            if self._async is None:
                self._async = AsyncRedis(self.calls, self._client)
        return self._async

    def server_time(self) -> float:
        seconds_, micros = self._client.command("server_time", "TIME")
        return int(seconds_) + int(micros) / 1e6

    def diagnose(self) -> list[Check]:
        """Version, eviction policy, persistence, role, cluster mode, and that scripts run:
        read from ``INFO`` (managed Redis often disables ``CONFIG``)."""
        info: dict[str, str] = {}
        for section in ("server", "memory", "persistence", "replication", "cluster"):
            text = self._client.command("diagnose", "INFO", section).decode()
            info.update(line.split(":", 1) for line in text.splitlines() if ":" in line)
        names = self._layout.names("dlock:doctor")
        self._client.eval(PEEK, names[:2], [], operation="diagnose")
        wanted = 0 if self._replicas is None else self._replicas.count
        return checks(info, cluster_client=self._client.cluster, replicas=wanted)

    def close(self) -> None:
        """Close this process's connections (the asyncio client's by a task of each loop)."""
        self._client.close()
        if self._async is not None:
            self._async.close()
