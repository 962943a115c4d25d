"""A network a holder can be cut off from: a network namespace joined to the host by a veth
pair, and nftables rules that drop its packets (``nft``, Debian's ``nftables``; root only).

The namespace's end has ``10.A.B.2``, the host's end ``10.A.B.1``, where the private store
also listens (``servers.py``). ``cut()`` drops every packet *arriving* on either end: the
holder's packets vanish on their way to the store and the store's on their way back, after
each sender has handed them to the link, so no sender sees an error and no socket is closed
or refused (no RST, no ICMP); the store's TCP keepalives, or the lease's ttl, are what end
it. ``heal()`` lets packets through again. The rules live in two tables of their own (one
per namespace, named after the run), deleted at ``close()`` with the namespace and its pair.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

__all__ = ["Network", "unavailable"]


def _run(*argv: str, stdin: str | None = None) -> None:
    done = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stdout}{done.stderr}".strip())


def unavailable() -> str | None:
    """Why partitions cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces and nftables need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y {package})"
    return None


class Network:
    """A namespace for the holders that partitions cut off, and the rules that cut them."""

    def __init__(self, run_id: str) -> None:
        self.name = f"dlock-torture-{run_id}"
        self.table = f"dlock_torture_{run_id}"
        self.host_end, self.inner_end = f"dlt{run_id}h", f"dlt{run_id}n"
        subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        self.host, self.inner = f"{subnet}.1", f"{subnet}.2"
        self.subnet = f"{subnet}.0/30"
        self._made = False

    def start(self) -> None:
        """Make the namespace, the pair and the (empty) drop chains (``close()`` undoes a
        start that failed half way)."""
        self._made = True
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.host_end, "type", "veth", "peer", "name", self.inner_end)
        _run("ip", "link", "set", self.inner_end, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host}/30", "dev", self.host_end)
        _run("ip", "link", "set", self.host_end, "up")
        for argv in (
            ("ip", "addr", "add", f"{self.inner}/30", "dev", self.inner_end),
            ("ip", "link", "set", self.inner_end, "up"),
            ("ip", "link", "set", "lo", "up"),
        ):
            _run(*self.inside(list(argv)))
        # (table) | a chain at the earliest hook for the rule that drops what arrives
        chain = (
            "table inet {t} {{\n chain cut {{\n"
            "  type filter hook prerouting priority -400;\n }}\n}}\n"
        )
        _run("nft", "-f", "-", stdin=chain.format(t=self.table))
        _run(*self.inside(["nft", "-f", "-"]), stdin=chain.format(t=self.table))

    def inside(self, argv: list[str]) -> list[str]:
        """``argv`` run in the namespace (``ip netns exec`` execs it: the pid is its own)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def _rule(self, verb: str) -> None:
        for inside, device in ((False, self.host_end), (True, self.inner_end)):
            if verb == "add":
                argv = ["nft", "add", "rule", "inet", self.table, "cut", "iifname", device, "drop"]
            else:
                argv = ["nft", "flush", "chain", "inet", self.table, "cut"]
            _run(*(self.inside(argv) if inside else argv))

    def cut(self) -> None:
        """Drop every packet between the namespace and the host from now on."""
        self._rule("add")

    def heal(self) -> None:
        """Let packets through again."""
        self._rule("flush")

    def close(self) -> None:
        """Delete the host's table, the namespace (its table and the pair go with it)."""
        if not self._made:
            return
        table, namespace = ["nft", "delete", "table", "inet", self.table], ["ip", "netns", "del"]
        for argv in (table, [*namespace, self.name]):
            subprocess.run(argv, check=False, capture_output=True)
        self._made = False
