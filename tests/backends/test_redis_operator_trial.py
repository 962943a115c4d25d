"""The Redis store as an operator runs it: URLs with awkward passwords, a slot of a Redis
Cluster migrated while a lease is held, a crash of a Redis that snapshots (RDB). Each test that
needs a server starts its own (a private ``redis-server`` or cluster) and stops it; the
shared server on 6379 is never touched."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_dlock import BackendError, ConfigurationError, Holder, Lease, Outcome
from celery_dlock.backends import backend_from_url

pytest.importorskip("redis")

from celery_dlock.backends.redis import RedisBackend
from tests.support import eventually
from tests.support.countingproxy import CountingProxy
from tests.support.redis_cluster import Cluster, start_cluster
from tests.support.redis_server import RedisServer, private_redis

# -- URLs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pa#ss-word@cache:6379/0",
        "redis://:pa?ss-word@cache:6379/0",
        "redis://:pa/ss-word@cache:6379/0",
        "redis://dlock:12#ss-word@cache:6379/0",
        "redis://:12/ss-word@cache:6379/0",
        "rediss://:pa#ss-word@cache:6379/0",
        "redis+cluster://:pa#ss-word@cache:7000,cache:7001",
    ],
)
def test_a_password_with_an_unescaped_hash_query_or_slash_is_refused_and_never_shown(
    url: str,
) -> None:
    # A generated password often holds '#', '?' or '/': unescaped, they end the URL's
    # authority early, so the password is no longer where masking looks for it (and with
    # digits before the '#', the URL was a valid one to another host, without password).
    with pytest.raises(ConfigurationError) as raised:
        backend_from_url(url)
    assert "ss-word" not in str(raised.value)
    assert "percent-encode" in str(raised.value)


def test_a_percent_encoded_password_and_option_still_parse() -> None:
    backend = backend_from_url("rediss://:pa%23ss@cache:6379/0?ssl_ca_certs=/etc/ca%40x.pem")
    assert isinstance(backend, RedisBackend)
    assert backend.url == "rediss://:***@cache:6379/0?ssl_ca_certs=/etc/ca%40x.pem"
    connection = backend._client.connection
    assert (connection["password"], connection["ssl_ca_certs"]) == ("pa#ss", "/etc/ca@x.pem")


# -- a cluster slot migrating under a held lease -------------------------------------------


@pytest.fixture(scope="module")
def private_cluster() -> Iterator[Cluster]:
    cluster = start_cluster()
    yield cluster
    cluster.stop()


class Migration:
    """A slot moved by hand, as ``redis-cli --cluster reshard`` moves it: importing on the
    target, migrating on the source, every key ``MIGRATE``d, then the slot given to the
    target on every primary."""

    def __init__(self, cluster: Cluster, tag: str) -> None:
        self.cluster = cluster
        self.slot = cluster.cli(cluster.ports[0], "CLUSTER", "KEYSLOT", tag).strip()
        self.source = cluster.primary_of(tag.encode())
        self.target = next(p for p in cluster.primaries() if p != self.source)
        self.ids = {p: cluster.cli(p, "CLUSTER", "MYID").strip() for p in cluster.primaries()}

    def move_keys(self) -> None:
        cli, slot = self.cluster.cli, self.slot
        assert cli(self.target, "CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[self.source])
        assert cli(self.source, "CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[self.target])
        keys = cli(self.source, "CLUSTER", "GETKEYSINSLOT", slot, "1000").split()
        assert keys
        moved = cli(self.source, "MIGRATE", "127.0.0.1", str(self.target), "", "0", "5000",
                    "KEYS", *keys)  # fmt: skip
        assert moved.strip() == "OK"

    def finish(self) -> None:
        for port in [self.target, self.source, *self.ids]:
            self.cluster.cli(port, "CLUSTER", "SETSLOT", self.slot, "NODE", self.ids[self.target])


def test_a_redis_url_to_a_cluster_node_names_the_cluster_url_in_its_errors(
    private_cluster: Cluster,
) -> None:
    # redis:// to one node: the keys of the slots it owns work, the others get MOVED.
    url = f"redis://127.0.0.1:{private_cluster.ports[0]}/0?prefix=node&buckets=16&restart_delay=0"
    backend = backend_from_url(url)
    me = Holder.current()
    errors = []
    for n in range(40):
        try:
            backend.try_acquire(f"job:node:{n}", me, 10)
        except BackendError as exc:
            errors.append(str(exc))
    assert errors
    assert all("use redis+cluster://" in error for error in errors)
    backend.close()


def test_a_lease_whose_slot_is_migrating_is_read_refused_cleanly_then_released(
    private_cluster: Cluster,
) -> None:
    backend = RedisBackend.from_url(f"{private_cluster.url}?prefix=mig&buckets=1&restart_delay=0")
    me = Holder.current()
    lease = backend.try_acquire("job:migrating", me, 60)
    assert lease is not None
    migration = Migration(private_cluster, "{mig}")
    migration.move_keys()

    # Every key is on the target now, which the source names with ASK: a read follows it,
    # loading the script there (the target never ran it: NOSCRIPT after ASKING).
    seen = backend.get("job:migrating")
    assert seen is not None and seen.token == lease.token
    # A script that would create a key in the slot gets TRYAGAIN until the slot is moved:
    # a BackendError, which Lock and the Celery layer handle (fail closed, retry later).
    with pytest.raises(BackendError, match="TryAgain"):
        backend.release(lease, Outcome.SUCCEEDED)
    with pytest.raises(BackendError, match="TryAgain"):
        backend.try_acquire("job:elsewhere", me, 60)

    migration.finish()
    record = backend.release(lease, Outcome.SUCCEEDED)
    assert record is not None and record.lease.token == lease.token
    again = backend.try_acquire("job:migrating", me, 60)
    assert again is not None and again.fence > lease.fence
    assert [r.lease.token for r in backend.history(key="job:migrating")] == [lease.token]
    backend.close()


def test_commands_sent_together_to_a_migrating_slot_each_follow_the_ask(
    private_cluster: Cluster,
) -> None:
    """``ASKING`` admits only the command after it: a release pipelined with the write of
    its bucket's ``synced`` key and a ``WAIT`` (``replicas=N``) sends each after one."""
    backend = RedisBackend.from_url(f"{private_cluster.url}?prefix=ask&restart_delay=0")
    wire = backend._client.connections()
    key = b"{ask}:probe"
    assert wire.send_all_at(key, [b"*3\r\n$3\r\nSET\r\n$11\r\n{ask}:probe\r\n$1\r\n0\r\n"])
    migration = Migration(private_cluster, "{ask}")
    migration.move_keys()
    try:
        sets = [b"*3\r\n$3\r\nSET\r\n$11\r\n{ask}:probe\r\n$1\r\n%d\r\n" % n for n in (1, 2)]
        get = b"*2\r\n$3\r\nGET\r\n$11\r\n{ask}:probe\r\n"
        # The key is on the target now: the source answers the first command with ASK.
        assert wire.send_all_at(key, [*sets, get]) == [b"OK", b"OK", b"2"]
    finally:
        migration.finish()
    backend.close()


# -- many leases ---------------------------------------------------------------------------------


@pytest.fixture
def private_server() -> Iterator[RedisServer]:
    with private_redis("dlock-many-") as server:
        yield server


def test_listing_many_leases_takes_a_round_trip_per_batch_not_per_lease(
    private_server: RedisServer,
) -> None:
    with CountingProxy("127.0.0.1", private_server.port) as proxy:
        url = private_server.url("many").replace(f":{private_server.port}/", f":{proxy.port}/")
        backend = backend_from_url(url)
        me = Holder.current()
        keys = [f"job:many:{n:04}" for n in range(300)]
        assert all(backend.try_acquire(key, me, 60) is not None for key in keys)
        assert backend.get(keys[0]) is not None  # loads the script that reads a lease
        proxy.reset()
        assert [lease.key for lease in backend.leases("job:many:")] == keys
        assert proxy.round_trips <= 3  # the index, then the leases in one batch
        backend.close()


def test_the_history_of_a_rare_key_in_a_busy_namespace_is_read_without_the_others(
    private_server: RedisServer,
) -> None:
    with CountingProxy("127.0.0.1", private_server.port) as proxy:
        url = private_server.url("busy").replace(f":{private_server.port}/", f":{proxy.port}/")
        backend = backend_from_url(url)
        me = Holder.current()
        rare = backend.try_acquire("job:nightly", me, 60)
        assert rare is not None and backend.release(rare, Outcome.SUCCEEDED) is not None
        for n in range(3000):
            lease = backend.try_acquire(f"job:busy:{n % 50}", me, 60)
            assert lease is not None and backend.release(lease, Outcome.SUCCEEDED) is not None
        proxy.reset()
        assert [r.lease.token for r in backend.history(key="job:nightly")] == [rare.token]
        # The filter runs in Redis: the other 3,000 records (about 900 KB) stay there.
        assert proxy.replied_bytes < 2000
        busy = backend.history(key="job:busy:7", outcome=Outcome.SUCCEEDED, limit=None)
        assert len(busy) == 60 and {r.lease.key for r in busy} == {"job:busy:7"}
        backend.close()


# -- a restart from an RDB snapshot ----------------------------------------------------------


@pytest.fixture
def snapshotting_server() -> Iterator[RedisServer]:
    """A private server that loads ``dump.rdb`` from its directory when it starts, as a
    default Redis install does (``save`` points, no AOF); SIGKILLed to restart."""
    with private_redis("dlock-rdb-", "--dbfilename", "dump.rdb") as server:
        yield server


def _snapshot_then_crash(server: RedisServer, url: str) -> tuple[RedisBackend, Lease]:
    """A lease taken after the last snapshot, then a crash: Redis comes back with the
    snapshot, the epoch key in it."""
    seed = backend_from_url(server.url("rdb"))  # restart_delay 0: sets the epoch now
    first = seed.try_acquire("job:seed", Holder.current(), 60)
    assert first is not None and seed.release(first, Outcome.SUCCEEDED) is not None
    holding = backend_from_url(url)
    assert isinstance(holding, RedisBackend)
    client = server.client()
    assert client.save()
    client.close()
    # (A process new to a server younger than restart_delay may wait that out first.)
    lost = eventually(lambda: holding.try_acquire("job:lost", Holder.current(), 60), "a lease")
    server.restart()
    seed.close()
    return holding, lost


def test_after_a_restart_from_a_snapshot_no_lost_key_is_granted_for_restart_delay(
    snapshotting_server: RedisServer,
) -> None:
    url = snapshotting_server.url("rdb", restart_delay=5)
    holding, lost = _snapshot_then_crash(snapshotting_server, url)
    other = backend_from_url(url)
    # The README: "without [persistence] a restart loses locks and history, and no lock is
    # granted for restart_delay (30 s) so lost holders notice". (5 s here: well above the
    # time from the restart to the next call on a loaded machine.)
    assert other.try_acquire("job:lost", Holder.current(), 60) is None
    assert holding.renew(lost, 60) is None
    holding.close()
    other.close()


def test_a_restarted_redis_that_kept_its_data_grants_nothing_for_restart_delay(
    snapshotting_server: RedisServer,
) -> None:
    # The snapshot holds the server this bucket was granted on (noted by the first acquire):
    # the lease taken after it is gone, and a key never used before is not granted either,
    # until restart_delay from the start has passed; then with a higher fence.
    url = snapshotting_server.url("noted", restart_delay=3)
    holding = backend_from_url(url)
    me = Holder.current()
    first = eventually(lambda: holding.try_acquire("job:first", me, 60), "a lease")
    assert holding.release(first, Outcome.SUCCEEDED) is not None
    client = snapshotting_server.client()
    assert client.save()
    lost = holding.try_acquire("job:lost", me, 60)
    assert lost is not None
    snapshotting_server.restart()
    client = snapshotting_server.client()
    assert client.get("{noted}:server") is not None  # noted before the snapshot
    other = backend_from_url(url)
    assert other.try_acquire("job:lost", me, 60) is None
    assert other.try_acquire("job:never-used", me, 60) is None
    assert 0 < client.pttl("{noted}:quarantine") <= 3000
    assert holding.renew(lost, 60) is None
    again = eventually(lambda: other.try_acquire("job:lost", me, 60), "the quarantine ends")
    assert again.fence > lost.fence
    holding.close()
    other.close()
    client.close()


def test_a_save_without_a_restart_grants_at_once(snapshotting_server: RedisServer) -> None:
    # LASTSAVE changes at each save: the server is looked at again, found the same, noted.
    url = snapshotting_server.url("saves", restart_delay=3)
    backend = backend_from_url(url)
    me = Holder.current()
    first = eventually(lambda: backend.try_acquire("job:a", me, 60), "a lease")
    client = snapshotting_server.client()
    for n in range(3):
        seen = client.get("{saves}:server")
        # LASTSAVE counts whole seconds: a save in the second of the last note would leave
        # it as it was (it failed so in CI). Each save here comes in a second of its own,
        # as LASTSAVE shows it (a save just after TIME's new second once still had the old).
        noted = client.lastsave()
        eventually(
            lambda noted=noted: client.save() and client.lastsave() > noted,
            "a save in a new second",
        )
        lease = backend.try_acquire(f"job:b{n}", me, 60)
        assert lease is not None
        assert client.get("{saves}:server") != seen or seen.startswith(b"0 ")
    assert client.exists("{saves}:quarantine") == 0
    assert backend.release(first, Outcome.SUCCEEDED) is not None
    backend.close()
    client.close()


def test_a_promoted_replica_grants_nothing_for_restart_delay_whatever_its_age(
    snapshotting_server: RedisServer,
) -> None:
    # The primary's grants replicate asynchronously: the last ones may be missing on the
    # replica. Promoted, it holds back every grant of the bucket for restart_delay from now
    # (not from its own start, a second or more ago).
    primary_url = snapshotting_server.url("fo", restart_delay=3)
    primary = backend_from_url(primary_url)
    me = Holder.current()
    first = eventually(lambda: primary.try_acquire("job:fo", me, 60), "a lease")
    directory = Path(tempfile.mkdtemp(prefix="dlock-promoted-"))
    replica = RedisServer(directory, "--replicaof", "127.0.0.1", str(snapshotting_server.port))
    try:
        replica.start()
        replica_client = replica.client()
        eventually(lambda: replica_client.get("{fo}:server"), "the replica has the server")
        eventually(
            lambda: int(replica_client.info("server")["uptime_in_seconds"]) >= 1,
            "the replica a second old",
        )
        assert replica_client.replicaof("NO", "ONE")
        promoted = backend_from_url(replica.url("fo", restart_delay=3))
        assert promoted.try_acquire("job:other", me, 60) is None
        assert replica_client.pttl("{fo}:quarantine") > 2000  # not 3000 - 1000 * its age
        assert primary.release(first, Outcome.SUCCEEDED) is not None
        promoted.close()
        replica_client.close()
    finally:
        replica.stop()
        shutil.rmtree(directory, ignore_errors=True)
        primary.close()


def test_the_doctor_says_what_a_crash_of_a_snapshotting_redis_does(
    snapshotting_server: RedisServer,
) -> None:
    backend = backend_from_url(snapshotting_server.url("doctor"))
    persistence = {check.name: check for check in backend.diagnose()}["persistence"]
    # Not "a restart loses locks": a crash brings back the last snapshot, with its epoch.
    assert "no AOF" in persistence.detail
    assert "snapshot" in persistence.detail and "released since are held again" in (
        persistence.detail
    )
    backend.close()


def test_a_url_to_a_replica_grants_nothing_and_the_doctor_says_to_use_the_primary(
    private_server: RedisServer,
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="dlock-replica-"))
    replica = RedisServer(directory, "--replicaof", "127.0.0.1", str(private_server.port))
    try:
        replica.start()
        backend = backend_from_url(replica.url("replica"))
        with pytest.raises(BackendError, match="ReadOnly"):
            backend.try_acquire("job:replica", Holder.current(), 10)
        role = {check.name: check for check in backend.diagnose()}["role"]
        assert not role.ok
        assert "point the URL at the primary" in role.detail
        backend.close()
    finally:
        replica.stop()
        shutil.rmtree(directory, ignore_errors=True)
