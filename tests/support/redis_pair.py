"""A private Redis primary and its replica (``redis-server --replicaof``), no persistence:
for ``replicas=N`` (tests/backends/test_redis_replicas.py, bench/bench_redis_replicas.py).
A missing ``redis-server`` is a skip (a failure under ``DLOCK_REQUIRE_ALL=1``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.support import eventually, unavailable
from tests.support.redis_server import RedisServer

__all__ = ["Pair"]


class Pair:
    """A private primary and its replica."""

    def __init__(self, folder: Path) -> None:
        if shutil.which("redis-cli") is None:
            unavailable("redis-cli is not installed (apt-get install redis-tools)")
        (folder / "primary").mkdir()
        (folder / "replica").mkdir()
        first = RedisServer(folder / "primary", "--repl-diskless-sync-delay", "0")
        first.start()
        self.primary = first.port
        second = RedisServer(folder / "replica", "--replicaof", "127.0.0.1", str(self.primary))
        second.start()
        self.replica = second.port
        self.servers = [first, second]
        eventually(lambda: "master_link_status:up" in self.cli("INFO", "replication"), "sync")
        # The primary counts a replica for WAIT once it is online there, after the
        # replica's first acknowledgement (it sends one a second), and a first WAIT after
        # that still took 0.86 s once in three fresh pairs (later ones: under 7 ms): one
        # WAIT here, so that the tests' short timeouts measure the replica, not its start.
        warm = subprocess.run(
            ["redis-cli", "-p", str(self.primary)],
            input=b"SET dlock-test-warm 1\nWAIT 1 10000\n",
            capture_output=True,
            timeout=30,
            check=False,
        )
        if warm.stdout.split()[-1:] != [b"1"]:
            raise RuntimeError(f"the replica did not acknowledge a write: {warm.stdout!r}")

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The primary's process, then the replica's."""
        return [server.process for server in self.servers if server.process is not None]

    def cli(self, *args: str | bytes) -> str:
        """A command on the replica (reads only)."""
        done = subprocess.run(
            ["redis-cli", "-p", str(self.replica), *args],
            capture_output=True,
            timeout=30,
            check=False,
        )
        return done.stdout.decode()

    def url(self, options: str) -> str:
        return f"redis://127.0.0.1:{self.primary}/0?restart_delay=0&{options}"

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
