"""A private Redis primary and its replica (``redis-server --replicaof``), no persistence:
for ``replicas=N`` (tests/backends/test_redis_replicas.py, bench/bench_redis_replicas.py).
A missing ``redis-server`` is a skip (a failure under ``DLOCK_REQUIRE_ALL=1``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.support import eventually, unavailable
from tests.support.objectstore_servers import free_port

__all__ = ["Pair"]


class Pair:
    """A private primary and its replica."""

    def __init__(self, folder: Path) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            unavailable("redis-server is not installed (apt-get install redis-server)")
        self.primary, self.replica = free_port(), free_port()
        self.processes = [
            self._spawn(folder, self.primary),
            self._spawn(folder, self.replica, "--replicaof", "127.0.0.1", str(self.primary)),
        ]
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

    @staticmethod
    def _spawn(folder: Path, port: int, *more: str) -> subprocess.Popen[bytes]:
        node = folder / str(port)
        node.mkdir()
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node)]
        args += ["--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0", *more]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        eventually(lambda: Pair.ping(port), f"redis-server on {port} answers")
        return process

    @staticmethod
    def ping(port: int) -> bool:
        done = subprocess.run(
            ["redis-cli", "-p", str(port), "PING"], capture_output=True, check=False
        )
        return done.stdout.strip() == b"PONG"

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
        for process in self.processes:
            process.kill()
            process.wait(10)
