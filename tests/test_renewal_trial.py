"""Adversarial trial of lease renewal and lease loss, beyond tests/test_lease_loss_trial.py.

A store cut off from a holder of several leases (a loopback proxy that stops forwarding)
while one lease's ``on_lost`` blocks, or while the holder releases; a task with
``on_lock_lost="raise"`` whose loss is reported while the task is releasing (a logging
handler as slow as a remote log shipper); leases at the longest ttl; a ``liveness=ttl``
Postgres lease whose connection the server ends; a process that exits normally while a
lease of its is being renewed; two threads releasing one Lock; a process that cannot start
a thread (RLIMIT_AS); a holder SIGSTOPped before its first renewal, resumed with its store
gone. Real Redis and Postgres over TCP, real processes and signals.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dlock import (
    ConfigurationError,
    Lease,
    Lock,
    LockedTask,
    LockLostError,
    Outcome,
    Record,
    backend_from_url,
    install,
)
from celery_dlock.backends.base import MAX_TTL, LockBackend
from celery_dlock.process import held
from tests.backends.stores.postgres import admin_connection, schema_store
from tests.backends.stores.redis import URL as REDIS_URL
from tests.backends.stores.redis import delete_prefix, store_url
from tests.support import eventually
from tests.support.freezing_proxy import FreezingProxy
from tests.support.services import POSTGRES_URL
from tests.test_lease_loss_trial import private_redis  # noqa: F401

REPO = Path(__file__).resolve().parent.parent

#: Holds a renewed lease and ends normally without releasing it; an exit handler of the
#: application's, registered first (so it runs last), takes 1.2 s (a log shipper's flush):
#: two renewals are due meanwhile. ``on_lost`` appends the lease's token to ``OUT``. The
#: lease lives 1.5 s: at 0.3 s a loaded CI run could lose it before the exit, for real.
EXITING = r"""
import atexit, sys, time
atexit.register(time.sleep, 1.2)
from celery_dlock import Lock, backend_from_url

url, key, out = sys.argv[1:4]

def on_lost(lease):
    with open(out, "a") as f:
        f.write(lease.token + "\n")

lock = Lock(backend_from_url(url), key, ttl=1.5, on_lost=on_lost)
first = lock.acquire()
while lock.lease.expires_at <= first.expires_at:
    time.sleep(0.01)
print(first.token, flush=True)
"""


#: Takes a lease (ttl 3 s) and, before its first renewal is due, leaves the process no
#: room for another thread's stack (RLIMIT_AS, as a container's memory limit would): the
#: renewal's thread cannot start. Once that happened (a warning, or the thread that
#: starts renewals dying of it), the limit is lifted and another lease is taken; prints
#: whether both were renewed, then releases them once the file ``OUT`` exists.
STARVED = r"""
import json, logging, os, resource, sys, threading, time
from celery_dlock import Lock, backend_from_url

url, prefix, out = sys.argv[1:4]
failed = threading.Event()

class Seen(logging.Handler):
    def emit(self, record):
        if "cannot start the renewal" in record.getMessage():
            failed.set()

logging.getLogger("celery_dlock.renewal").addHandler(Seen())
threading.excepthook = lambda args: failed.set()
backend = backend_from_url(url)
warm = Lock(backend, prefix + ":warm", ttl=30.0)  # starts the thread that starts renewals
warm.acquire()
warm.release()  # before its first renewal: no thread's stack left for another to reuse

def size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

soft, hard = resource.getrlimit(resource.RLIMIT_AS)
starved = Lock(backend, prefix + ":starved", ttl=3.0)
first = starved.acquire()
resource.setrlimit(resource.RLIMIT_AS, (size() + 2 ** 21, hard))
failed.wait(30)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
later = Lock(backend, prefix + ":later", ttl=0.6)
taken = later.acquire()

def renewed(lock, lease):
    return lock.lease.expires_at > lease.expires_at

deadline = time.monotonic() + 10
while time.monotonic() < deadline and not (renewed(starved, first) and renewed(later, taken)):
    time.sleep(0.01)
print(json.dumps({
    "failed": failed.is_set(),
    "tokens": [first.token, taken.token],
    "renewed": [renewed(starved, first), renewed(later, taken)],
    "lost": [starved.lost, later.lost],
}), flush=True)
while not os.path.exists(out):
    time.sleep(0.02)
starved.release()
later.release()
"""


#: Takes a lease (ttl 1.5 s), prints it, and stops itself before its first renewal; once
#: continued, prints whether its lease was lost, or its renewal's failure retried, first.
PAUSED = r"""
import json, logging, os, signal, sys, threading, time
from celery_dlock import Lock, backend_from_url

retried = threading.Event()

class Seen(logging.Handler):
    def emit(self, record):
        if getattr(record, "event", None) == "renew_failed":
            retried.set()

logging.getLogger("celery_dlock.renewal").addHandler(Seen())
lock = Lock(backend_from_url(sys.argv[1]), sys.argv[2], ttl=1.5)
lease = lock.acquire()
print(json.dumps(lease.to_dict()), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
deadline = time.monotonic() + 30
while not (lock.lost or retried.is_set()) and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"lost": lock.lost, "retried": retried.is_set()}), flush=True)
"""


@pytest.fixture
def redis_url() -> Iterator[str]:
    """The URL of a Redis store of this test's own (a key prefix, deleted after)."""
    prefix = f"renewal-trial-{uuid.uuid4().hex[:8]}"
    yield store_url(prefix)
    delete_prefix(REDIS_URL, prefix)


def history_of(backend: LockBackend, lease: Lease) -> list[Outcome]:
    return [
        r.outcome for r in backend.history(key=lease.key, limit=50) if r.lease.token == lease.token
    ]


def test_a_blocking_on_lost_does_not_hold_back_the_loss_of_another_lease(
    private_redis: dict[str, Any],  # noqa: F811
) -> None:
    """Two leases of one process cut off from Redis (packets dropped, sockets open): the
    first's ``on_lost`` releases its Lock, which waits for the renewal in flight (up to the
    socket timeout, 30 s here). The second lease must still be reported lost at its own
    expiry. Both were reported by one thread, so the second waited for the first's
    callback: its holder ran on for the whole partition believing it held the key."""
    proxy = FreezingProxy(private_redis["port"])
    base = "redis://127.0.0.1:{}/0?restart_delay=0&retries=0"
    holder = backend_from_url(base.format(proxy.port) + "&socket_timeout=30")
    locks: dict[str, Lock] = {}
    lost: list[str] = []

    def release_on_loss(lease: Lease) -> None:
        lost.append(lease.key)
        locks["first"].release()

    locks["first"] = Lock(holder, "job:trial:first", ttl=0.9, on_lost=release_on_loss)
    locks["second"] = Lock(
        holder, "job:trial:second", ttl=1.5, on_lost=lambda lease: lost.append(lease.key)
    )
    try:
        firsts = {name: lock.acquire() for name, lock in locks.items()}
        for name, lock in locks.items():
            eventually(
                lambda lock=lock, name=name: (
                    (lock.lease.expires_at or 0) > (firsts[name].expires_at or 0)
                ),
                f"the {name} lease renewed",
            )
        proxy.flowing.clear()
        eventually(lambda: "job:trial:first" in lost, "the first lease reported lost")
        # Its expiry is 1.5 s after its last renewal; the partition lasts 30 s.
        # ``lost`` is set before the callback runs: wait for the callback itself.
        eventually(
            lambda: "job:trial:second" in lost, "the second lease's on_lost called", timeout=10
        )
        assert locks["second"].lost
    finally:
        proxy.flowing.set()  # the renewals in flight get their answers
        eventually(lambda: locks["first"].lease is None, "the first Lock released")
        locks["second"].release()
        holder.close()
        proxy.close()


class SlowLog(logging.Handler):
    """A log handler as slow as a log shipper that sends each ERROR over the network: it
    holds the renewal thread that reports a lost lease until the task's release has begun
    (the task thread waits for that thread then)."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: Lock | None = None

    def emit(self, record: logging.LogRecord) -> None:
        lock = self.watched
        if getattr(record, "event", None) != "lease_lost" or lock is None:
            return
        renewer = lock._renewer
        deadline = time.monotonic() + 10
        while renewer is not None and not renewer._stopped and time.monotonic() < deadline:
            time.sleep(0.005)


@pytest.fixture
def slow_log() -> Iterator[SlowLog]:
    handler = SlowLog()
    logger = logging.getLogger("celery_dlock.renewal")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_raise_policy_loss_reported_while_releasing_still_records_the_lease(
    redis_url: str, slow_log: SlowLog
) -> None:
    """``on_lock_lost="raise"``: an operator force-releases the running task's lease; the
    body ends while the renewal thread is still reporting the loss. The task must fail with
    a LockLostError naming the key, its lease's release be recorded (``lost``), and the
    process hold it no longer. The LockLostError injected by the report landed inside
    ``Renewer.stop()`` within the release: no record, the lease still in the process's
    registry, a LockLostError with no key."""
    app = Celery("renewal_trial_raise", set_as_current=False)
    app.conf.update(dlock_backend=redis_url)
    install(app, janitor=False)
    operator = backend_from_url(redis_url)
    seen: dict[str, Any] = {}

    @app.task(
        shared=False,
        base=LockedTask,
        bind=True,
        name="trial.raise",
        lock_key="report:{n}",
        lock_ttl=0.6,
        on_lock_lost="raise",
    )
    def report(self: Any, n: int) -> str:
        lock = self.request.dlock_lock
        slow_log.watched = lock
        seen["lease"] = lease = self.lease
        operator.release(lease, Outcome.FORCED, "forced", "an operator's release --force")
        eventually(lambda: lock.lost, "the renewal found the lease gone")
        return "report done"

    try:
        with pytest.raises(LockLostError) as raised:
            report(1)
        lease: Lease = seen["lease"]
        assert raised.value.key == lease.key
        assert Outcome.LOST in history_of(operator, lease)
        assert held().lease(lease.token) is None
    finally:
        if "lease" in seen:
            held().discard(seen["lease"].token)  # not left for the exit handler
        operator.close()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with schema_store(POSTGRES_URL) as case:
        assert case.url is not None
        yield case.url


def test_a_lease_at_the_longest_ttl_is_renewed_and_released(
    redis_url: str, postgres_url: str, tmp_path: Path
) -> None:
    """Ten years: no overflow in a timer, a PX or an interval, on any store."""
    urls = [redis_url, f"file://{tmp_path}", postgres_url, postgres_url + "&liveness=ttl&ttl=60"]
    for url in urls:
        backend = backend_from_url(url)
        try:
            lock = Lock(backend, f"job:trial:long:{uuid.uuid4().hex[:6]}", ttl=MAX_TTL)
            first = lock.acquire()
            assert first.expires_at is not None and first.expires_at > time.time() + MAX_TTL - 60
            again = lock.renew()
            assert (again.token, again.fence) == (first.token, first.fence)
            current = backend.get(lock.key)
            assert current is not None and current.token == first.token
            record = lock.release()
            assert record is not None and record.outcome is Outcome.SUCCEEDED
        finally:
            backend.close()


def test_a_ttl_lease_outlives_its_connection_ended_by_the_server(postgres_url: str) -> None:
    """``liveness=ttl``: the lease lives by its ttl, not by a session; the server ending the
    client's connection (pg_terminate_backend) between renewals must cost no lease."""
    name = f"renewal-trial-{uuid.uuid4().hex[:8]}"  # our connections alone are ended
    backend = backend_from_url(postgres_url + f"&liveness=ttl&ttl=5&application_name={name}")
    admin = admin_connection()
    lost: list[Lease] = []
    lock = Lock(backend, "job:trial:pgttl", ttl=0.9, on_lost=lost.append)
    try:
        first = lock.acquire()
        for _ in range(3):
            before = lock.lease
            assert before is not None
            eventually(
                lambda before=before: (lock.lease.expires_at or 0) > (before.expires_at or 0),
                "renewed",
            )
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s",
                [name],
            ).fetchall()
            assert ended and all(ok for (ok,) in ended)
        renewed = lock.lease
        eventually(
            lambda: (lock.lease.expires_at or 0) > (renewed.expires_at or 0),
            "renewed on a new connection",
        )
        assert lost == [] and not lock.lost
        current = backend.get(lock.key)
        assert current is not None and (current.token, current.fence) == (first.token, first.fence)
        record = lock.release()
        assert record is not None and record.outcome is Outcome.SUCCEEDED
    finally:
        admin.close()
        backend.close()


def test_a_lease_released_at_a_normal_exit_is_not_reported_lost(
    redis_url: str, tmp_path: Path
) -> None:
    """A process that ends holding a renewed lease releases it as abandoned; its renewal
    thread runs on through the other exit handlers, and found the lease gone: it called
    ``on_lost`` and logged "was lost: another holder may run now" at every normal exit
    (a page at every deploy)."""
    key = f"job:trial:exit:{uuid.uuid4().hex[:8]}"
    out = tmp_path / "lost"
    done = subprocess.run(
        [sys.executable, "-c", EXITING, redis_url, key, str(out)],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    token = done.stdout.strip()
    backend = backend_from_url(redis_url)
    try:
        outcomes = [r.outcome for r in backend.history(key=key, limit=50) if r.lease.token == token]
        assert outcomes == [Outcome.ABANDONED]
        assert backend.get(key) is None
    finally:
        backend.close()
    assert not out.exists(), out.read_text()
    assert "was lost" not in done.stderr, done.stderr[-3000:]


def test_two_threads_releasing_one_renewed_lock_record_one_release(redis_url: str) -> None:
    """A watchdog thread and the worker thread both release one Lock whose lease is being
    renewed: one release is recorded, the other caller is told the Lock is not held (a
    ConfigurationError, as for two threads' acquires). The second got an AttributeError
    from inside ``detach`` (the first had dropped the renewer under it) in 29 rounds of 30."""
    backend = backend_from_url(redis_url)
    try:
        for n in range(10):
            # 1.5 s: a 0.3 s lease expired under a loaded CI run before its renewal was
            # answered, and a lost lease's release records nothing (the test's point is
            # the two releases, not the renewal's speed).
            lock = Lock(backend, f"job:trial:two-releases:{n}", ttl=1.5)
            first = lock.acquire()
            eventually(
                lambda lock=lock, first=first: (
                    (lock.lease.expires_at or 0) > (first.expires_at or 0)
                ),
                "the renewal thread runs",
            )
            barrier = threading.Barrier(2)
            ends: list[object] = []

            def release(
                lock: Lock = lock, barrier: threading.Barrier = barrier, ends: list[object] = ends
            ) -> None:
                barrier.wait()
                try:
                    ends.append(lock.release())
                except Exception as exc:
                    ends.append(exc)

            threads = [threading.Thread(target=release) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            records = [end for end in ends if isinstance(end, Record)]
            refused = [end for end in ends if isinstance(end, ConfigurationError)]
            assert len(records) == 1 and len(refused) == 1, ends
            assert records[0].outcome is Outcome.SUCCEEDED
            assert history_of(backend, first) == [Outcome.SUCCEEDED]
            assert held().lease(first.token) is None
    finally:
        backend.close()


def test_a_renewal_thread_that_cannot_start_does_not_end_renewals_for_good(
    redis_url: str, tmp_path: Path
) -> None:
    """One failure to start a thread (``can't start new thread``: memory or thread limits)
    killed the one thread that starts every lease's renewal: that lease and every lease
    the process took after it were never renewed, expired on the store while held, and
    were never reported lost (on_lost never called, ``lost`` False)."""
    prefix = f"job:trial:starved:{uuid.uuid4().hex[:8]}"
    out = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-c", STARVED, redis_url, prefix, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    backend = backend_from_url(redis_url)
    try:
        assert proc.stdout is not None
        said = json.loads(proc.stdout.readline() or "null")
        assert said is not None and said["failed"], said
        assert said["renewed"] == [True, True] and said["lost"] == [False, False], said
        for name, token in zip(["starved", "later"], said["tokens"], strict=True):
            current = backend.get(f"{prefix}:{name}")
            assert current is not None and current.token == token
        out.touch()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-3000:]
    finally:
        out.touch()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        backend.close()


class HeldReport(logging.Handler):
    """A log handler that holds the report of a lost lease (the log line comes before the
    ``on_lost`` call) until ``released`` is set, or 2 s at most: a slow log shipper."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.reporting = threading.Event()
        self.released = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == "lease_lost" and self.key in record.getMessage():
            self.reporting.set()
            self.released.wait(2.0)


def test_on_lost_is_never_called_after_the_release_returned(
    private_redis: dict[str, Any],  # noqa: F811
) -> None:
    """A renewal cut off past the lease's expiry: the lease is reported lost, and while
    the report is under way the holder releases. ``on_lost`` must have been called by the
    time ``release()`` returns (as it is when the renewal thread itself finds the loss):
    called after, it aborts whatever the holder does next (a Celery worker child's next
    task, under ``on_lock_lost="raise"``). It was called after, once the report ended."""
    key = "job:trial:late-report"
    proxy = FreezingProxy(private_redis["port"])
    holder = backend_from_url(
        f"redis://127.0.0.1:{proxy.port}/0?restart_delay=0&retries=0&socket_timeout=30"
    )
    order: list[str] = []
    report = HeldReport(key)
    logger = logging.getLogger("celery_dlock.renewal")
    logger.addHandler(report)
    lock = Lock(holder, key, ttl=0.9, on_lost=lambda lease: order.append("on_lost"))
    try:
        first = lock.acquire()
        eventually(lambda: (lock.lease.expires_at or 0) > (first.expires_at or 0), "renewed")
        renewer = lock._renewer
        assert renewer is not None
        proxy.flowing.clear()
        assert report.reporting.wait(30), "the lease reported lost at its expiry"

        def release() -> None:
            lock.release()
            order.append("released")
            report.released.set()

        releasing = threading.Thread(target=release)
        releasing.start()
        eventually(lambda: renewer._stopped, "the release stops the renewal")
        proxy.flowing.set()  # the renewal in flight answers, late
        releasing.join(30)
        assert not releasing.is_alive()
        assert order == ["on_lost", "released"]
        assert Outcome.LOST in history_of(holder, first)
    finally:
        report.released.set()
        proxy.flowing.set()
        logger.removeHandler(report)
        holder.close()
        proxy.close()


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_holder_paused_past_its_ttl_before_its_first_renewal_knows_it_lost(
    private_redis: dict[str, Any],  # noqa: F811
) -> None:
    """A holder paused (a VM frozen, a long GC) right after its grant, past its ttl, and
    resumed while its store is unreachable: its first renewal fails, and since the lease's
    ttl ran out long ago by the holder's own clock, it must be reported lost at once. The
    renewer counted the lease's life from when its thread started (on resume) less one
    interval, so it took the lease for alive, retried, and reported it lost only two
    thirds of a ttl later, while another holder may already run."""
    url = f"redis://127.0.0.1:{private_redis['port']}/0?restart_delay=0&retries=0"
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED, url, "job:trial:paused-early"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        lease = Lease.from_dict(json.loads(proc.stdout.readline()))
        eventually(lambda: stopped(proc.pid), "the holder paused before its first renewal")
        private_redis["proc"].kill()  # the store unreachable when the holder resumes
        private_redis["proc"].wait()
        eventually(lambda: time.time() > (lease.expires_at or 0) + 0.1, "the lease's ttl ran out")
        proc.send_signal(signal.SIGCONT)
        said = json.loads(proc.stdout.readline())
        assert said == {"lost": True, "retried": False}
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
