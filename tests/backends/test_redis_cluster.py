"""The Redis store on a Redis Cluster beyond the contract suite (which runs on a shared
cluster): the URL form, and a primary SIGKILLed while it holds leases. Its replica takes
over; each lease on it is then either kept (its holder renews it) or lost (the renewal
says so), never both: a second client gets the key only where it was lost, with a higher
fence, and a fenced resource refuses the stale holder's write."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from celery_dlock import BackendError, ConfigurationError, Holder, Lease, Outcome
from celery_dlock.backends.redis import RedisBackend
from tests.support import eventually
from tests.support.redis_cluster import Cluster

pytest.importorskip("redis")


def test_the_cluster_url_names_its_nodes_and_refuses_a_database() -> None:
    backend = RedisBackend.from_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001?prefix=x")
    assert backend.url == "redis+cluster://:***@10.0.0.1:7000,10.0.0.2:7001?prefix=x"
    assert backend._layout.buckets == 16  # history and index over 16 slots by default
    with pytest.raises(ConfigurationError, match="database 0 only"):
        RedisBackend.from_url("redis+cluster://10.0.0.1:7000/3")
    with pytest.raises(ConfigurationError, match="host:port,host:port"):
        RedisBackend.from_url("redis+cluster://10.0.0.1,10.0.0.2")


class Ledger:
    """A resource that keeps the highest fence it accepted and refuses lower ones."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def write(self, key: str, fence: int) -> bool:
        if fence < self.last.get(key, 0):
            return False
        self.last[key] = fence
        return True


def test_a_primary_killed_mid_run_fails_over_and_fences_refuse_the_stale_holders(
    private_cluster: Cluster,
) -> None:
    url = f"{private_cluster.url}?prefix=fo&restart_delay=0&retries=4"
    first, second = RedisBackend.from_url(url), RedisBackend.from_url(url)
    me, other = Holder.current(), Holder.current()
    keys = [f"job:failover:{n}" for n in range(40)]
    leases = {key: first.try_acquire(key, me, 30) for key in keys}
    assert all(lease is not None for lease in leases.values())
    ledger = Ledger()
    for key, lease in leases.items():
        assert lease is not None and ledger.write(key, lease.fence)

    def slot_owner(key: str) -> int:
        return private_cluster.primary_of(first._layout.names(key).lock)

    victim = slot_owner(keys[0])
    replica = private_cluster.replica_of(victim)
    late_keys = [f"job:late:{n}" for n in range(40)]
    keys += late_keys
    on_victim = [key for key in keys if slot_owner(key) == victim]
    private_cluster.cut_replication(victim, replica)
    for key in late_keys:
        leases[key] = lease = first.try_acquire(key, me, 30)
        assert lease is not None and ledger.write(key, lease.fence)
    _fail_over(private_cluster, victim, lambda: slot_owner(keys[0]))

    kept = lost = 0
    for key in keys:
        lease = leases[key]
        assert lease is not None
        renewed = eventually(lambda lease=lease: _renew(first, lease), "renewal answers")
        taken = second.try_acquire(key, other, 30)
        if renewed[0] is not None:  # the store still honours the lease: nobody else gets it
            kept += 1
            assert taken is None
        else:  # lost with its primary: another may take the key, with a higher fence
            assert key in on_victim
            lost += 1
            assert taken is not None and taken.fence > lease.fence
            assert ledger.write(key, taken.fence)
            assert not ledger.write(key, lease.fence)  # the stale holder is refused
    assert kept + lost == len(keys) and kept >= len(keys) - len(on_victim)
    assert lost > 0  # the late leases on the killed primary: the refusal above happened
    print(f"\n{len(on_victim)} of {len(keys)} leases on the killed primary: {lost} lost, "
          f"{kept} kept")  # fmt: skip
    first.close()
    second.close()


def _renew(backend: RedisBackend, lease: object) -> tuple[object] | None:
    """``(renew's answer,)``, or None while the cluster still fails over."""
    try:
        return (backend.renew(lease, 30),)  # type: ignore[arg-type]
    except BackendError:
        return None


def test_a_key_granted_again_after_a_failover_gets_a_fence_above_the_lost_leases(
    private_cluster: Cluster,
) -> None:
    """A key whose state the replica has (taken and released before), taken again on the
    primary just before it dies: the replica that takes over lacks that grant, so its
    counter is one behind. The next grant must still have a higher fence than the lost
    lease's (it once had the same one: +1 on the replica's counter)."""
    url = f"{private_cluster.url}?prefix=fr&restart_delay=0&retries=4"
    # replicas=1: each release below returns once the replica has it, and what came before
    first, second = RedisBackend.from_url(f"{url}&replicas=1"), RedisBackend.from_url(url)
    me, other = Holder.current(), Holder.current()

    def slot_owner(key: str) -> int:
        return private_cluster.primary_of(first._layout.names(key).lock)

    victim = slot_owner("job:again:0")
    replica = private_cluster.replica_of(victim)
    keys = [key for key in (f"job:again:{n}" for n in range(60)) if slot_owner(key) == victim]
    for key in keys:  # each key's state, replicated
        for _ in range(3):
            lease = first.try_acquire(key, me, 30)
            assert lease is not None and first.release(lease, Outcome.SUCCEEDED) is not None
    private_cluster.cut_replication(victim, replica)
    lost = {key: first.try_acquire(key, me, 30) for key in keys}
    _fail_over(private_cluster, victim, lambda: slot_owner(keys[0]))
    for key, lease in lost.items():
        assert lease is not None
        taken = eventually(lambda key=key: _try(second, key, other), "the key is granted")
        assert taken.fence > lease.fence, (key, lease.fence, taken.fence)
    first.close()
    second.close()


def _fail_over(cluster: Cluster, victim: int, owner: Callable[[], int]) -> None:
    """SIGKILL the primary on ``victim`` and wait until another serves its slots."""
    cluster.kill(victim)
    cluster.ports.remove(victim)  # ask the survivors from now on
    eventually(lambda: owner() not in (victim, 0), "a replica takes over", timeout=30)


def _try(backend: RedisBackend, key: str, holder: Holder) -> Lease | None:
    """A lease on ``key``, or None while the cluster still fails over or the key is held."""
    try:
        return backend.try_acquire(key, holder, 30)
    except BackendError:
        return None
