"""The layout's marker (``{prefix}:layout``, ``buckets=N``) across real losses of Redis's
data, as an operator meets them: a private ``redis-server`` restarted without persistence,
processes with another ``buckets`` arriving before or after the old ones, the asyncio
client, several threads, a claim lost on the network, and a private Redis Cluster whose
nodes lose their data. Two processes with different ``buckets`` must never both grant one
lock. The shared server on 6379 is never touched.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_dlock import BackendError, ConfigurationError, Holder, Lease, Outcome
from celery_dlock.backends import backend_from_url

redis = pytest.importorskip("redis")

from celery_dlock.backends.redis import RedisBackend  # noqa: E402
from celery_dlock.backends.redis.layout import Layout  # noqa: E402
from tests.backends.test_redis import acquire  # noqa: E402
from tests.support import eventually  # noqa: E402
from tests.support.countingproxy import CountingProxy  # noqa: E402
from tests.support.redis_cluster import Cluster, start_cluster  # noqa: E402
from tests.support.redis_server import RedisServer, private_redis  # noqa: E402

PREFIX = "lay"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with private_redis("dlock-layout-") as private:
        yield private


def open_backend(url: str) -> RedisBackend:
    backend = backend_from_url(url)
    assert isinstance(backend, RedisBackend)
    return backend


def me() -> Holder:
    return Holder.current()


def close(backend: RedisBackend, loop: asyncio.AbstractEventLoop) -> None:
    """Close ``backend``, and its asyncio connections on ``loop`` if it made any."""
    store = backend._async
    if store is not None:

        async def close_loop() -> None:
            await store._connections().aclose()

        loop.run_until_complete(close_loop())
    backend.close()


def held(server: RedisServer, buckets: int, key: str) -> bool:
    """Whether ``key`` is locked under the split into ``buckets``."""
    client = server.client()
    try:
        return bool(client.exists(Layout(PREFIX, buckets).names(key).lock))
    finally:
        client.close()


def marker(server: RedisServer) -> Any:
    client = server.client()
    try:
        return client.get(Layout(PREFIX).marker)
    finally:
        client.close()


def key_in_another_bucket(buckets: int, than: str) -> str:
    """A key whose bucket under ``buckets`` differs from that of ``than``."""
    layout = Layout(PREFIX, buckets)
    return next(
        f"job:order:{n}"
        for n in range(100)
        if layout.bucket(f"job:order:{n}") != layout.bucket(than)
    )


# -- a private server restarted without persistence --------------------------------------


@pytest.mark.parametrize("delay", [0, 1])
def test_after_a_restart_the_old_split_claimed_first_refuses_the_new_one(
    server: RedisServer, delay: int
) -> None:
    old = open_backend(server.url(PREFIX, restart_delay=delay))
    eventually(lambda: old.try_acquire("job:a", me(), 60), "a first lease")
    server.restart()
    old.try_acquire("job:b", me(), 60)  # the loss met: the marker claimed again
    assert marker(server) == b"buckets=1"
    new = open_backend(server.url(PREFIX, buckets=4, restart_delay=delay))
    with pytest.raises(ConfigurationError, match="buckets=1"):
        new.try_acquire("job:b", me(), 60)
    assert not held(server, 4, "job:b")
    old.close()
    new.close()


@pytest.mark.parametrize("delay", [0, 1])
def test_after_a_restart_the_new_split_claimed_first_refuses_the_old_one(
    server: RedisServer, delay: int
) -> None:
    old = open_backend(server.url(PREFIX, restart_delay=delay))
    before = eventually(lambda: old.try_acquire("job:z", me(), 60), "a first lease")
    server.restart()
    new = open_backend(server.url(PREFIX, buckets=4, restart_delay=delay))
    lease = eventually(lambda: new.try_acquire("job:a", me(), 60), "the new split's lease")
    with pytest.raises(ConfigurationError, match="buckets=4"):
        old.try_acquire("job:a", me(), 60)
    assert not held(server, 1, "job:a")
    assert new.release(lease, Outcome.SUCCEEDED) is not None
    with pytest.raises(ConfigurationError, match="buckets=4"):
        old.try_acquire("job:c", me(), 60)  # every acquire after
    assert old.renew(before, 60) is None and old.release(before, Outcome.LOST) is None
    old.close()
    new.close()


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("api", ["threads", "asyncio"])
def test_a_process_that_never_acquired_before_the_restart_is_refused_after_it(
    server: RedisServer, api: str, delay: int, loop: asyncio.AbstractEventLoop
) -> None:
    """A process that only read (or released, renewed) before the loss saw no epoch: its
    first acquire on the new data cannot tell a loss from a first use. It must claim all
    the same: a process with another split may have claimed the lost marker meanwhile."""
    old = open_backend(server.url(PREFIX, restart_delay=delay))
    assert old.get("job:a") is None  # connected: its claim, buckets=1
    if api == "asyncio":
        store = old.async_store()
        assert store is not None
        assert loop.run_until_complete(store.get("job:a")) is None
    server.restart()
    new = open_backend(server.url(PREFIX, buckets=4, restart_delay=delay))
    eventually(lambda: new.try_acquire("job:a", me(), 60), "the new split's lease")
    assert marker(server) == b"buckets=4"
    with pytest.raises(ConfigurationError, match="buckets=4"):
        acquire(old, api, "job:a", loop)
    assert not held(server, 1, "job:a")
    close(old, loop)
    new.close()


def test_a_bucket_first_met_after_the_restart_is_claimed_for_too(server: RedisServer) -> None:
    """The epoch is per bucket: a process that saw only some of its buckets before the loss
    meets the others' new epochs as first sights."""
    old = open_backend(server.url(PREFIX, buckets=4))
    assert old.try_acquire("job:a", me(), 60) is not None
    server.restart()
    new = open_backend(server.url(PREFIX))
    other = key_in_another_bucket(4, "job:a")
    assert new.try_acquire(other, me(), 60) is not None
    with pytest.raises(ConfigurationError, match="buckets=1"):
        old.try_acquire(other, me(), 60)
    assert not held(server, 4, other)
    old.close()
    new.close()


@pytest.mark.parametrize("delay", [0, 1])
def test_threads_that_meet_the_loss_at_once_all_refuse_and_hold_nothing(
    server: RedisServer, delay: int
) -> None:
    old = open_backend(server.url(PREFIX, restart_delay=delay))
    keys = [f"job:t{n}" for n in range(8)]
    for key in keys:
        lease = eventually(lambda key=key: old.try_acquire(key, me(), 60), "a first lease")
        assert old.release(lease, Outcome.SUCCEEDED) is not None
    server.restart()
    new = open_backend(server.url(PREFIX, buckets=4, restart_delay=0))
    assert new.try_acquire("job:new", me(), 60) is not None
    outcomes: list[object] = []
    start = threading.Barrier(len(keys))

    def attempt(key: str) -> None:
        start.wait()
        try:
            outcomes.append(old.try_acquire(key, me(), 60))
        except Exception as exc:  # the type is the finding
            outcomes.append(exc)

    threads = [threading.Thread(target=attempt, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(isinstance(o, ConfigurationError) for o in outcomes), outcomes
    assert not any(held(server, 1, key) for key in keys)
    old.close()
    new.close()


@pytest.mark.parametrize("api", ["threads", "asyncio"])
def test_a_claim_lost_on_the_network_is_sent_again_and_its_grant_released(
    server: RedisServer, api: str, loop: asyncio.AbstractEventLoop
) -> None:
    """The acquire that met the loss granted its lease (``restart_delay=0``); the claim
    after it met a network failure. The caller gets a BackendError and holds nothing, so
    the lease must not stay for its ttl; the doubt stays, and the next acquire claims."""
    with CountingProxy("127.0.0.1", server.port) as proxy:
        old = open_backend(f"redis://127.0.0.1:{proxy.port}/0?prefix={PREFIX}&restart_delay=0")
        assert acquire(old, api, "job:a", loop) is not None
        server.restart()
        acquire(old, api, "job:warm", loop)  # reconnects, meets the loss, claims again
        assert old.calls.lost_data is False
        read = old.calls.acquired

        def cut_after_the_reply(*args: Any) -> Lease | None:
            lease = read(*args)
            if old.calls.lost_data:
                proxy.refuse()  # the claim, sent next, meets the outage
            return lease

        old.calls.acquired = cut_after_the_reply  # type: ignore[method-assign]
        client = server.client()
        client.flushall()  # lost again: the next acquire meets a new epoch
        client.close()
        with pytest.raises(BackendError):
            acquire(old, api, "job:b", loop)  # granted (no quarantine), the claim lost
        old.calls.acquired = read  # type: ignore[method-assign]
        proxy.accept()
        assert old.calls.lost_data  # the doubt stays
        assert held(server, 1, "job:b")
        new = open_backend(server.url(PREFIX, buckets=4))
        assert new.try_acquire("job:c", me(), 60) is not None
        with pytest.raises(ConfigurationError, match="buckets=4"):
            acquire(old, api, "job:c", loop)
        assert not held(server, 1, "job:b")  # released once Redis answered
        assert not held(server, 1, "job:c")
        close(old, loop)
        new.close()


def test_a_refused_process_acquires_again_once_the_operator_fixed_the_marker(
    server: RedisServer,
) -> None:
    """Refused after a loss because a process with another split claimed the marker; the
    operator stops that process and deletes the marker (the documented way out). The old
    process, which had the right split, must not stay refused until it is restarted: a
    process refused at its first claim is not."""
    old = open_backend(server.url(PREFIX))
    assert old.try_acquire("job:a", me(), 60) is not None
    server.restart()
    new = open_backend(server.url(PREFIX, buckets=4))
    assert new.try_acquire("job:b", me(), 60) is not None
    with pytest.raises(ConfigurationError):
        old.try_acquire("job:c", me(), 60)
    new.close()
    client = server.client()
    client.flushall()  # the wrong split's leases gone with it, as after its stop
    client.close()
    assert old.try_acquire("job:c", me(), 60) is not None
    assert marker(server) == b"buckets=1"
    old.close()


# -- a private cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def private_cluster() -> Iterator[Cluster]:
    cluster = start_cluster()
    yield cluster
    cluster.stop()


def cluster_url(cluster: Cluster, prefix: str, **options: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"prefix": prefix, **options}.items())
    return f"{cluster.url}?{query}"


def node_of(cluster: Cluster, tag: str) -> int:
    return cluster.primary_of(tag.encode())


def test_a_cluster_node_losing_only_some_buckets_keeps_the_new_split_out(
    private_cluster: Cluster,
) -> None:
    prefix = f"lc{time.monotonic_ns()}"
    marker_node = node_of(private_cluster, "{" + prefix + "}")
    old = open_backend(cluster_url(private_cluster, prefix, restart_delay=0))
    layout = Layout(prefix, 16)
    keys = [f"job:{n}" for n in range(200)]
    lost = next(
        k
        for k in keys
        if node_of(private_cluster, f"{{{prefix}:{layout.bucket(k)}}}") != marker_node
    )
    victim = node_of(private_cluster, f"{{{prefix}:{layout.bucket(lost)}}}")
    assert old.try_acquire(lost, me(), 60) is not None
    private_cluster.cli(victim, "FLUSHALL")
    assert old.try_acquire(lost, me(), 60) is not None  # the loss met, claimed again: same
    new = open_backend(cluster_url(private_cluster, prefix, buckets=4, restart_delay=0))
    with pytest.raises(ConfigurationError, match="buckets=16"):
        new.try_acquire(lost, me(), 60)
    old.close()
    new.close()


def lose(cluster: Cluster, node: int, loss: str) -> None:
    """The data of the primary on ``node`` lost: flushed, or failed over to an empty replica."""
    if loss == "flush":
        cluster.cli(node, "FLUSHALL")
        return
    replica = cluster.replica_of(node)
    cluster.cli(replica, "CONFIG", "SET", "replica-read-only", "no")
    cluster.cli(replica, "FLUSHALL")  # an empty replica
    cluster.cli(replica, "CONFIG", "SET", "replica-read-only", "yes")
    assert cluster.cli(replica, "DBSIZE").strip() == "0"
    cluster.fail_over(node)


def old_split_keeps(old: RedisBackend, new: RedisBackend, key: str) -> None:
    """After the newcomer ``new`` was refused, the old split still grants ``key``; both
    are closed."""
    ours = old.try_acquire(key, me(), 60)
    assert ours is not None, "the old split's lock"
    assert old.release(ours, Outcome.SUCCEEDED) is not None
    old.close()
    new.close()


@pytest.mark.parametrize("loss", ["flush", "failover"])
def test_a_cluster_node_losing_the_marker_keeps_the_new_split_out_by_its_buckets_markers(
    private_cluster: Cluster, loss: str
) -> None:
    """With buckets > 1 the marker's slot, ``{prefix}``, is no bucket's: a node that loses
    the marker (flushed, or failed over to an empty replica) shows the old processes no new
    epoch on the buckets that other nodes serve. The slots of 16 buckets keep a marker
    each: a process started since with another split finds the old count there and is
    refused, and the old split keeps its lock (before, the new split granted the key that
    the old one also granted)."""
    prefix = f"lm{time.monotonic_ns()}"
    marker_node = node_of(private_cluster, "{" + prefix + "}")
    old = open_backend(cluster_url(private_cluster, prefix, restart_delay=1))
    old16, new4 = Layout(prefix, 16), Layout(prefix, 4)
    key = next(
        k
        for k in (f"job:{n}" for n in range(500))
        if node_of(private_cluster, f"{{{prefix}:{old16.bucket(k)}}}") != marker_node
        and node_of(private_cluster, f"{{{prefix}:{new4.bucket(k)}}}") != marker_node
        # a key both splits name alike (bucket 0-3 of 16) is one lock whatever the split
        and old16.bucket(k) != new4.bucket(k)
    )
    lease = eventually(lambda: old.try_acquire(key, me(), 60), "a first lease")
    assert old.release(lease, Outcome.SUCCEEDED) is not None
    lose(private_cluster, marker_node, loss)
    new = open_backend(cluster_url(private_cluster, prefix, buckets=4, restart_delay=1))
    where = re.escape(f"({{{prefix}:") + r"\d+\}:layout\)"  # a bucket's marker that survived
    with pytest.raises(ConfigurationError, match=f"split as buckets=16 by another process {where}"):
        new.try_acquire(key, me(), 60)
    node = node_of(private_cluster, f"{{{prefix}:{new4.bucket(key)}}}")
    assert private_cluster.cli(node, "EXISTS", new4.names(key).lock.decode()).strip() == "0"
    old_split_keeps(old, new, key)


def test_a_cluster_node_losing_every_marker_of_the_new_split_lets_no_two_splits_hold_a_lock(
    private_cluster: Cluster,
) -> None:
    """One node held the marker and the slots of both buckets of a newcomer's split (2),
    and lost them; the old split's (16) bucket of the key lives on another node and shows
    no loss. The newcomer still finds the old count in the slots of the buckets beyond its
    own (each process marks those of any split up to 16), and is refused (with markers in
    its own buckets' slots only, it found none and granted the key the old split grants)."""
    owner = private_cluster.owners()
    prefix = ""
    for n in range(1000):  # a namespace whose marker and 2 buckets' slots share a node
        prefix = f"la{n}x{time.monotonic_ns()}"
        nodes = {owner("{" + prefix + "}")} | {owner(f"{{{prefix}:{b}}}") for b in range(2)}
        if len(nodes) == 1:  # about 1 in 9 (CRC-16 spreads 4 or more buckets on 3 nodes)
            break
    else:
        pytest.fail("no namespace with the marker and 2 buckets on one node in 1,000")
    [victim] = nodes
    old16, new2 = Layout(prefix, 16), Layout(prefix, 2)
    key = next(
        k
        for k in (f"job:{n}" for n in range(500))
        if owner(f"{{{prefix}:{old16.bucket(k)}}}") != victim and old16.bucket(k) > 1
    )
    assert owner(f"{{{prefix}:{new2.bucket(key)}}}") == victim
    old = open_backend(cluster_url(private_cluster, prefix, restart_delay=1))
    lease = eventually(lambda: old.try_acquire(key, me(), 60), "a first lease")
    assert old.release(lease, Outcome.SUCCEEDED) is not None
    private_cluster.cli(victim, "FLUSHALL")
    new = open_backend(cluster_url(private_cluster, prefix, buckets=2, restart_delay=0))
    with pytest.raises(ConfigurationError, match="split as buckets=16 by another process"):
        new.try_acquire(key, me(), 60)
    old_split_keeps(old, new, key)


def test_on_a_cluster_every_process_marks_the_slots_of_16_buckets_and_its_own(
    private_cluster: Cluster,
) -> None:
    """The markers a process claims on a cluster: ``{prefix}:layout`` and
    ``{prefix:<n>}:layout`` for n below 16, or below its own ``buckets`` if more; each
    holds its count."""
    for buckets, spread in [(1, 16), (4, 16), (20, 20)]:
        prefix = f"lk{buckets}x{time.monotonic_ns()}"
        backend = open_backend(cluster_url(private_cluster, prefix, buckets=buckets))
        assert backend.get("job:a") is None  # connected: claimed
        names = ["{" + prefix + "}", *(f"{{{prefix}:{n}}}" for n in range(spread + 2))]
        found = [
            private_cluster.cli(node_of(private_cluster, tag), "GET", f"{tag}:layout").strip()
            for tag in names
        ]
        assert found == [f"buckets={buckets}"] * (spread + 1) + ["", ""], buckets
        backend.close()


def test_on_a_cluster_a_process_sends_its_claims_in_one_round_trip_per_node(
    private_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 17 claims of a process's first connection (``{prefix}:layout`` and 16 buckets'
    markers) go to their primaries as one batch per node, not one round trip each (17)."""
    from celery_dlock.backends.redis.client import Connections

    batches: list[tuple[int, int]] = []  # (port, claims) of each batch with a claim
    send_all = Connections.send_all

    def counted(self: Connections, commands: list[bytes]) -> list[Any]:
        claims = sum(b":layout\r\n" in command for command in commands)
        if claims:
            port = self._make.keywords["port"]  # type: ignore[attr-defined]
            batches.append((port, claims))
        return send_all(self, commands)

    monkeypatch.setattr(Connections, "send_all", counted)
    prefix = f"lr{time.monotonic_ns()}"
    owner = private_cluster.owners()
    tags = ["{" + prefix + "}", *(f"{{{prefix}:{n}}}" for n in range(16))]
    backend = open_backend(cluster_url(private_cluster, prefix, buckets=4))
    try:
        assert backend.get("job:a") is None  # connected: claimed
    finally:
        backend.close()
    serving = {owner(tag) for tag in tags}
    assert sorted(port for port, _ in batches) == sorted(serving)
    assert sum(claims for _, claims in batches) == len(tags)
    for tag in tags:
        got = private_cluster.cli(owner(tag), "GET", f"{tag}:layout").strip()
        assert got == "buckets=4", tag
