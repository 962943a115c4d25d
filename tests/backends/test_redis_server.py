"""Redis backend tests that need a Redis of their own: restarts (no persistence), a unix
socket, TLS, ``SCRIPT FLUSH``, command statistics. Each starts a private ``redis-server``
on a free port in a temporary directory and stops it afterwards; the shared server on
6379 is never touched.
"""

from __future__ import annotations

import itertools
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_dlock import BackendError, Holder, Lock, Outcome
from celery_dlock.backends import backend_from_url
from tests.support import eventually, unavailable

redis = pytest.importorskip("redis")

from celery_dlock.backends.redis import RedisBackend  # noqa: E402
from celery_dlock.backends.redis.scripts import ACQUIRE  # noqa: E402
from tests.support.redis_server import RedisServer, private_redis  # noqa: E402


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with private_redis() as private:
        yield private


def holder() -> Holder:
    return Holder.current()


def open_backend(url: str) -> RedisBackend:
    backend = backend_from_url(url)
    assert isinstance(backend, RedisBackend)
    return backend


# -- URLs that need a server of their own ------------------------------------------------------


def test_a_unix_socket_url_reaches_redis(server: RedisServer) -> None:
    backend = open_backend(f"unix://{server.socket}?db=2&prefix=sock&restart_delay=0")
    lease = backend.try_acquire("job:unix", holder(), 5)
    assert lease is not None
    backend.wait("job:unix", 0.05)
    assert backend.release(lease, Outcome.SUCCEEDED) is not None
    assert [r.lease.token for r in backend.history()] == [lease.token]
    client = server.client()
    assert client.execute_command("SELECT", 2) and client.exists("{sock}:history") == 1
    client.close()
    backend.close()


def test_a_rediss_url_talks_tls(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        unavailable("openssl is not installed: no certificates for the TLS test")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=tmp_path, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "1", "-subj", "/CN=dlock test CA")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=localhost")  # fmt: skip
    (tmp_path / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext")  # fmt: skip
    directory = Path(tempfile.mkdtemp(prefix="dlock-tls-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        tls_port = sock.getsockname()[1]
    private = RedisServer(
        directory,
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(tmp_path / "server.crt"),
        "--tls-key-file", str(tmp_path / "server.key"),
        "--tls-ca-cert-file", str(tmp_path / "ca.crt"),
        "--tls-auth-clients", "no",
    )  # fmt: skip
    try:
        private.start()
        ca = tmp_path / "ca.crt"
        backend = open_backend(
            f"rediss://127.0.0.1:{tls_port}/0?prefix=tls&restart_delay=0&ssl_ca_certs={ca}"
        )
        lease = backend.try_acquire("job:tls", holder(), None)
        assert lease is not None
        assert backend.release(lease, Outcome.SUCCEEDED) is not None
        backend.close()
        untrusted = open_backend(f"rediss://127.0.0.1:{tls_port}/0?prefix=tls&retries=0")
        with pytest.raises(BackendError):  # the system CAs do not know ours
            untrusted.get("job:tls")
        untrusted.close()
    finally:
        private.stop()
        shutil.rmtree(directory, ignore_errors=True)


# -- scripts and commands --------------------------------------------------------------------------


def test_scripts_come_back_after_script_flush(server: RedisServer) -> None:
    backend = open_backend(server.url("flush"))
    client = server.client()
    first = backend.try_acquire("job:flush", holder(), None)
    assert first is not None
    assert client.script_exists(ACQUIRE.sha) == [True]
    client.script_flush()
    assert client.script_exists(ACQUIRE.sha) == [False]
    second = backend.try_acquire("job:flush-2", holder(), None)  # NOSCRIPT, then EVAL
    assert second is not None
    assert client.script_exists(ACQUIRE.sha) == [True]  # EVAL cached it for EVALSHA again
    assert backend.release(first, Outcome.SUCCEEDED) is not None
    assert backend.release(second, Outcome.SUCCEEDED) is not None
    client.close()
    backend.close()


def test_reap_reads_the_index_and_never_scans_the_keyspace(server: RedisServer) -> None:
    backend = open_backend(server.url("idx"))
    client = server.client()
    client.mset({f"unrelated:{n}": n for n in range(2000)})
    dying = [backend.try_acquire(f"job:dying:{n}", holder(), 0.2) for n in range(3)]
    live = backend.try_acquire("job:live", holder(), None)
    assert all(dying) and live is not None
    client.config_resetstat()
    reaped = eventually(lambda: backend.reap() or None, "reap after expiry")
    while len(reaped) < 3:
        reaped += backend.reap()
    assert sorted(r.key for r in reaped) == [f"job:dying:{n}" for n in range(3)]
    assert [lease.key for lease in backend.leases()] == ["job:live"]
    commands = client.info("commandstats")
    assert not {"cmdstat_keys", "cmdstat_scan"} & set(commands), sorted(commands)
    client.close()
    backend.close()


# -- Redis restarted, without persistence --------------------------------------------------------


def test_after_a_restart_holders_see_their_leases_lost_and_fences_go_on_up(
    server: RedisServer,
) -> None:
    # restart_delay well above the time a loaded machine takes from the restart to the
    # newcomer's first call (1 s was not, as in the test below).
    url = server.url("restart", restart_delay=3)
    holding, other = open_backend(url), open_backend(url)
    # The server just started: its first clients wait out the quarantine too.
    lease = eventually(lambda: holding.try_acquire("job:restart", holder(), 30), "first lock")
    assert other.try_acquire("job:restart", holder(), 30) is None  # it has seen the epoch

    server.restart()

    assert holding.renew(lease, 30) is None
    assert holding.release(lease, Outcome.SUCCEEDED) is None
    # Redis lost every lock: nobody gets one until restart_delay has passed...
    assert other.try_acquire("job:restart", holder(), 30) is None
    newcomer = open_backend(url)
    assert newcomer.try_acquire("job:elsewhere", holder(), 30) is None
    # ...and a waiter wakes for the quarantine's end (the probe reports it).
    again = None
    while again is None:
        other.wait("job:restart", 10)
        again = other.try_acquire("job:restart", holder(), 30)
    assert again.fence > lease.fence
    assert [r.lease.token for r in other.history()] == []  # the old history died with Redis
    for backend in (holding, other, newcomer):
        backend.close()


def test_a_process_new_after_a_restart_waits_out_the_quarantine(server: RedisServer) -> None:
    # restart_delay well above the time a loaded machine takes from the restart to the
    # newcomer's first call (1 s was not: CI saw the newcomer granted, too late to wait).
    url = server.url("fresh", restart_delay=3)
    holding = open_backend(url)
    lease = eventually(lambda: holding.try_acquire("job:fresh", holder(), 30), "first lock")
    server.restart()
    # The first caller after the restart never saw Redis before: a loss and a first use
    # look the same to it, but the server is younger than restart_delay, so it waits.
    newcomer = open_backend(url)
    assert newcomer.try_acquire("job:fresh", holder(), 30) is None
    assert holding.renew(lease, 30) is None  # meanwhile the old holder learns of the loss
    later = eventually(lambda: newcomer.try_acquire("job:fresh", holder(), 30), "lock after")
    assert later.fence > lease.fence
    for backend in (holding, newcomer):
        backend.close()


CONTENDER = textwrap.dedent(
    """
    import os, sys, time
    from celery_dlock import BackendError, Lock, Outcome
    from celery_dlock.backends import backend_from_url

    url, key, counter, log, stop = sys.argv[1:6]
    backend = backend_from_url(url)
    while not os.path.exists(stop):
        lock = Lock(backend, key, ttl=30, wait=None, renew=False)
        try:
            lock.acquire()
        except BackendError:  # Redis is down: try again shortly
            time.sleep(0.02)
            continue
        start = time.monotonic()
        with open(counter) as f:
            value = int(f.read() or 0)
        time.sleep(0.002)
        with open(counter, "w") as f:
            f.write(str(value + 1))
        end = time.monotonic()
        lease = lock.detach()
        while True:
            try:
                record = backend.release(lease, Outcome.SUCCEEDED)
                break
            except BackendError:
                time.sleep(0.02)
        with open(log, "a") as f:
            f.write(f"{start} {end} {lease.fence} {'released' if record else 'lost'}\\n")
    """
)


def test_a_restart_during_contention_breaks_no_mutual_exclusion(
    server: RedisServer, tmp_path: Path
) -> None:
    url = server.url("contend", restart_delay=3)
    counter, log, stop = tmp_path / "counter", tmp_path / "log", tmp_path / "stop"
    counter.write_text("0")
    log.write_text("")
    args = [url, "job:contended", str(counter), str(log), str(stop)]
    processes = [subprocess.Popen([sys.executable, "-c", CONTENDER, *args]) for _ in range(4)]
    backend = open_backend(url)
    try:
        eventually(lambda: int(counter.read_text() or 0) >= 20 or None, "contention runs")
        # The test takes its turn, and Redis restarts while the test holds the lock.
        ours = Lock(backend, "job:contended", ttl=30, wait=None, renew=False)  # kept to the end
        lease = ours.acquire()
        held_from = time.monotonic()
        server.restart()
        # The holder works on until its next renewal tells it the lease is gone: nobody
        # may get the lock before that (the quarantine, restart_delay, covers it).
        renewed = backend.renew(lease, 30)
        held_until = time.monotonic()
        released = backend.release(lease, Outcome.SUCCEEDED)
        ours.detach()  # released through the backend above: the Lock lets go of it
        before = int(counter.read_text())
        eventually(lambda: int(counter.read_text() or 0) >= before + 20 or None, "runs on")
    finally:
        stop.write_text("stop")
        codes = [process.wait(60) for process in processes]
        backend.close()
    assert codes == [0] * 4
    assert renewed is None and released is None  # the holder sees its lease lost

    rows = [line.split() for line in log.read_text().splitlines()]
    sections = sorted((float(start), float(end), int(fence)) for start, end, fence, _ in rows)
    assert int(counter.read_text()) == len(sections)  # no update lost
    intervals = sorted([(start, end) for start, end, _ in sections] + [(held_from, held_until)])
    for (_, end), (start, _) in itertools.pairwise(intervals):
        assert end <= start, "two holders at once"
    fences = [fence for _, _, fence in sections]
    assert all(a < b for a, b in itertools.pairwise(fences)), "fences out of order"
    assert any(start > held_until for start, _, _ in sections)  # contention went on after
    assert {state for *_, state in rows} == {"released"}
