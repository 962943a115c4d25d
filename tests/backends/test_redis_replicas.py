"""``replicas=N`` on a Redis store: an end (a release, a kept ``once`` success) counts only
once N replicas have it, so a failover cannot bring back a lease released, nor lose a
success. On real servers: a primary and its replica (``redis-server --replicaof``), the
replica stopped by ``SIGSTOP``; and a private Redis Cluster whose primary is killed after
its replica was cut off, the replica promoted."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_dlock import BackendError, ConfigurationError, Holder, Lease, Outcome, Record
from celery_dlock.backends.redis import RedisBackend
from tests.support import eventually
from tests.support.redis_cluster import Cluster
from tests.support.redis_pair import Pair

pytest.importorskip("redis")


def test_the_url_options_are_checked() -> None:
    backend = RedisBackend.from_url("redis://127.0.0.1:1/0?replicas=2&replicas_timeout=0.5")
    assert backend._replicas is not None and backend._replicas.count == 2
    assert backend._replicas.timeout == 0.5
    assert backend.async_store() is None  # asyncio runs the blocking calls in the pool
    assert RedisBackend.from_url("redis://127.0.0.1:1/0")._replicas is None  # off by default
    with pytest.raises(ConfigurationError, match="replicas must be a whole number >= 0"):
        RedisBackend.from_url("redis://127.0.0.1:1/0?replicas=-1")
    with pytest.raises(ConfigurationError, match="bad value 'two' for option 'replicas'"):
        RedisBackend.from_url("redis://127.0.0.1:1/0?replicas=two")
    with pytest.raises(ConfigurationError, match=r"replicas_timeout .* below socket_timeout"):
        RedisBackend.from_url("redis://127.0.0.1:1/0?replicas=1&replicas_timeout=5")
    with pytest.raises(ConfigurationError, match=r"replicas_timeout .* not 0.0"):
        RedisBackend.from_url("redis+cluster://127.0.0.1:1?replicas=1&replicas_timeout=0")
    with pytest.raises(ConfigurationError, match=r"replicas_timeout means nothing without"):
        RedisBackend.from_url("redis://127.0.0.1:1/0?replicas_timeout=2")


@pytest.fixture
def pair() -> Iterator[Pair]:
    folder = Path(tempfile.mkdtemp(prefix="dlock-pair-"))  # short: unix socket paths
    made = Pair(folder)
    yield made
    made.stop()
    shutil.rmtree(folder, ignore_errors=True)


def test_a_release_returns_once_the_replica_has_it(pair: Pair) -> None:
    key = "job:pair:kept"
    backend = RedisBackend.from_url(pair.url("replicas=1"))
    lease = backend.try_acquire(key, Holder.current(task_name="shop.charge"), 30)
    assert lease is not None
    # A success of a named task is kept (for once) by the release itself.
    assert backend.release(lease, Outcome.SUCCEEDED, result={"charged": 42}) is not None
    # Read on the replica at once, no wait: the release returned once the replica had it.
    assert pair.cli("EXISTS", backend._layout.names(key).lock).strip() == "0"
    assert pair.cli("EXISTS", backend._layout.result(key, "shop.charge")).strip() == "1"
    backend.close()


def test_a_release_the_replica_has_not_confirmed_is_a_store_error_until_it_has(
    pair: Pair,
) -> None:
    key = "job:pair:stopped"
    confirmed = RedisBackend.from_url(pair.url("replicas=1&replicas_timeout=0.3&retries=0"))
    unconfirmed = RedisBackend.from_url(pair.url("retries=0"))
    me = Holder.current()
    lease, plain = confirmed.try_acquire(key, me, 30), unconfirmed.try_acquire(key + "0", me, 30)
    assert lease is not None and plain is not None
    # Another process, whose connection's last write (its own release) the replica has.
    again = RedisBackend.from_url(pair.url("replicas=1&replicas_timeout=0.3&retries=0"))
    earlier = again.try_acquire(key + "1", me, 30)
    assert earlier is not None and again.release(earlier, Outcome.SUCCEEDED) is not None
    replica = pair.processes[1]
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        # Without replicas=N a release returns once the primary has it, replica or not.
        assert unconfirmed.release(plain, Outcome.SUCCEEDED) is not None
        with pytest.raises(BackendError, match=r"0 of the 1 replicas .* within 0.3 s"):
            confirmed.release(lease, Outcome.SUCCEEDED)
        assert confirmed.get(key) is None  # done on the primary: only not yet safe
        # Tried again by that process: the lease is gone, so the release writes nothing.
        # WAIT's documented promise covers the connection's own writes (whose last the
        # replica has), so it writes before it waits. (The Redis 7.0 here waits for more,
        # every write the server made before the connection's last command: measured, a
        # WAIT on a connection that never wrote blocked while the replica was stopped. So
        # on it this test cannot tell the write from its absence.)
        with pytest.raises(BackendError, match="0 of the 1 replicas"):
            again.release(lease, Outcome.SUCCEEDED)
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    # Once the replica has caught up (it acknowledges within about a second of SIGCONT),
    # the try again finds the lease released before, and confirms that release.
    assert eventually(lambda: _release(again, lease), "the release is confirmed") == (None,)
    assert pair.cli("EXISTS", confirmed._layout.names(key).lock).strip() == "0"
    for backend in (confirmed, unconfirmed, again):
        backend.close()


def test_a_failover_brings_back_a_release_only_without_replicas(
    private_cluster: Cluster,
) -> None:
    """Two leases on one primary, released after its replica was cut off: one by a store
    without ``replicas`` (the release returns; the replica promoted holds the lease
    again, until its ttl: the known loss), one with ``replicas=1`` (the release is a
    store error; tried again after the failover, it releases the lease on the new primary)."""
    base = f"{private_cluster.url}?prefix=rw&restart_delay=0&retries=4"
    plain = RedisBackend.from_url(base)
    confirmed = RedisBackend.from_url(base + "&replicas=1&replicas_timeout=0.5")
    me = Holder.current()

    def primary(key: str) -> int:
        return private_cluster.primary_of(plain._layout.names(key).lock)

    keys = [f"job:wait:{n}" for n in range(40)]
    victim = primary(keys[0])
    lost_key, kept_key, synced_key = [key for key in keys if primary(key) == victim][:3]
    lost = plain.try_acquire(lost_key, me, 60)
    kept = confirmed.try_acquire(kept_key, me, 60)
    assert lost is not None and kept is not None
    # A release with replicas=1 returns once the replica has every write before it: the
    # two grants above (a WAIT on a connection that wrote nothing would not say so).
    synced = confirmed.try_acquire(synced_key, me, 60)
    assert synced is not None and confirmed.release(synced, Outcome.SUCCEEDED) is not None
    private_cluster.cut_replication(victim, private_cluster.replica_of(victim))
    assert plain.release(lost, Outcome.SUCCEEDED) is not None
    with pytest.raises(BackendError, match="0 of the 1 replicas"):
        confirmed.release(kept, Outcome.SUCCEEDED)
    private_cluster.fail_over(victim)
    # The known loss: a release the old primary acknowledged is gone with it.
    held = eventually(lambda: _read(plain, lost_key), "the promoted replica answers")
    assert held[0] is not None and held[0].token == lost.token
    # The release that was never confirmed is tried again until it is: it released the
    # lease on the new primary (that try, or one before it whose confirmation failed).
    eventually(lambda: _release(confirmed, kept), "the release is confirmed")
    assert confirmed.get(kept_key) is None
    ended = [r for r in confirmed.history(key=kept_key) if r.lease.token == kept.token]
    assert [r.outcome for r in ended] == [Outcome.SUCCEEDED]
    plain.close()
    confirmed.close()


def _read(backend: RedisBackend, key: str) -> tuple[Lease | None] | None:
    try:
        return (backend.get(key),)
    except BackendError:
        return None


def _release(backend: RedisBackend, lease: Lease) -> tuple[object] | None:
    try:
        return (backend.release(lease, Outcome.SUCCEEDED),)
    except BackendError:
        return None


def test_a_kept_or_forgotten_success_and_a_record_wait_for_the_replica_too(pair: Pair) -> None:
    """Every call that ends or remembers waits: ``remember`` (a success kept after its
    lease was lost), ``add_record`` (a ``once`` replay, a skipped run), ``forget_success``."""
    key = "job:pair:success"
    backend = RedisBackend.from_url(pair.url("replicas=1&replicas_timeout=0.3&retries=0"))
    lease = backend.try_acquire(key, Holder.current(task_name="shop.charge"), 30)
    assert lease is not None
    record = Record(lease, time.time(), Outcome.SUCCEEDED, None, None, {"charged": 42})
    replay = Record(dataclasses.replace(lease, fence=0), time.time(), Outcome.SKIPPED)
    replica = pair.processes[1]
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        with pytest.raises(BackendError, match=r"redis remember of .* 0 of the 1 replicas"):
            backend.remember(record)
        with pytest.raises(BackendError, match=r"redis add_record of .* 0 of the 1 replicas"):
            backend.add_record(replay)
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    result = backend._layout.result(key, "shop.charge")
    assert eventually(lambda: pair.cli("EXISTS", result).strip() == "1" or None, "kept")
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        with pytest.raises(BackendError, match=r"redis forget of .* 0 of the 1 replicas"):
            backend.forget_success(key, "shop.charge", lease.token)
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    assert backend.last_success(key, "shop.charge") is None  # forgotten on the primary
    backend.close()


def test_the_doctor_counts_the_replicas_that_replicas_waits_for(pair: Pair) -> None:
    found = {}
    for wanted in (0, 1, 2):
        backend = RedisBackend.from_url(pair.url(f"replicas={wanted}"))
        found[wanted] = {check.name: check for check in backend.diagnose()}["replicas"]
        backend.close()
    assert found[0].ok and "1 connected; replicas=0" in found[0].detail
    assert "replicas=1 waits for them" in found[0].detail
    assert found[1].ok and "this primary has 1 connected" in found[1].detail
    assert not found[2].ok and "every release fails until enough are back" in found[2].detail
