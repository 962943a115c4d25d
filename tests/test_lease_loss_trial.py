"""Adversarial trial of lease renewal, lease loss and fencing, with real stores and processes.

A holder SIGSTOPped past its ttl while another takes the key; hundreds of short leases
renewed by one process; an operator's forced release (the real CLI) under a callback that
raises; a private Redis restarted under a holder; renewal in a forked child.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import ConfigurationError, Holder, Lease, Lock, Outcome, backend_from_url
from celery_dlock.backends.base import LockBackend
from tests.backends.conftest import STORES
from tests.backends.storecase import StoreCase
from tests.support import eventually, unavailable
from tests.support.freezing_proxy import FreezingProxy

REPO = Path(__file__).resolve().parent.parent

#: Holds a renewed lease, prints it, waits for ``OUT/go``, releases, prints the outcome.
HOLDER = r"""
import json, os, sys, time
from celery_dlock import Lock, Outcome, backend_from_url

url, key, ttl, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]

def on_lost(lease):
    with open(os.path.join(out, "lost"), "a") as f:
        f.write(json.dumps(lease.to_dict()) + "\n")

lock = Lock(backend_from_url(url), key, ttl=ttl, on_lost=on_lost)
lease = lock.acquire()
print(json.dumps(lease.to_dict()), flush=True)
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.02)
record = lock.release(Outcome.SUCCEEDED)
print(json.dumps(None if record is None else record.outcome.value), flush=True)
"""

#: Holds lease A, forks once A's renewal thread runs; the child holds lease B and waits for
#: B to be renewed three times (or lost), then the parent for A to be renewed again.
FORKER = r"""
import json, os, sys, time
from celery_dlock import Lock, backend_from_url

url, key, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])

def renewed(lock, times, limit=15.0):
    first = lock.lease.expires_at
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not lock.lost:
        if lock.lease.expires_at >= first + times * ttl / 3 - 0.05:
            return True
        time.sleep(0.02)
    return False

parent = Lock(backend_from_url(url), key + ":parent", ttl=ttl)
parent.acquire()
assert renewed(parent, 1)
pid = os.fork()
if pid == 0:
    child = Lock(backend_from_url(url), key + ":child", ttl=ttl)
    child.acquire()
    ok = renewed(child, 3)
    lost = child.lost
    record = child.release()
    print(json.dumps({"child_renewed": ok, "child_lost": lost,
                      "child_record": None if record is None else record.outcome.value}),
          flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
ok = renewed(parent, 2)
record = parent.release()
print(json.dumps({"parent_renewed": ok, "status": status,
                  "parent_record": None if record is None else record.outcome.value}),
      flush=True)
"""

#: Stores whose liveness is an expiry, so a holder stopped past its ttl loses its lease.
EXPIRING = ["file", "gcs", "postgres_ttl", "redis", "s3"]


def open_case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreCase]:
    with STORES[request.param].open_store(tmp_path, request) as case:
        case.name = request.param  # type: ignore[attr-defined]
        try:
            yield case
        finally:
            case.backend.close()


@pytest.fixture(params=EXPIRING)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreCase]:
    """A store whose leases expire, which other processes reach (its ``url``)."""
    yield from open_case(request, tmp_path)


@pytest.fixture(params=["file", "postgres", "redis"])
def forking_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreCase]:
    yield from open_case(request, tmp_path)


def real_clock_backend(store: StoreCase) -> LockBackend:
    """Another client of ``store`` judging expiry by the real clock (the file fixture's
    backend runs on a FakeClock, which a holder in another process does not share)."""
    assert store.url is not None
    return backend_from_url(store.url) if store.clock is not None else store.second()


def ttl_for(request: pytest.FixtureRequest) -> float:
    # The object stores read their clock from a response's Date header (whole seconds).
    return 3.0 if request.node.callspec.params["store"] in {"s3", "gcs", "seaweedfs"} else 1.0


def history_of(backend: LockBackend, key: str, token: str) -> list[Outcome]:
    return [r.outcome for r in backend.history(key=key, limit=50) if r.lease.token == token]


def test_paused_holder_learns_loss_and_never_frees_new_holder(
    store: StoreCase, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    ttl = ttl_for(request)
    other = real_clock_backend(store)
    key = f"job:trial:paused:{uuid.uuid4().hex[:8]}"
    out = tmp_path / "holder"
    out.mkdir()
    args = [sys.executable, "-c", HOLDER, str(store.url), key, str(ttl), str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        first = Lease.from_dict(json.loads(proc.stdout.readline()))
        os.kill(proc.pid, signal.SIGSTOP)
        taker = eventually(
            lambda: other.try_acquire(key, Holder.current(task_name="taker"), 60.0),
            "the key granted to another once the stopped holder's ttl ran out",
        )
        os.kill(proc.pid, signal.SIGCONT)
        eventually((out / "lost").exists, "on_lost called in the resumed holder")
        (out / "go").touch()
        released = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    reported = [json.loads(line) for line in (out / "lost").read_text().splitlines()]
    assert [r["token"] for r in reported] == [first.token]
    assert released is None
    current = other.get(key)
    assert current is not None and current.token == taker.token
    assert taker.fence > first.fence
    outcomes = history_of(other, key, first.token)
    assert Outcome.LOST in outcomes and Outcome.SUCCEEDED not in outcomes
    record = other.release(taker, Outcome.SUCCEEDED)
    assert record is not None and record.outcome is Outcome.SUCCEEDED


def test_hundreds_of_short_leases_renewed_by_one_process_stay_held(
    store: StoreCase, request: pytest.FixtureRequest
) -> None:
    name = request.node.callspec.params["store"]
    slow = name in {"s3", "gcs", "seaweedfs"}
    count, ttl = (5, 3.0) if slow else (200, 3.0)  # 0.6 s, then 2 s lost leases to a loaded CPU
    backend = real_clock_backend(store) if store.clock is not None else store.backend
    lost: list[Lease] = []
    prefix = f"job:trial:many:{uuid.uuid4().hex[:8]}"
    locks = [Lock(backend, f"{prefix}:{n}", ttl=ttl, on_lost=lost.append) for n in range(count)]
    firsts = [lock.acquire() for lock in locks]
    try:
        # Each lease renewed at least three times past the last grant (ttl/3 apart).
        last = max(f.expires_at or 0.0 for f in firsts)
        eventually(
            lambda: all((lock.lease.expires_at or 0.0) > last + ttl for lock in locks),
            "every lease renewed three times",
            timeout=30,
        )
        assert lost == []
        assert not any(lock.lost for lock in locks)
        for lock in locks:
            current = backend.get(lock.key)
            assert current is not None and current.token == lock.lease.token
    finally:
        records = [lock.release() for lock in locks]
        if backend is not store.backend:
            backend.close()
    assert [r.outcome if r else None for r in records] == [Outcome.SUCCEEDED] * count


@pytest.mark.parametrize("raises", [False, True], ids=["callback", "raising_callback"])
def test_operator_forced_release_is_reported_once_and_recorded_lost(
    store: StoreCase, request: pytest.FixtureRequest, raises: bool
) -> None:
    ttl = ttl_for(request)
    backend = real_clock_backend(store)
    calls: list[Lease] = []

    def on_lost(lease: Lease) -> None:
        calls.append(lease)
        if raises:
            raise RuntimeError("pager down")

    key = f"job:trial:forced:{uuid.uuid4().hex[:8]}"
    lock = Lock(backend, key, ttl=ttl, on_lost=on_lost)
    first = lock.acquire()
    cli = shutil.which("celery-dlock", path=str(Path(sys.executable).parent))
    assert cli is not None
    done = subprocess.run(
        [cli, "--backend", str(store.url), "release", key, "--force", "--reason", "trial"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    eventually(lambda: calls, "the renewal found the forced release and called on_lost")
    assert lock.lost
    assert [lease.token for lease in calls] == [first.token]
    assert lock.release() is None
    outcomes = history_of(backend, key, first.token)
    assert Outcome.FORCED in outcomes and Outcome.LOST in outcomes
    assert Outcome.SUCCEEDED not in outcomes
    again = Lock(backend, key, ttl=ttl)
    second = again.acquire()
    assert second.fence > first.fence
    assert again.release() is not None
    assert len(calls) == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A redis-server of our own (no persistence) that the test may kill and restart."""
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server is not installed")
    port = free_port()
    args = [binary, "--port", str(port), "--save", "", "--appendonly", "no"]
    args += ["--dir", str(tmp_path), "--maxmemory-policy", "noeviction"]
    server: dict[str, Any] = {"port": port}

    def start() -> None:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server["proc"] = proc

        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False

        eventually(up, "private redis-server listening")

    server["start"] = start
    start()
    try:
        yield server
    finally:
        server["proc"].kill()
        server["proc"].wait()


def test_private_redis_restart_is_reported_lost_and_next_fence_is_higher(
    private_redis: dict[str, Any],
) -> None:
    url = f"redis://127.0.0.1:{private_redis['port']}/0?restart_delay=1&retries=0"
    backend = backend_from_url(url)
    calls: list[Lease] = []
    # A Redis just started grants nothing for ``restart_delay``: wait it out. A ttl of 3 s
    # (renewed every second): at 0.9 s a loaded CI machine once let the lease expire before
    # its first renewal was answered, before any restart.
    lock = Lock(backend, "job:trial:restart", ttl=3.0, wait=10, on_lost=calls.append)
    try:
        first = lock.acquire()
        eventually(lambda: (lock.lease.expires_at or 0) > (first.expires_at or 0), "renewed")
        private_redis["proc"].kill()
        private_redis["proc"].wait()
        private_redis["start"]()
        # ``lost`` is set before ``on_lost`` runs: wait for the callback itself.
        eventually(lambda: calls, "the holder learns the restart lost its lease")
        assert lock.lost
        assert [lease.token for lease in calls] == [first.token]
        assert lock.release() is None
        again = Lock(backend_from_url(url), "job:trial:restart", ttl=0.9, wait=10)
        second = again.acquire()
        assert second.fence > first.fence
        assert again.backend.get("job:trial:restart").token == second.token  # type: ignore[union-attr]
        assert again.release() is not None
        outcomes = history_of(backend, "job:trial:restart", first.token)
        assert outcomes == [Outcome.LOST]
    finally:
        backend.close()


def test_forked_child_renews_its_own_lease_and_parent_keeps_renewing(
    forking_store: StoreCase,
) -> None:
    store = forking_store
    key = f"job:trial:fork:{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, "-c", FORKER, str(store.url), key, "0.6"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    child = next(line for line in lines if "child_renewed" in line)
    parent = next(line for line in lines if "parent_renewed" in line)
    assert child == {"child_renewed": True, "child_lost": False, "child_record": "succeeded"}
    assert parent == {"parent_renewed": True, "status": 0, "parent_record": "succeeded"}


@pytest.fixture
def redis_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreCase]:
    with STORES["redis"].open_store(tmp_path, request) as case:
        try:
            yield case
        finally:
            case.backend.close()


def test_lock_shared_by_threads_never_strands_a_renewed_lease(redis_store: StoreCase) -> None:
    """Two threads acquiring one ``Lock`` of two slots: one holds a slot, the other is told
    the Lock is held (a ConfigurationError); no slot is left held and renewed with no way to
    release it. Both passed the check before their store call, the second overwrote the
    first's lease and renewer, and the first slot stayed held until the process ended (30
    rounds of 30)."""
    backend = redis_store.backend
    key = f"job:trial:threads:{uuid.uuid4().hex[:8]}"
    stranded = 0
    for _ in range(30):
        lock = Lock(backend, key, ttl=5.0, limit=2)
        barrier = threading.Barrier(2)
        refused: list[Exception] = []

        def take(
            lock: Lock = lock,
            barrier: threading.Barrier = barrier,
            refused: list[Exception] = refused,
        ) -> None:
            barrier.wait()
            try:
                lock.acquire()
            except ConfigurationError as exc:  # held by this Lock object (the other thread)
                refused.append(exc)

        threads = [threading.Thread(target=take) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert lock.lease is not None and len(refused) == 1, refused
        lock.release()
        left = [lease for lease in lock.holders() if lease is not None]
        stranded += len(left)
        for lease in left:
            backend.release(lease, Outcome.FORCED, "forced", "trial cleanup")
    assert stranded == 0


def test_partitioned_holder_knows_it_lost_once_another_holds_the_key(
    private_redis: dict[str, Any],
) -> None:
    base = "redis://127.0.0.1:{}/0?restart_delay=0&retries=0"
    proxy = FreezingProxy(private_redis["port"])
    holder = backend_from_url(base.format(proxy.port) + "&socket_timeout=60")
    direct = backend_from_url(base.format(private_redis["port"]))
    calls: list[Lease] = []
    lock = Lock(holder, "job:trial:partition", ttl=1.0, on_lost=calls.append)
    try:
        first = lock.acquire()
        eventually(lambda: (lock.lease.expires_at or 0) > (first.expires_at or 0), "renewed")
        proxy.flowing.clear()
        taker = eventually(
            lambda: direct.try_acquire("job:trial:partition", Holder.current(), 30.0),
            "the partitioned holder's lease expires on Redis and another takes the key",
        )
        assert taker.fence > first.fence
        # The holder's own clock says its lease ran out a while ago: it must say so, well
        # before its blocked renewal times out (60 s).
        eventually(lambda: calls, "the partitioned holder reports its lease lost", 20)
        assert lock.lost
        assert [lease.token for lease in calls] == [first.token]
    finally:
        proxy.flowing.set()  # the partition heals: the renewal in flight gets its answer
        lock.release()  # after the renewer stopped: no socket is left mid-call
        holder.close()
        proxy.close()
        direct.close()
