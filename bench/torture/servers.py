"""The stores a torture run locks in: private servers on free ports, never the shared ones.

A PostgreSQL cluster made by ``initdb`` (as user ``postgres``: initdb refuses root) and a
``redis-server``, each in a temporary directory, both stopped and removed at the end; the file
store is a temporary directory. ``restart(kind)`` is what the chaos thread calls, with the
kinds in this order (the lossy one first, so that the history of most of the run can be
checked):

- postgres: ``immediate`` (``pg_ctl stop -m immediate``: a crash, recovered from the WAL at
  the next start) and ``fast`` (``-m fast``: sessions ended, a clean shutdown).
- redis: ``wiped`` (SIGKILL, restarted with no data: a Redis without persistence) and ``aof``
  (SIGKILL, restarted on its ``appendfsync always`` file: nothing lost).
- file: no server, no restarts. With ``full_disk`` its directory is a tmpfs of ``disk_mib``
  (``mount``, as root; unmounted at the end; see ``disk_mib``), which ``fill(seconds)``
  fills with a filler file, then empties: a full disk (ENOSPC) for ``seconds``.
- redis-cluster: ``failover`` (a primary SIGKILLed, its replica promoted; see
  :class:`RedisClusterServer`).
- s3 and gcs: a private SeaweedFS (``weed mini``) and a private fake-gcs-server (in memory),
  started by ``tests/support/objectstore_servers.py``; no restarts (fake-gcs-server keeps
  its objects in memory, and ``weed mini`` takes seconds to come back) and no partitions.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from tests.support import objectstore_servers, redis_cluster
from tests.support.pgbouncer import pgbouncer

__all__ = [
    "FileStore", "ObjectStoreServer", "PooledPostgresServer", "PostgresServer",
    "RedisClusterServer", "RedisServer", "Store", "free_port", "make_store",
]  # fmt: skip

PG_BIN = Path(os.environ.get("DLOCK_TORTURE_PG_BIN", "/usr/lib/postgresql/15/bin"))
#: Restarts that may lose what the store wrote shortly before (see ``check.py``).
LOSSY = {"immediate", "wiped", "failover"}
#: The file store's tmpfs (``full_disk``): 8 MiB, and 1 MiB more for each second a run may
#: last (``disk_mib``), since its history grows on it: about 450 bytes an acquisition, up to
#: ~1,000 acquisitions a second on two cores. A fixed 8 MiB was full of history a minute into
#: a 300 s run (18,591 acquisitions): every acquire and release failed from then on.
DISK_MIB = 8
DISK_MIB_PER_SECOND = 1
#: Free bytes below which a file store's tmpfs counts as full at the end of a run.
DISK_FULL = 64 << 10


def disk_mib(seconds: float) -> int:
    """The size of the file store's tmpfs for a run of up to ``seconds``."""
    return DISK_MIB + math.ceil(seconds * DISK_MIB_PER_SECOND)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _wait_for(ready: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


class Store:
    """A store under test: its URL, how it restarts, and its cleanup."""

    name = ""
    restart_kinds: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix=f"dlock-torture-{self.name}-"))
        self.hosts = ["127.0.0.1"]  # where it listens: loopback, and a namespace's link

    def reach(self, host: str, subnet: str) -> None:
        """Also listen on ``host`` and let ``subnet`` in (before ``start``)."""
        self.hosts.append(host)

    def url(self, host: str = "127.0.0.1") -> str:
        raise NotImplementedError

    def start(self) -> None:
        """Start the server (nothing to do for a store without one)."""

    def restart(self, kind: str) -> None:
        raise ValueError(f"the {self.name} store cannot restart ({kind!r})")

    def fill(self, seconds: float) -> float:
        """Fill the store's disk for ``seconds``; returns when it was full."""
        raise ValueError(f"the {self.name} store's disk cannot be filled")

    def disk_free(self) -> int | None:
        """Bytes free on the store's own disk; None if it has none (not a tmpfs)."""
        return None

    def stop(self) -> None:
        """Stop the server and remove its files."""
        shutil.rmtree(self.directory, ignore_errors=True)


class FileStore(Store):
    name = "file"

    def __init__(self, full_disk: bool = False, size_mib: int = DISK_MIB) -> None:
        super().__init__()
        self.mounted, self.size_mib = False, size_mib
        if full_disk:
            size = f"size={size_mib}m"
            command = ["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(self.directory)]
            subprocess.run(command, capture_output=True, timeout=30, check=True)
            self.mounted = True

    def url(self, host: str = "127.0.0.1") -> str:
        return f"file://{self.directory}/locks"

    def fill(self, seconds: float) -> float:
        """Fill the tmpfs to its last byte, keep it full for ``seconds``, empty it again;
        returns when it was full (``time.monotonic()``)."""
        if not self.mounted:
            return super().fill(seconds)
        filler = self.directory / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            size = 1 << 20
            while size:  # halving on ENOSPC down to one byte: no room left at all
                try:
                    os.write(fd, bytes(size))
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    size //= 2
            full = time.monotonic()
            time.sleep(seconds)
        finally:
            os.close(fd)
            filler.unlink()
        return full

    def disk_free(self) -> int | None:
        if not self.mounted:
            return None
        stat = os.statvfs(self.directory)
        return stat.f_bavail * stat.f_frsize

    def stop(self) -> None:
        if self.mounted:
            umount = ["umount", str(self.directory)]
            subprocess.run(umount, capture_output=True, timeout=30, check=False)
        super().stop()


class PostgresServer(Store):
    """A private PostgreSQL cluster (``fsync=on``) on a free port, owned by ``postgres``."""

    name = "postgres"
    restart_kinds = ("immediate", "fast")

    def __init__(self) -> None:
        super().__init__()
        self.port = free_port()
        self.data = self.directory / "data"
        if os.geteuid() == 0:  # initdb refuses root: the cluster belongs to postgres
            account = pwd.getpwnam("postgres")
            os.chown(self.directory, account.pw_uid, account.pw_gid)
        self._as_postgres(
            str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
            "-E", "UTF8", "--no-sync",
        )  # fmt: skip

    def _as_postgres(self, *command: str) -> None:
        line = " ".join(shlex.quote(part) for part in command)
        as_root = os.geteuid() == 0
        argv = ["su", "postgres", "-s", "/bin/sh", "-c", line] if as_root else list(command)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {done.stdout}{done.stderr}")

    def reach(self, host: str, subnet: str) -> None:
        super().reach(host, subnet)
        with open(self.data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {subnet} trust\n")

    def url(self, host: str = "127.0.0.1") -> str:
        return f"postgresql://postgres@{host}:{self.port}/postgres"

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.directory} -c listen_addresses={','.join(self.hosts)} "
            "-c fsync=on "
            "-c max_connections=400 -c shared_buffers=32MB"
        )
        self._as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.directory / "server.log"), "-w", "-t", "60", "start",
        )  # fmt: skip

    def _pg_stop(self, mode: str) -> None:
        self._as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"
        )

    def restart(self, kind: str) -> None:
        if kind not in self.restart_kinds:
            raise ValueError(f"postgres restarts are {self.restart_kinds}, not {kind!r}")
        self._pg_stop(kind)
        self.start()

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._pg_stop("immediate")
        super().stop()


class PooledPostgresServer(PostgresServer):
    """The private PostgreSQL cluster behind a PgBouncer in transaction pooling mode (the
    store with ``liveness=ttl``: leases alive by their ttl, no state on a session), with
    fewer server connections than workers; the cluster restarts behind the pooler."""

    name = "pgbouncer"
    #: Server connections of the pooler: fewer than the run's workers.
    POOL_SIZE = 8

    def __init__(self) -> None:
        super().__init__()
        self._pooler = contextlib.ExitStack()
        self._pooler_url = ""

    def direct_url(self) -> str:
        """The cluster's own URL (for its tables: DDL does not go through the pooler)."""
        return super().url()

    def url(self, host: str = "127.0.0.1") -> str:
        assert self._pooler_url, "start the server first"
        return self._pooler_url

    def start(self) -> None:
        super().start()
        if not self._pooler_url:
            target = self.direct_url()
            self._pooler_url = self._pooler.enter_context(
                pgbouncer("transaction", self.POOL_SIZE, target)
            )

    def stop(self) -> None:
        self._pooler.close()
        super().stop()


def _redis_options(restart_delay: float) -> str:
    """The Redis store's URL options in a run: a fresh server refuses grants for
    ``restart_delay`` (it may have just lost its data); the history must hold a whole run."""
    return f"prefix=torture&restart_delay={restart_delay}&history_maxlen=100000000"


class RedisServer(Store):
    """A private ``redis-server`` on a free port, with ``appendfsync always``."""

    name = "redis"
    restart_kinds = ("wiped", "aof")

    def __init__(self, restart_delay: float) -> None:
        super().__init__()
        self.port = free_port()
        self.restart_delay = restart_delay
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, host: str = "127.0.0.1") -> str:
        return f"redis://{host}:{self.port}/0?{_redis_options(self.restart_delay)}"

    def start(self) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [
            executable, "--bind", *self.hosts, "--protected-mode", "no", "--port", str(self.port),
            "--save", "",
            "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.directory),
            "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        with open(self.directory / "server.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        _wait_for(self._answers, f"redis-server on port {self.port}")

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited: {self._log()}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _log(self) -> str:
        return (self.directory / "server.log").read_text(errors="replace")[-2000:]

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def restart(self, kind: str) -> None:
        if kind not in self.restart_kinds:
            raise ValueError(f"redis restarts are {self.restart_kinds}, not {kind!r}")
        self._kill()
        if kind == "wiped":
            shutil.rmtree(self.directory / "appendonlydir", ignore_errors=True)
        self.start()

    def stop(self) -> None:
        self._kill()
        super().stop()


class RedisClusterServer(Store):
    """A private Redis Cluster: three primaries, a replica each, no persistence
    (``tests/support/redis_cluster.py``). Its restart is a ``failover``: a primary (each
    in turn) cut off from its replica for ``CUT`` seconds
    (so that the writes of that moment are lost, as replication lag loses them), then
    SIGKILLed; once its replica serves its slots it starts again, as that one's replica."""

    name = "redis-cluster"
    restart_kinds = ("failover",)
    #: Seconds a primary's writes do not reach its replica before it dies.
    CUT = 0.2

    def __init__(self, restart_delay: float) -> None:
        super().__init__()
        self.restart_delay = restart_delay
        self.cluster: redis_cluster.Cluster | None = None
        self.failovers = 0

    def url(self, host: str = "127.0.0.1") -> str:
        assert self.cluster is not None, "start the server first"
        return f"{self.cluster.url}?{_redis_options(self.restart_delay)}"

    def start(self) -> None:
        self.cluster = redis_cluster.start_cluster()

    def restart(self, kind: str) -> None:
        if kind not in self.restart_kinds:
            raise ValueError(f"redis-cluster restarts are {self.restart_kinds}, not {kind!r}")
        assert self.cluster is not None
        primaries = self.cluster.primaries()
        victim = primaries[self.failovers % len(primaries)]
        self.failovers += 1
        self.cluster.fail_over(victim, cut=self.CUT)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        super().stop()


class ObjectStoreServer(Store):
    """A private S3 (SeaweedFS) or GCS (fake-gcs-server) server on free ports; the run's
    locks under a prefix of their own in the test bucket."""

    STARTERS: ClassVar[dict[str, Callable[[], objectstore_servers.Server]]] = {
        "s3": objectstore_servers.start_seaweedfs,
        "gcs": objectstore_servers.start_fake_gcs,
    }

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__()
        self.server: objectstore_servers.Server | None = None
        self.prefix = objectstore_servers.unique_prefix()

    def url(self, host: str = "127.0.0.1") -> str:
        assert self.server is not None, "start the server first"
        return self.server.url(self.prefix)

    def start(self) -> None:
        self.server = self.STARTERS[self.name]()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        super().stop()


#: Every store a run can use, by the name ``make_store`` takes.
STORES = ("file", "postgres", "pgbouncer", "redis", "redis-cluster", "s3", "gcs")


def make_store(
    name: str, restart_delay: float, full_disk: bool = False, seconds: float = 0.0
) -> Store:
    """The private store for ``name`` (not started); a file store on a tmpfs that
    ``fill`` can fill if ``full_disk``, sized for a run of up to ``seconds``."""
    if name == "file":
        return FileStore(full_disk, disk_mib(seconds))
    if name in ObjectStoreServer.STARTERS:
        return ObjectStoreServer(name)
    if name == "postgres":
        return PostgresServer()
    if name == "pgbouncer":
        return PooledPostgresServer()
    if name == "redis":
        return RedisServer(restart_delay)
    if name == "redis-cluster":
        return RedisClusterServer(restart_delay)
    raise ValueError(
        f"unknown store {name!r}: file, postgres, pgbouncer, redis, redis-cluster, s3 or gcs"
    )
