"""Redis Cluster: commands routed to the primary of their key's hash slot, following
``MOVED`` and ``ASK``, on the same raw connections as a single Redis.

Every command the backend sends names its keys in one slot (the layout's hash tags), so
routing one command is routing its first key. The map of slots to primaries comes from
``CLUSTER SLOTS`` of any node that answers; it is read again after a ``MOVED`` (a slot
moved, or a replica took over from a failed primary) and after a node failed to answer.
An ``ASK`` (a slot being migrated) sends the command once to the node named, after
``ASKING``. ``CLUSTERDOWN`` and ``TRYAGAIN`` are waited out for a short while.
"""

from __future__ import annotations

import time
from typing import Any

from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_dlock.backends.redis.client import Connections
from celery_dlock.backends.redis.resp import bulks

__all__ = ["ClusterConnections"]

#: Redirections and waits one command may meet before its error is raised.
_HOPS = 8
#: Pause before trying again while the cluster is down or a slot is being moved.
_SETTLING = 0.1
_ASKING = b"*1\r\n$6\r\nASKING\r\n"
_KEYLESS = frozenset({b"TIME", b"INFO", b"SCRIPT", b"PING"})

Node = tuple[str, int]


def _bulks(packed: bytes, count: int) -> list[bytes]:
    """The first ``count`` bulk strings of a packed command (``*N`` header included)."""
    parts: list[bytes] = []
    at = packed.index(b"\r\n") + 2 if packed.startswith(b"*") else 0
    while len(parts) < count and at < len(packed):
        end = packed.index(b"\r\n", at)
        size = int(packed[at + 1 : end])
        parts.append(packed[end + 2 : end + 2 + size])
        at = end + 2 + size + 2
    return parts


def routing_key(packed: bytes) -> bytes | None:
    """The key a packed command is routed by: an ``EVAL``/``EVALSHA``'s first key, another
    command's first argument; None for a command without keys."""
    head = _bulks(packed, 4)
    name = head[0].upper()
    if name in (b"EVALSHA", b"EVAL"):
        return head[3] if len(head) > 3 and head[2] != b"0" else None
    if name in _KEYLESS or len(head) < 2:
        return None
    return head[1]


class ClusterConnections:
    """This process's connections to a Redis Cluster: idle connections per node, the map
    of slots to primaries, and the acquires whose reply was lost (as ``Connections``)."""

    def __init__(self, connection: dict[str, Any], nodes: list[Node]) -> None:
        self._template = {k: v for k, v in connection.items() if k not in ("host", "port")}
        self._seeds = list(nodes)
        self._nodes: dict[Node, Connections] = {}
        self._slots: list[Node] = []
        #: Every primary of every map read, kept when the map is cleared.
        self._known: dict[Node, None] = {}
        self.doubtful: list[tuple[str, str]] = []

    def _node(self, node: Node) -> Connections:
        found = self._nodes.get(node)
        if found is None:
            found = self._nodes[node] = Connections(
                {**self._template, "host": node[0], "port": node[1]}
            )
        return found

    def refresh(self) -> None:
        """Read the map of slots to primaries from the first node that answers: of the
        current map, the URL's, then every node this process has known (the URL may name
        only a node that died, whose replica took its slots)."""
        failure: Exception | None = None
        for node in [*dict.fromkeys([*self._slots, *self._seeds, *self._known, *self._nodes])]:
            try:
                ranges = self._node(node).call("CLUSTER", "SLOTS")
            except (RedisConnectionError, RedisTimeoutError) as exc:
                failure = exc
                continue
            slots: list[Node] = [node] * 16384
            for first, last, primary, *_ in ranges:
                host = primary[0].decode() or node[0]
                slots[first : last + 1] = [(host, int(primary[1]))] * (last - first + 1)
            self._slots = slots
            self._known.update(dict.fromkeys(slots))
            return
        raise failure or RedisConnectionError("no node of the cluster answered")

    def _route(self, packed: bytes) -> Node:
        if not self._slots:
            self.refresh()
        key = routing_key(packed)
        return self._slots[0] if key is None else self._slots[key_slot(key)]

    def send(
        self, packed: bytes, count: int, timeout: float | None = None, simple: bool = False
    ) -> Any:
        """``Connections.send`` to the primary of the command's slot."""
        node = self._route(packed)
        for hop in range(_HOPS):
            try:
                try:
                    return self._node(node).send(packed, count, timeout, simple)
                except AskError as ask:
                    return self._ask(ask, b"*%d\r\n%b" % (count, packed))
            except MovedError as moved:
                self.refresh()
                node = (moved.host, int(moved.port))
            except (ClusterDownError, TryAgainError):
                # A multi-key command in a slot being migrated gets TRYAGAIN, from either
                # node, while its keys are split between them.
                if hop == _HOPS - 1:
                    raise
                time.sleep(_SETTLING)
            except (RedisConnectionError, RedisTimeoutError):
                self._slots = []  # a primary failed: a replica may take its slots
                raise
        raise ClusterDownError(f"gave up after {_HOPS} redirections")

    def _ask(self, ask: AskError, command: bytes) -> Any:
        """``command`` once on the node an ``ASK`` named, after ``ASKING``. Its reply comes
        back through ``send_all``, which returns errors: raise them here, so a ``NOSCRIPT``
        (the script not loaded on that node yet) or a ``TRYAGAIN`` reaches its handler."""
        target = self._node((ask.host, int(ask.port)))
        reply = target.send_all([_ASKING, command])[1]
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    def call(self, *args: Any, timeout: float | None = None) -> Any:
        return self.send(bulks(args), len(args), timeout)

    def send_all(self, commands: list[bytes]) -> list[Any]:
        """``Connections.send_all`` on the primary of each command's slot: one round trip
        per node for its commands (a batch of one slot: one in all). A command redirected
        (``MOVED``, ``ASK``) or told to try again (a slot being migrated) is sent again on
        its own through ``send``; as there, an error reply is returned, not raised."""
        by_node: dict[Node, list[int]] = {}
        for at, command in enumerate(commands):
            by_node.setdefault(self._route(command.split(b"\r\n", 1)[1]), []).append(at)
        replies: list[Any] = [None] * len(commands)
        for node, indexes in by_node.items():
            try:
                answered = self._node(node).send_all([commands[at] for at in indexes])
            except (RedisConnectionError, RedisTimeoutError):
                self._slots = []  # a primary failed: a replica may take its slots
                raise
            for at, reply in zip(indexes, answered, strict=True):
                replies[at] = reply
        for at, reply in enumerate(replies):
            if isinstance(reply, MovedError | AskError | TryAgainError | ClusterDownError):
                header, body = commands[at].split(b"\r\n", 1)
                try:
                    replies[at] = self.send(body, int(header[1:]))
                except ResponseError as exc:
                    replies[at] = exc
        return replies

    def send_all_at(self, key: bytes, commands: list[bytes]) -> list[Any]:
        """``commands`` on one connection to the primary of ``key``'s slot, where every
        one of them runs (a ``WAIT`` after a write must reach that write's node): a
        ``MOVED`` first reply sends them all again to the node named, an ``ASK`` one each
        after an ``ASKING``; as in ``send_all``, an error reply is returned, not raised."""
        if not self._slots:
            self.refresh()
        node = self._slots[key_slot(key)]
        for hop in range(_HOPS):
            try:
                replies = self._node(node).send_all(commands)
            except (RedisConnectionError, RedisTimeoutError):
                self._slots = []  # a primary failed: a replica may take its slots
                raise
            first = replies[0]
            if isinstance(first, MovedError):
                self.refresh()
                node = (first.host, int(first.port))
            elif isinstance(first, AskError):
                # ASKING admits the one command after it: each is sent after its own.
                target = self._node((first.host, int(first.port)))
                asked = [part for command in commands for part in (_ASKING, command)]
                return target.send_all(asked)[1::2]
            elif isinstance(first, ClusterDownError | TryAgainError) and hop < _HOPS - 1:
                time.sleep(_SETTLING)
            else:
                return replies
        raise ClusterDownError(f"gave up after {_HOPS} redirections")

    def close(self) -> None:
        for connections in self._nodes.values():
            connections.close()
