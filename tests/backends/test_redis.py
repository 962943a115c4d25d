"""Redis backend promises beyond the contract, on the shared Redis (DB 1, a key prefix of
its own per test): URLs and options, one hash slot per lock, round trips, ambiguous
replies, the capped history and the kept results, reaping by index, processes and crashes.

Tests that restart Redis, use a unix socket or flush scripts run a private server:
``test_redis_server.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from celery_dlock import (
    AsyncLock,
    BackendError,
    ConfigurationError,
    Holder,
    Lease,
    Lock,
    Outcome,
    Record,
)
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.base import AsyncStore
from tests.backends.test_contract import KEYS
from tests.support import eventually, force_release

redis = pytest.importorskip("redis")

from celery_dlock.backends.redis import RedisBackend  # noqa: E402
from celery_dlock.backends.redis.layout import Layout  # noqa: E402
from tests.backends.stores.redis import URL, delete_prefix, store_url  # noqa: E402
from tests.support.countingproxy import CountingProxy  # noqa: E402
from tests.support.services import redis_client  # noqa: E402

_prefixes = itertools.count()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A namespace of our own on the shared Redis, deleted afterwards."""
    redis_client(URL).close()
    name = f"tr{os.getpid()}-{next(_prefixes)}"
    yield name
    delete_prefix(URL, name)


@pytest.fixture
def raw() -> Iterator[Any]:
    client = redis.Redis.from_url(URL)
    yield client
    client.close()


def open_backend(prefix: str, base: str = URL, **options: object) -> RedisBackend:
    backend = backend_from_url(store_url(prefix, base, **options))
    assert isinstance(backend, RedisBackend)
    return backend


@pytest.fixture
def backend(prefix: str) -> Iterator[RedisBackend]:
    backend = open_backend(prefix)
    yield backend
    backend.close()


def holder(task_name: str | None = None) -> Holder:
    return Holder.current(task_name=task_name)


# -- URLs and options (no I/O: from_url never connects) --------------------------------------


def test_url_forms_build_the_connection_they_name() -> None:
    tcp = RedisBackend.from_url("redis://:s3cret@cache.example:6380/3?prefix=jobs")
    assert tcp._client.connection["host"] == "cache.example"
    assert tcp._client.connection["port"] == 6380
    assert tcp._client.connection["db"] == 3
    assert tcp._client.connection["password"] == "s3cret"
    assert "s3cret" not in tcp.url and "***" in tcp.url
    assert tcp._layout.prefix == "jobs"

    tls = RedisBackend.from_url("rediss://u:p@cache.example/0?ssl_cert_reqs=none&retries=0")
    assert tls._client.connection["ssl"] is True
    assert tls._client.connection["ssl_cert_reqs"] == "none"
    assert tls._client.connection["username"] == "u"
    assert tls._client.retries == 0

    unix = RedisBackend.from_url("unix:///run/redis/redis.sock?db=2&history_maxlen=50")
    assert unix._client.connection["unix_socket_path"] == "/run/redis/redis.sock"
    assert unix._client.connection["db"] == 2
    assert unix.calls.common[0] == "50"

    default = RedisBackend.from_url("redis://localhost")
    assert default._client.connection["port"] == 6379 and default._client.connection["db"] == 0
    assert default._layout.prefix == "dlock"


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("redis://localhost/0?prefx=jobs", "prefx"),
        ("redis://localhost/0?ssl_ca_certs=/ca.pem", "rediss://"),
        ("redis://localhost/abc", "db number"),
        ("redis://localhost/1?db=2", "db twice"),
        ("redis://localhost:99999/0", "bad port"),
        ("redis://localhost/0?prefix=a{b}", "braces"),
        ("redis://localhost/0?buckets=0", "buckets"),
        ("redis://localhost/0?history_maxlen=0", "history_maxlen"),
        ("redis://localhost/0?success_ttl=0", "success_ttl"),
        ("redis://localhost/0?restart_delay=-1", "restart_delay"),
        ("redis://localhost/0?retries=x", "retries"),
        # found by trying: 0 was taken, then every call failed "Resource temporarily unavailable"
        ("redis://localhost/0?socket_timeout=0", "socket_timeout"),
        ("redis+cluster://localhost:7000?socket_connect_timeout=0", "socket_connect_timeout"),
        ("unix://", "unix:///path"),
        ("unix://host/sock", "unix:///path"),
    ],
)
def test_a_bad_url_gets_an_error_that_names_the_problem(url: str, names: str) -> None:
    with pytest.raises(ConfigurationError, match=names.replace("?", r"\?")):
        backend_from_url(url)


# -- one hash slot per lock ----------------------------------------------------------------------


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the hash of Redis Cluster (cluster-spec), written out here."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def slot(name: bytes) -> int:
    """The cluster slot of a key name: the hash tag's CRC16 (first '{' to the next '}')."""
    start = name.find(b"{")
    if start >= 0:
        end = name.find(b"}", start + 1)
        if end > start + 1:
            name = name[start + 1 : end]
    return crc16(name) % 16384


def test_the_slot_function_is_redis_clusters() -> None:
    assert crc16(b"123456789") == 0x31C3  # the spec's check value
    for name in (b"foo", b"{user1000}.following", b"a{}b", b"{}{x}", b"job:\xc3\xbc{}"):
        assert slot(name) == redis.crc.key_slot(name)


@pytest.mark.parametrize("buckets", [1, 4])
def test_every_key_of_a_lock_and_what_it_writes_share_one_slot(
    buckets: int, prefix: str, raw: Any
) -> None:
    layout = Layout(prefix, buckets)
    keys = [*KEYS, "job:{x}", "job:}{", "{job}:x", "job:{", "job:}", "job::{}:"]
    slots_used = set()
    for key in keys:
        names = layout.names(key)
        all_names = [*names[:7], layout.result(key, "tasks.{odd}:name")]
        slots = {slot(name) for name in all_names}
        assert len(slots) == 1, (key, all_names)
        assert slots == {slot(layout.index(layout.bucket(key)))}
        slots_used |= slots
    assert len(slots_used) == buckets
    # And in Redis: every key the backend wrote for a lock with braces in it.
    backend = open_backend(prefix, buckets=buckets)
    lease = backend.try_acquire("job:{x}:}", holder("t"), 60)
    assert lease is not None
    backend.release(lease, Outcome.SUCCEEDED, result=1)
    # (the namespace's layout marker, claimed once per process, is the prefix's own: on a
    # single Redis the only one, see test_redis_layout_trial for a cluster's)
    assert layout.markers == (layout.marker,)
    assert raw.get(layout.marker) == b"buckets=%d" % buckets
    written = [name for name in raw.scan_iter(match=f"{{{prefix}*") if name != layout.marker]
    assert len(written) >= 4  # state, index, history, epoch, result...
    assert len({slot(name) for name in written}) == 1
    backend.close()


@pytest.mark.parametrize("api", ["threads", "asyncio"])
def test_processes_that_split_a_namespace_differently_are_refused(
    prefix: str, raw: Any, api: str
) -> None:
    """Two processes whose URLs differ in ``buckets`` name one lock by two keys: both held
    ``job:order:1`` (a rolling deploy that changed it broke exclusion and lost every
    ``once`` memory). The second to come refuses to work, naming both counts."""
    first = open_backend(prefix)
    lease = first.try_acquire("job:order:1", holder(), 60)
    assert lease is not None
    assert raw.get(Layout(prefix).marker) == b"buckets=1"
    other = open_backend(prefix, buckets=4)
    with pytest.raises(ConfigurationError) as refused:
        if api == "threads":
            other.try_acquire("job:order:1", holder(), 60)
        else:
            store = other.async_store()
            assert store is not None
            asyncio.run(store.try_acquire("job:order:1", holder(), 60))
    assert "buckets=1" in str(refused.value) and "buckets=4" in str(refused.value)
    held = first.get("job:order:1")
    assert held is not None and held.token == lease.token  # the one lease there is
    same = open_backend(prefix)  # the same split: works
    assert same.try_acquire("job:order:1", holder(), 60) is None
    for backend in (first, other, same):
        backend.close()


def acquire(
    backend: RedisBackend, api: str, key: str, loop: asyncio.AbstractEventLoop
) -> Lease | None:
    """``try_acquire`` through the blocking client, or the asyncio one on ``loop``."""
    if api == "threads":
        return backend.try_acquire(key, holder(), 60)
    store = backend.async_store()
    assert store is not None
    return loop.run_until_complete(store.try_acquire(key, holder(), 60))


@pytest.mark.parametrize("api", ["threads", "asyncio"])
def test_a_process_that_saw_the_data_lost_is_refused_by_a_split_claimed_since(
    prefix: str, raw: Any, api: str, loop: asyncio.AbstractEventLoop
) -> None:
    """Redis lost its data, the layout's marker with it; a process started since with
    another ``buckets`` claimed it. A process that claimed before the loss must not grant
    on the new data under its own split: both would hold one lock. It claims again when it
    meets the new epoch (its quarantine grants nothing meanwhile), and is refused."""
    old = open_backend(prefix, restart_delay=5)
    assert acquire(old, api, "job:order:1", loop) is not None  # the epoch is seen
    delete_prefix(URL, prefix)  # what FLUSHDB or a restart without persistence does to it
    new = open_backend(prefix, buckets=4, restart_delay=0)  # grants at once, however new
    assert new.try_acquire("job:order:2", holder(), 60) is not None  # its claim: buckets=4
    assert raw.get(Layout(prefix).marker) == b"buckets=4"
    with pytest.raises(ConfigurationError, match="buckets=4"):
        acquire(old, api, "job:order:2", loop)  # the loss met: quarantined, and claimed again
    with pytest.raises(ConfigurationError, match="buckets=4"):
        acquire(old, api, "job:order:3", loop)  # and every acquire after it
    assert raw.get(Layout(prefix).marker) == b"buckets=4"
    for backend in (old, new):
        backend.close()


@pytest.mark.parametrize("api", ["threads", "asyncio"])
def test_a_process_that_saw_the_data_lost_claims_its_split_again_first(
    prefix: str, raw: Any, api: str, loop: asyncio.AbstractEventLoop
) -> None:
    """The same loss, met by the old process before a process with another split comes:
    its claim is back, and the newcomer is refused."""
    old = open_backend(prefix, restart_delay=5)
    assert acquire(old, api, "job:order:1", loop) is not None
    delete_prefix(URL, prefix)
    assert acquire(old, api, "job:order:2", loop) is None  # quarantined, and claimed again
    assert raw.get(Layout(prefix).marker) == b"buckets=1"
    new = open_backend(prefix, buckets=4, restart_delay=5)
    with pytest.raises(ConfigurationError, match="buckets=1"):
        new.try_acquire("job:order:2", holder(), 60)
    for backend in (old, new):
        backend.close()


def test_a_grant_that_met_the_loss_is_released_when_the_claim_is_refused(
    prefix: str, raw: Any
) -> None:
    """With ``restart_delay=0`` no quarantine holds the grant back: the reply that tells
    of the loss grants the lease. Refused by the new split, the process releases it."""
    old = open_backend(prefix, restart_delay=0)
    assert old.try_acquire("job:order:1", holder(), 60) is not None
    delete_prefix(URL, prefix)
    new = open_backend(prefix, buckets=4, restart_delay=0)
    assert new.try_acquire("job:order:9", holder(), 60) is not None
    with pytest.raises(ConfigurationError, match="buckets=4"):
        old.try_acquire("job:order:2", holder(), 60)
    assert raw.get(Layout(prefix).names("job:order:2").lock) is None  # not held
    [record] = old.history(key="job:order:2")
    assert record.outcome is Outcome.FAILED and record.problem is not None
    assert record.problem.endswith("ConfigurationError")
    for backend in (old, new):
        backend.close()


# -- round trips ---------------------------------------------------------------------------------


SERVER = urlsplit(URL)


def via(proxy: CountingProxy) -> str:
    """The store's URL, through ``proxy``."""
    return f"redis://127.0.0.1:{proxy.port}{SERVER.path}"


@pytest.fixture
def proxy() -> Iterator[CountingProxy]:
    with CountingProxy(SERVER.hostname or "127.0.0.1", SERVER.port or 6379) as counting:
        yield counting


def test_acquire_release_and_renew_take_one_round_trip_each(
    proxy: CountingProxy, prefix: str
) -> None:
    backend = open_backend(prefix, via(proxy))
    me = holder()
    warm = backend.try_acquire("job:warm", me, 10)  # connects, loads the scripts
    assert warm is not None
    warm = backend.renew(warm, 10)  # (a server whose script cache is empty answers NOSCRIPT)
    assert warm is not None
    backend.release(warm, Outcome.SUCCEEDED)

    proxy.reset()
    lease = backend.try_acquire("job:rt", me, 10)
    assert lease is not None
    assert proxy.round_trips == 1
    proxy.reset()
    assert backend.try_acquire("job:rt", me, 10) is None
    assert proxy.round_trips == 1
    proxy.reset()
    renewed = backend.renew(lease, 20)
    assert renewed is not None
    assert proxy.round_trips == 1
    proxy.reset()
    record = backend.release(renewed, Outcome.SUCCEEDED, result={"kept": True})
    assert record is not None
    assert proxy.round_trips == 1
    backend.close()


#: Small enough to cross the counting proxy in one burst (a larger pipeline is answered
#: while its tail is still on the way, which the proxy would count as more round trips).
BATCH = 10


def load_reap_scripts(prefix: str) -> None:
    """Load the reap's scripts on the server, by a reap of one expired lease of namespace
    ``prefix`` (scripts are the server's): after a ``SCRIPT FLUSH``, a counted reap would
    send each script again after its ``NOSCRIPT``."""
    warm = open_backend(prefix)
    assert warm.try_acquire("job:warm", holder(), 0.05) is not None
    time.sleep(0.2)  # expired on Redis's clock
    assert len(warm.reap(limit=10)) == 1
    warm.close()


@pytest.mark.exclusive  # SCRIPT FLUSH on the shared server: others would meet NOSCRIPT
def test_reap_clears_a_batch_of_expired_leases_in_two_round_trips(
    proxy: CountingProxy, prefix: str, raw: Any
) -> None:
    load_reap_scripts(f"{prefix}-warm")
    backend = open_backend(prefix, via(proxy))
    me = holder()

    def expired_batch(name: str) -> set[str]:
        keys = {f"job:reap:{name}:{n}" for n in range(BATCH)}
        assert all(backend.try_acquire(key, me, 0.05) is not None for key in keys)
        time.sleep(0.2)  # all expired on Redis's clock
        proxy.reset()
        return keys

    keys = expired_batch("a")
    reaped = backend.reap(limit=100)
    assert sorted(r.key for r in reaped) == sorted(keys)
    assert {r.outcome for r in reaped} == {Outcome.EXPIRED}
    # The due list, then the whole batch: 2, not one per lease (a loaded machine may split
    # the batch's pipeline into two bursts at the proxy, which counts them as two).
    assert proxy.round_trips < BATCH // 2
    keys = expired_batch("b")
    raw.execute_command("SCRIPT", "FLUSH")  # the batch meets NOSCRIPT: loaded, run again
    again = backend.reap(limit=100)
    assert sorted(r.key for r in again) == sorted(keys)  # each record returned, none lost
    assert {r.outcome for r in again} == {Outcome.EXPIRED}
    assert backend.reap(limit=100) == []  # each lease recorded once
    assert len(backend.history(outcome=Outcome.EXPIRED, limit=None)) == 2 * BATCH
    backend.close()


def test_a_release_refused_while_redis_was_unreachable_lands_at_the_next_release(
    proxy: CountingProxy, prefix: str
) -> None:
    backend = open_backend(prefix, via(proxy), retries=0)
    lock = Lock(backend, "job:outage", ttl=60, renew=False)
    lease = lock.acquire()
    proxy.refuse()  # an outage: the release cannot reach Redis
    with pytest.raises(BackendError):
        lock.release(Outcome.FAILED, "Boom", "the sync failed")
    proxy.accept()
    assert backend.get("job:outage") is not None  # still held: nothing released it
    with Lock(backend, "job:next", ttl=60):  # this process's next release...
        pass
    assert backend.get("job:outage") is None  # ...released the earlier one, by its token
    [record] = backend.history(key="job:outage")
    assert record.lease.token == lease.token
    assert (record.outcome, record.problem) == (Outcome.FAILED, "Boom")  # its own outcome
    with Lock(backend, "job:next", ttl=60):
        pass
    assert len(backend.history(key="job:outage")) == 1  # settled once
    backend.close()


_REFUSED_THEN_EXIT = """
import sys
from celery_dlock import BackendError, Lock, Outcome, backend_from_url
lock = Lock(backend_from_url(sys.argv[1]), "job:exit-outage", ttl=60, renew=False)
lease = lock.acquire()
print(lease.token, flush=True)
sys.stdin.readline()  # the store is unreachable now
try:
    lock.release(Outcome.FAILED, "Boom", "the sync failed")
except BackendError:
    print("refused", flush=True)
sys.stdin.readline()  # the store is back: end normally, with no further release
"""


def test_a_release_refused_until_the_process_ends_lands_as_it_exits(
    proxy: CountingProxy, prefix: str
) -> None:
    url = store_url(prefix, via(proxy), retries=0)
    command = [sys.executable, "-c", _REFUSED_THEN_EXIT, url]
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        token = child.stdout.readline().strip()
        proxy.refuse()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "refused"
        proxy.accept()
        child.stdin.write("exit\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    backend = open_backend(prefix)
    assert backend.get("job:exit-outage") is None  # released at exit, not left to its ttl
    [record] = backend.history(key="job:exit-outage")
    assert record.lease.token == token
    assert (record.outcome, record.problem) == (Outcome.FAILED, "Boom")  # its own outcome
    backend.close()


def test_an_async_release_refused_while_redis_was_unreachable_lands_at_the_next_one(
    proxy: CountingProxy, prefix: str
) -> None:
    backend = open_backend(prefix, via(proxy), retries=0)

    async def scenario() -> Lease:
        lock = AsyncLock(backend, "job:aio-outage", ttl=60, renew=False)
        lease = await lock.acquire()
        proxy.refuse()
        with pytest.raises(BackendError):
            await lock.release(Outcome.FAILED, "Boom", "the sync failed")
        proxy.accept()
        async with AsyncLock(backend, "job:aio-next", ttl=60):  # its native client
            pass
        return lease

    lease = asyncio.run(scenario())
    assert backend.async_store() is not None
    assert backend.get("job:aio-outage") is None
    [record] = backend.history(key="job:aio-outage")
    assert (record.lease.token, record.outcome) == (lease.token, Outcome.FAILED)
    backend.close()


def test_wait_is_one_push_not_a_poll(proxy: CountingProxy, prefix: str) -> None:
    backend = open_backend(prefix, via(proxy))
    other = open_backend(prefix)
    lease = other.try_acquire("job:push", holder(), None)
    assert lease is not None
    backend.wait("job:free", 1.0)  # connects and loads the probe
    proxy.reset()
    backend.wait("job:push", 0.5)  # held throughout: look once, block once
    assert proxy.round_trips == 2

    returned = threading.Event()
    thread = threading.Thread(target=lambda: (backend.wait("job:push", 30), returned.set()))
    thread.start()
    eventually(lambda: our_waiters(other), "the waiter blocks in BLPOP")
    other.release(lease, Outcome.SUCCEEDED)
    assert returned.wait(10)
    thread.join()
    backend.close()
    other.close()


# -- replies that never come -----------------------------------------------------------------------


@pytest.fixture
def lossy() -> Iterator[CountingProxy]:
    with CountingProxy(SERVER.hostname or "127.0.0.1", SERVER.port or 6379) as proxy:
        yield proxy


def our_waiters(backend: RedisBackend) -> int | None:
    """How many of our connections to this database are blocked in BLPOP (None if none)."""
    listing = backend._client.command("test", "CLIENT", "LIST", "TYPE", "normal").decode()
    db = f"db={int(SERVER.path.strip('/') or 0)}"
    waiting = [
        line
        for line in listing.splitlines()
        if "name=celery-dlock" in line and f" {db} " in line and "cmd=blpop" in line
    ]
    return len(waiting) or None


def load_scripts(backend: RedisBackend, key: str = "job:warm") -> None:
    """Open a connection and load the acquire and release scripts, by a lease of ``key``
    (another test may have sent ``SCRIPT FLUSH``: a lost ``NOSCRIPT`` would be no lost
    call)."""
    warm = backend.try_acquire(key, holder(), None)
    assert warm is not None and backend.release(warm, Outcome.SUCCEEDED) is not None


async def load_scripts_async(store: AsyncStore, key: str = "job:warm") -> None:
    """``load_scripts`` on this event loop's connections, through the asyncio client."""
    warm = await store.try_acquire(key, holder(), None)
    assert warm is not None and await store.release(warm, Outcome.SUCCEEDED) is not None


def acquire_losing_its_reply(
    backend: RedisBackend, lossy: CountingProxy, client: str, key: str, ttl: float | None
) -> Lease | None:
    """``try_acquire`` through the blocking client or the asyncio one, on a connection
    already open (its handshake done) and its scripts loaded (another test may have sent
    ``SCRIPT FLUSH``: a lost ``NOSCRIPT`` would be no lost acquire), the reply to its first
    try lost."""
    if client == "blocking":
        load_scripts(backend)
        lossy.drop_next_reply()
        return backend.try_acquire(key, holder(), ttl)
    store = backend.async_store()
    assert store is not None

    async def acquire() -> Lease | None:  # connections are the loop's: one loop for all
        await load_scripts_async(store)
        lossy.drop_next_reply()
        return await store.try_acquire(key, holder(), ttl)

    return asyncio.run(acquire())


CLIENTS = pytest.mark.parametrize("client", ["blocking", "asyncio"])


@CLIENTS
def test_an_acquire_whose_reply_was_lost_is_read_back_as_ours(
    lossy: CountingProxy, prefix: str, client: str
) -> None:
    backend = open_backend(prefix, via(lossy))
    check = open_backend(prefix)
    lease = acquire_losing_its_reply(backend, lossy, client, "job:lost-reply", None)
    assert lossy.dropped == 1  # the reply was lost
    assert lease is not None  # the retry found the lease its first attempt made
    held = check.get("job:lost-reply")
    assert held == lease
    record = backend.release(lease, Outcome.SUCCEEDED)
    assert record is not None
    assert [r.lease.token for r in check.history(key="job:lost-reply")] == [lease.token]
    backend.close()
    check.close()


@CLIENTS
def test_a_retried_acquire_whose_first_lease_expired_takes_a_new_token(
    lossy: CountingProxy, prefix: str, client: str
) -> None:
    # The first try lands, its reply is lost, and its 1 ms lease expires before the retry
    # (25-50 ms later): that lease is recorded expired under its token, and the retry's
    # lease, a new acquisition, has a token of its own (found by the partition torture: one
    # token recorded both 'expired' and 'succeeded').
    backend = open_backend(prefix, via(lossy))
    check = open_backend(prefix)
    lease = acquire_losing_its_reply(backend, lossy, client, "job:expired-try", 0.001)
    assert lossy.dropped == 1
    assert lease is not None
    [first] = check.history(key="job:expired-try")
    assert first.outcome is Outcome.EXPIRED and first.lease.token != lease.token
    assert first.lease.fence < lease.fence
    # The retry's own 1 ms lease ends too, released or expired (recorded by the release
    # that finds it gone): one record under its own token.
    released = backend.release(lease, Outcome.SUCCEEDED)
    _, second = check.history(key="job:expired-try")[::-1]
    assert second.lease.token == lease.token and second.lease.fence == lease.fence
    assert second.outcome is (Outcome.EXPIRED if released is None else Outcome.SUCCEEDED)
    backend.close()
    check.close()


def test_a_release_whose_reply_was_lost_returns_its_record_once(
    lossy: CountingProxy, prefix: str
) -> None:
    backend = open_backend(prefix, via(lossy))
    lease = backend.try_acquire("job:lost-release", holder(), None)
    assert lease is not None
    lossy.drop_next_reply()
    record = backend.release(lease, Outcome.FAILED, "ValueError", "boom")
    assert lossy.dropped == 1
    assert record is not None and record.outcome is Outcome.FAILED
    assert backend.history(key="job:lost-release") == [record]
    assert backend.release(lease, Outcome.FAILED) is None  # a second call is not a retry
    backend.close()


@CLIENTS
def test_a_release_whose_reply_was_lost_while_the_key_changed_hands_returns_its_record(
    lossy: CountingProxy, prefix: str, client: str
) -> None:
    # The release lands and its reply is lost; before the retry, another holder takes the
    # key and releases it. The retry still finds the first release's record, so nothing
    # records the lease 'lost' beside its 'succeeded'.
    backend = open_backend(prefix, via(lossy))
    check = open_backend(prefix)
    others: list[Lease] = []

    def next_holder() -> None:
        other = check.try_acquire("job:handed", holder(), None)
        assert other is not None and check.release(other, Outcome.SUCCEEDED) is not None
        others.append(other)

    async def in_one_loop() -> tuple[Lease, Record | None]:
        store = backend.async_store()
        assert store is not None
        await load_scripts_async(store, "job:handed")
        lease = await store.try_acquire("job:handed", holder(), None)
        assert lease is not None
        lossy.drop_next_reply(then=next_holder)
        return lease, await store.release(lease, Outcome.SUCCEEDED)

    if client == "blocking":
        load_scripts(backend, "job:handed")
        lease = backend.try_acquire("job:handed", holder(), None)
        assert lease is not None
        lossy.drop_next_reply(then=next_holder)
        record = backend.release(lease, Outcome.SUCCEEDED)
    else:
        lease, record = asyncio.run(in_one_loop())
    assert lossy.dropped == 1 and len(others) == 1
    assert record is not None and record.lease.token == lease.token
    assert record.outcome is Outcome.SUCCEEDED
    found = [(r.lease.token, r.outcome) for r in check.history(key="job:handed")]
    assert found[:2] == [(others[0].token, Outcome.SUCCEEDED), (lease.token, Outcome.SUCCEEDED)]
    assert len(found) == 3
    backend.close()
    check.close()


def test_an_acquire_lost_beyond_retries_leaves_no_orphan(lossy: CountingProxy, prefix: str) -> None:
    backend = open_backend(prefix, via(lossy), retries=0)
    check = open_backend(prefix)
    load_scripts(backend)
    lossy.drop_next_reply()
    with pytest.raises(BackendError) as raised:
        backend.try_acquire("job:orphan", holder(), None)
    assert isinstance(raised.value.__cause__, redis.ConnectionError)
    orphan = check.get("job:orphan")
    assert orphan is not None  # it did land: ours, though nobody knows it yet
    again = backend.try_acquire("job:orphan", holder(), None)  # Redis answers again
    assert again is not None and again.fence > orphan.fence
    [record] = check.history(key="job:orphan")
    assert record.lease.token == orphan.token and record.outcome is Outcome.DISCONNECTED
    backend.close()
    check.close()


@CLIENTS
def test_an_acquire_failing_while_an_orphan_is_settled_names_its_own_key(
    lossy: CountingProxy, prefix: str, client: str
) -> None:
    # An acquire first releases the orphans of acquires whose reply was lost; with the store
    # still down, the error is this acquire's, not that release's of another key.
    backend = open_backend(prefix, via(lossy), retries=0)
    if client == "blocking":
        with pytest.raises(BackendError):
            acquire_losing_its_reply(backend, lossy, client, "job:orphan", None)
        lossy.refuse()
        with pytest.raises(BackendError) as raised:
            backend.try_acquire("job:next", holder(), None)
    else:
        store = backend.async_store()
        assert store is not None

        async def both() -> pytest.ExceptionInfo[BackendError]:  # one loop: its connections
            await load_scripts_async(store)
            lossy.drop_next_reply()
            with pytest.raises(BackendError):
                await store.try_acquire("job:orphan", holder(), None)
            lossy.refuse()
            with pytest.raises(BackendError) as raised:
                await store.try_acquire("job:next", holder(), None)
            return raised

        raised = asyncio.run(both())
    assert "'job:next'" in str(raised.value) and "job:orphan" not in str(raised.value)
    lossy.accept()
    backend.close()


class Interrupt(BaseException):
    """Raised between a command's send and its read, as a Celery soft time limit can be."""


def test_an_exception_between_send_and_read_leaves_no_stray_reply(backend: RedisBackend) -> None:
    lease = backend.try_acquire("job:interrupted", holder(), None)
    assert lease is not None
    [connection] = backend._client.connections()._idle
    read = connection.read_response

    def interrupted(*args: object, **kwargs: object) -> object:
        connection.read_response = read
        raise Interrupt

    connection.read_response = interrupted
    with pytest.raises(Interrupt):
        backend.get("job:interrupted")
    # The next commands read their own replies, not the one left unread.
    renewed = backend.renew(lease, 30)
    assert renewed is not None and renewed.expires_at is not None
    assert backend.try_acquire("job:other", holder(), None) is not None
    assert backend.get("job:interrupted") == renewed


# -- history and kept results -------------------------------------------------------------------


def test_the_history_stream_is_capped(prefix: str, raw: Any) -> None:
    backend = open_backend(prefix, history_maxlen=10)
    records = []
    for _ in range(300):
        lease = backend.try_acquire("job:cap", holder(), None)
        assert lease is not None
        records.append(backend.release(lease, Outcome.SUCCEEDED))
    length = raw.xlen(f"{{{prefix}}}:history")
    # MAXLEN ~ trims whole stream nodes (stream-node-max-entries, 100 by default).
    assert 10 <= length < 10 + 100
    assert backend.history(limit=3) == records[::-1][:3]
    backend.close()


def test_kept_results_expire_on_their_own_and_outlive_pruning(prefix: str, raw: Any) -> None:
    backend = open_backend(prefix, success_ttl=3600)
    lease = backend.try_acquire("job:once", holder("tasks.charge"), None)
    assert lease is not None
    success = backend.release(lease, Outcome.SUCCEEDED, result={"receipt": 7})
    assert success is not None
    kept = backend._layout.result("job:once", "tasks.charge")
    assert 0 < raw.pttl(kept) <= 3600 * 1000
    assert raw.pttl(f"{{{prefix}}}:history") == -1  # history is capped, not expired
    assert backend.prune_history(time.time() + 1) == 1
    assert backend.history(key="job:once") == []
    assert backend.last_success("job:once", "tasks.charge") == success
    backend.close()


def test_history_reads_back_every_stored_form(backend: RedisBackend) -> None:
    me = holder("tasks.odd")
    lease = backend.try_acquire("job:forms", me, 60)
    assert lease is not None and lease.expires_at is not None
    renewed = backend.renew(lease, 30)
    assert renewed is not None
    details = "\udcff lone surrogate, ünï, \x00 nul, 'quotes'"
    record = backend.release(renewed, Outcome.FAILED, "x.Err", details, [1, None, "z"])
    assert record is not None and record.lease == renewed
    assert backend.history(key="job:forms") == [record]
    assert backend.history(since=record.released_at) == [record]
    assert backend.history(since=record.released_at + 1e-6) == []


# -- reap ----------------------------------------------------------------------------------


def test_concurrent_reapers_record_each_expired_lease_once(prefix: str) -> None:
    backends = [open_backend(prefix) for _ in range(4)]
    leases = [backends[0].try_acquire(f"job:r{n}", holder(), 0.2) for n in range(6)]
    live = backends[0].try_acquire("job:live", holder(), None)
    assert all(leases) and live is not None
    eventually(lambda: backends[0].get("job:r5") is None or None, "expiry by Redis")
    reaped: list[list[Any]] = []
    threads = [threading.Thread(target=lambda b=b: reaped.append(b.reap())) for b in backends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tokens = sorted(record.lease.token for batch in reaped for record in batch)
    assert tokens == sorted(lease.token for lease in leases if lease is not None)
    history = backends[0].history(limit=None)
    assert sorted(record.lease.token for record in history) == tokens
    assert {record.outcome for record in history} == {Outcome.EXPIRED}
    assert backends[0].get("job:live") == live
    for backend in backends:
        backend.close()


# -- processes ---------------------------------------------------------------------------------


def test_a_forked_child_makes_its_own_connections(backend: RedisBackend) -> None:
    lease = backend.try_acquire("job:fork", holder(), None)
    assert lease is not None
    parent = backend._client.connections()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own connections; the parent's stay the parent's
        try:
            fresh = backend._client.connections() is not parent
            held = backend.get("job:fork") == lease
            taken = backend.try_acquire("job:fork-child", holder(), None) is not None
            os.write(write, json.dumps([fresh, held, taken]).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        assert json.loads(pipe.read()) == [True, True, True]
    assert backend._client.connections() is parent
    assert backend.get("job:fork") == lease  # the parent's connections still work
    assert backend.get("job:fork-child") is not None


HOLDER = textwrap.dedent(
    """
    import json, sys, time
    from celery_dlock import Lock
    from celery_dlock.records import Holder
    url, key, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    lock = Lock(url, key, ttl=ttl, holder=Holder.current(task_name="tests.renewing"))
    print(json.dumps(lock.acquire().to_dict()), flush=True)
    while True:
        time.sleep(60)
    """
)


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)


def kill(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait()
    if process.stdout is not None:
        process.stdout.close()


def test_a_sigkilled_holder_stops_renewing_and_another_process_takes_over(
    prefix: str, backend: RedisBackend
) -> None:
    from celery_dlock import Lease

    # ttl 2: renewals every 0.67 s, each with 2 s to land however loaded the machine.
    process = spawn(HOLDER, store_url(prefix), "job:renewing", "2.0")
    try:
        assert process.stdout is not None
        first = Lease.from_dict(json.loads(process.stdout.readline()))
        assert first.expires_at is not None
        # Alive: its renewal thread moves the expiry on, well past the first one (by more
        # than two renewals' worth).
        eventually(
            lambda: (
                (
                    (lease := backend.get("job:renewing")) is not None
                    and lease.expires_at is not None
                    and lease.expires_at > first.expires_at + 1.5
                )
                or None
            ),
            "renewals by the live holder",
        )
        assert backend.try_acquire("job:renewing", holder(), None) is None
    finally:
        kill(process)  # SIGKILL: the renewal thread dies with it
    new = eventually(lambda: backend.try_acquire("job:renewing", holder(), None), "takeover")
    assert new.fence > first.fence
    [record] = [r for r in backend.history(key="job:renewing") if r.lease.token == first.token]
    assert record.outcome is Outcome.EXPIRED
    assert record.lease.holder.pid == process.pid
    assert record.lease.expires_at is not None and record.lease.expires_at > first.expires_at


def test_an_expired_and_retaken_lease_is_dead_to_its_old_holder(prefix: str) -> None:
    old_holder, new_holder = open_backend(prefix), open_backend(prefix)
    old = old_holder.try_acquire("job:retaken", holder(), 0.3)
    assert old is not None
    new = eventually(lambda: new_holder.try_acquire("job:retaken", holder(), 30), "takeover")
    assert old_holder.renew(old, 30) is None
    assert old_holder.release(old, Outcome.SUCCEEDED) is None
    assert force_release(old_holder, "job:retaken", "x") is not None  # only by name, on purpose
    assert new_holder.release(new, Outcome.SUCCEEDED) is None
    outcomes = [(r.lease.token, r.outcome) for r in new_holder.history(key="job:retaken")]
    assert outcomes == [(new.token, Outcome.FORCED), (old.token, Outcome.EXPIRED)]
    old_holder.close()
    new_holder.close()


def test_with_restart_delay_0_a_key_without_state_still_waits_out_a_quarantine(
    prefix: str, raw: Any
) -> None:
    # restart_delay=0 turns off the guard this client would begin, not a quarantine that
    # another client (restart_delay > 0) began: a key without state is refused while it
    # stands. The acquire script tests it apart from its early check, which restart_delay=0
    # skips (the test is not dead code there).
    quarantine = Layout(prefix).names("job:new").quarantine
    unguarded = open_backend(prefix, restart_delay=0)
    first = unguarded.try_acquire("job:known", holder(), 30)
    assert first is not None  # the epoch is noted, and seen by this client
    assert unguarded.release(first, Outcome.SUCCEEDED) is not None
    raw.set(quarantine, "1", px=60_000)
    newcomer = open_backend(prefix, restart_delay=0)  # has seen no epoch yet
    assert newcomer.try_acquire("job:new", holder(), 30) is None
    assert unguarded.try_acquire("job:also-new", holder(), 30) is None
    raw.delete(quarantine)
    assert newcomer.try_acquire("job:new", holder(), 30) is not None
    unguarded.close()
    newcomer.close()


def test_a_holder_cut_off_from_redis_loses_its_lease_by_redis_clock(
    proxy: CountingProxy, prefix: str
) -> None:
    cut_off = open_backend(prefix, via(proxy), retries=0)
    other = open_backend(prefix)
    lease = cut_off.try_acquire("job:partition", holder(), 0.5)
    assert lease is not None
    proxy.close()  # the network between the holder and Redis is gone
    with pytest.raises(BackendError):
        cut_off.renew(lease, 0.5)
    new = eventually(lambda: other.try_acquire("job:partition", holder(), None), "takeover")
    assert new.fence > lease.fence
    [record] = other.history(key="job:partition")
    assert record.outcome is Outcome.EXPIRED and record.lease.token == lease.token
    back = open_backend(prefix)  # the holder reaches Redis again: its lease is gone
    assert back.release(lease, Outcome.SUCCEEDED) is None
    assert back.renew(lease, 30) is None
    assert other.get("job:partition") == new
    for backend in (cut_off, other, back):
        backend.close()


def test_lock_waits_through_the_backend_for_a_release_in_another_process(
    prefix: str, backend: RedisBackend
) -> None:
    code = textwrap.dedent(
        """
        import sys
        from celery_dlock import Lock
        lock = Lock(sys.argv[1], sys.argv[2], ttl=30, wait=None)
        print(lock.acquire().fence, flush=True)
        sys.stdin.readline()
        lock.release()
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, store_url(prefix), "job:handoff"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdin is not None
    fence = int(process.stdout.readline())
    got: list[int] = []
    waiting = Lock(backend, "job:handoff", ttl=30, wait=None)  # kept while it holds
    waiter = threading.Thread(target=lambda: got.append(waiting.acquire().fence))
    waiter.start()
    process.stdin.write("release\n")
    process.stdin.flush()
    waiter.join(30)
    assert process.wait(30) == 0
    process.stdin.close()
    process.stdout.close()
    assert got and got[0] > fence
    waiting.release()


# -- the doctor --------------------------------------------------------------------------------


def test_server_time_and_diagnose(backend: RedisBackend) -> None:
    now = backend.server_time()
    assert abs(now - time.time()) < 60  # the same host's clock, give or take
    checks = {check.name: check for check in backend.diagnose()}
    assert set(checks) == {
        "redis version",
        "eviction",
        "persistence",
        "role",
        "cluster mode",
        "scripts",
        "replicas",
    }
    assert checks["redis version"].ok and checks["scripts"].ok
    assert checks["replicas"].ok  # replicas=0 waits for none


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
