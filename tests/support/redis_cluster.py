"""A real Redis Cluster for the tests: six ``redis-server`` nodes on free local ports,
three primaries with a replica each (``redis-cli --cluster create``), no persistence,
started once per run and stopped when it ends. A missing ``redis-server`` is a skip (a
failure under ``DLOCK_REQUIRE_ALL=1``)."""

from __future__ import annotations

import atexit
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import unavailable


@dataclass
class Cluster:
    ports: list[int]
    folder: Path
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """``redis+cluster://`` naming two of the nodes (the client learns the rest)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]},127.0.0.1:{self.ports[1]}"

    def cli(self, port: int, *args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return done.stdout

    def slot_spans(self) -> list[tuple[int, int, int]]:
        """The slot ranges served now, as ``(first, last, port of its primary)``."""
        spans = []
        for line in self.cli(self.ports[0], "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2]:
                for span in fields[8:]:
                    first, _, last = span.partition("-")
                    if first.isdigit():
                        spans.append((int(first), int(last or first), _port(fields[1])))
        return spans

    def primary_of(self, key: bytes) -> int:
        """The port of the primary that serves ``key``'s slot now; 0 while none does (a
        failover under way)."""
        from redis.crc import key_slot

        return _serving(self.slot_spans(), key_slot(key))

    def owners(self) -> Callable[[str], int]:
        """The port of the primary serving a tag's slot, by one read of ``CLUSTER NODES``
        (for many tags: ``primary_of`` reads it for each)."""
        from redis.crc import key_slot

        spans = self.slot_spans()
        return lambda tag: _serving(spans, key_slot(tag.encode()))

    def replica_of(self, port: int) -> int:
        """The port of the replica of the primary on ``port``, once a live node knows it (a
        replica in sync may not be in every node's view yet)."""
        found: list[int] = []

        def known() -> bool:
            for node in self.ports:
                if self.processes[node].poll() is not None:
                    continue
                lines = [line.split() for line in self.cli(node, "CLUSTER", "NODES").splitlines()]
                ids = [f[0] for f in lines if f[1].startswith(f"127.0.0.1:{port}@")]
                found.extend(
                    _port(f[1]) for f in lines if ids and f[3] == ids[0] and "fail" not in f[2]
                )
                if found:
                    return True
            return False

        _wait(known, f"a node knows the replica of {port}")
        return found[0]

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port``."""
        self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait(10)

    def spawn(self, port: int) -> None:
        """Start the node on ``port`` (again: with its ``nodes.conf``, no data)."""
        node = self.folder / str(port)
        node.mkdir(exist_ok=True)
        self.processes[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-config-file", str(node / "nodes.conf"),
             "--cluster-node-timeout", "2000", "--cluster-replica-validity-factor", "0",
             "--dir", str(node), "--save", "", "--appendonly", "no",
             "--repl-diskless-sync-delay", "0"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        _wait(lambda: self.cli(port, "PING").strip() == "PONG", "a node starts")

    def primaries(self) -> list[int]:
        """The ports of the primaries that serve slots now, as a live node sees them."""
        live = next(p for p in self.ports if self.processes[p].poll() is None)
        found = []
        for line in self.cli(live, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2] and len(fields) > 8:
                found.append(_port(fields[1]))
        return sorted(found)

    def in_sync(self, port: int) -> bool:
        """Whether the node on ``port`` is a replica whose link to its primary is up."""
        return "master_link_status:up" in self.cli(port, "INFO", "replication")

    def cut_replication(self, primary: int, replica: int) -> None:
        """What ``primary`` writes from now on never reaches ``replica``, which takes over
        when ``primary`` dies (replication is asynchronous). The primary now wants a password
        that the replica does not have, so the link stays down; connections open to it
        already stay open."""
        self.cli(primary, "CONFIG", "SET", "requirepass", "not-for-the-replica")
        self.cli(replica, "CLIENT", "KILL", "TYPE", "master")

    def fail_over(self, victim: int, cut: float = 0.0) -> None:
        """SIGKILL the primary on ``victim`` (first cutting its replica off for ``cut``
        seconds, so that the writes of that moment are lost as replication lag loses them),
        wait until its replica serves its slots, then start it again: it comes back as the
        replica of its former one, in sync."""
        replica = self.replica_of(victim)
        if cut:
            self.cut_replication(victim, replica)
            time.sleep(cut)
        self.kill(victim)
        survivors = [p for p in self.ports if p != victim]
        _wait(
            lambda: (
                replica in self.primaries()
                and all("cluster_state:ok" in self.cli(p, "CLUSTER", "INFO") for p in survivors)
            ),
            "the replica takes over",
        )
        self.spawn(victim)
        _wait(lambda: self.in_sync(victim), "the old primary is a replica in sync", 60.0)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


def _serving(spans: list[tuple[int, int, int]], slot: int) -> int:
    """The port serving ``slot`` in ``spans`` (``Cluster.slot_spans``), or 0 if none does."""
    return next((port for first, last, port in spans if first <= slot <= last), 0)


def _port(address: str) -> int:
    """The port of a node's address in ``CLUSTER NODES`` (``127.0.0.1:7000@17000``)."""
    return int(address.split(":")[1].split("@", maxsplit=1)[0])


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_cluster() -> Cluster:
    """Six nodes (a node's bus port is its port + 10000), ``cluster_state:ok``."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        unavailable("redis-server is not installed (apt-get install redis-server)")
    for _ in range(50):
        # Bus ports (port + 10000) below 32768, where Linux's ephemeral ports begin: a
        # bus port in that range may be taken by some client's connection between the
        # check below and the node's bind (the likely cause of one cluster test ERROR).
        base = random.randrange(20000, 22700)
        ports = list(range(base, base + 6))
        if all(_free(p) and _free(p + 10000) for p in ports):
            break
    folder = Path(tempfile.mkdtemp(prefix="dlock-cluster-"))
    cluster = Cluster(ports, folder)
    for port in ports:
        cluster.spawn(port)
    nodes = [f"127.0.0.1:{port}" for port in ports]
    subprocess.run(
        ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1",
         "--cluster-yes"],
        capture_output=True, timeout=60, check=True,
    )  # fmt: skip
    for port in ports:
        _wait(
            lambda port=port: "cluster_state:ok" in cluster.cli(port, "CLUSTER", "INFO"),
            "the cluster is ok",
        )
    # Each replica in sync with its primary, so that it can take over from it.
    replicas = [p for p in ports if "role:slave" in cluster.cli(p, "INFO", "replication")]
    for port in replicas:
        _wait(lambda port=port: cluster.in_sync(port), "a replica is in sync")
    return cluster


def _wait(ready: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting until {what}")
        time.sleep(0.1)


_shared: list[Cluster] = []


def shared_cluster() -> Cluster:
    """The run's cluster, started at first use."""
    if not _shared:
        _shared.append(start_cluster())
        atexit.register(_shared[0].stop)
    return _shared[0]
