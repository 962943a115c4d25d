"""Ends that count once replicas have them: the ``replicas=N`` option of a Redis store.

Redis replicates asynchronously: a primary acknowledges a write before its replicas have
it, and a failover to a replica that lacks it loses it (so does a restart from an RDB
snapshot, or with ``appendfsync everysec``). A lost *grant* is survivable: the fence is
above it and ``restart_delay`` lets its holder notice. A lost *end* is not: a release
comes back as a lease held until its ttl ends, a ``once`` success lost lets the task run
again, and a dedupe mark's release lost has every call of its key coalesced into a
message that has already run, until ``dedupe_ttl`` ends.

With ``replicas=N``, each call that ends a lease or keeps or forgets a success
(``release``, ``add_record``, ``remember``, ``forget_success``) is followed, on the
primary of its hash slot, by a write of its bucket's ``synced`` key and ``WAIT N
<replicas_timeout>``: pipelined with a release (one round trip for the three), in one more
round trip after the others. The write is what makes the ``WAIT``
cover the call before it, whatever connection carried that call: ``WAIT`` waits for the
replication offset of its own connection's last write, and a call that wrote nothing (a
release tried again after its first try landed, which finds the lease gone) would
otherwise be confirmed by an older write of that connection, or by none.

Fewer than N replicas acknowledging within the timeout is a :class:`BackendError`: the
change is made on the primary but not yet safe from a failover. Callers treat it as any
store failure (a body lock's release is tried again at the process's next release, an
``until_started`` message is re-queued under its mark, a ``once`` success is retried for
``success_retry``), and a try again confirms it by its own write and ``WAIT``. So a replica
down for long stops what ends leases on its primary: off by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from celery_dlock.backends.redis.client import Client
from celery_dlock.backends.redis.resp import bulks
from celery_dlock.backends.redis.scripts import Script
from celery_dlock.errors import BackendError, ConfigurationError

__all__ = ["REPLICAS_TIMEOUT", "Replicas"]

#: How long a bucket's ``synced`` key lives after its last write (it holds nothing).
_SYNCED_MS = b"60000"
#: Seconds a release waits for the replicas by default (``replicas_timeout``): a replica
#: just started or resumed acknowledges within a second (its ``REPLCONF ACK``).
REPLICAS_TIMEOUT = 1.0


class Replicas:
    """The ``replicas`` and ``replicas_timeout`` options of one store.

    Raises:
        ConfigurationError: ``count`` is not a whole number >= 0, or ``timeout`` is not
            positive seconds shorter than ``socket_timeout`` (the ``WAIT``'s reply is read
            within it).
    """

    def __init__(self, count: int, timeout: float, socket_timeout: float) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigurationError(f"replicas must be a whole number >= 0, not {count!r}")
        if not 0 < timeout < socket_timeout:
            raise ConfigurationError(
                f"replicas_timeout must be positive seconds below socket_timeout "
                f"({socket_timeout:g}), not {timeout!r}"
            )
        self.count = count
        self.timeout = float(timeout)
        self._wait = b"*3\r\n" + bulks([b"WAIT", count, round(timeout * 1000)])

    @staticmethod
    def of(count: int, timeout: float | None, socket_timeout: float) -> Replicas | None:
        """The options given to a store: None for ``replicas=0`` (nothing waited for).

        Raises:
            ConfigurationError: as ``Replicas``, or a ``timeout`` without replicas (a
                ``replicas=N`` left out by mistake).
        """
        if count == 0 and timeout is not None:
            raise ConfigurationError("replicas_timeout means nothing without replicas=N (N >= 1)")
        if count == 0 and not isinstance(count, bool):
            return None
        return Replicas(count, REPLICAS_TIMEOUT if timeout is None else timeout, socket_timeout)

    def confirm(self, client: Client, synced: bytes, operation: str, key: str) -> None:
        """Return once ``count`` replicas of the primary of ``synced``'s slot have every
        write it took before this call (``operation`` of ``key``, for the error).

        Raises:
            BackendError: fewer replicas acknowledged within the timeout, or the store
                failed.
        """
        _, acknowledged = client.pipeline_at(synced, [_write(synced), self._wait], operation, key)
        self._judge(acknowledged, client, operation, key)

    def run(
        self,
        client: Client,
        synced: bytes,
        script: Script,
        parts: tuple[int, bytes, Callable[[], bytes]],
        key: str,
    ) -> Any:
        """The reply of ``script`` (a ``RELEASE``: ``parts`` are its count, tail and the tail
        of a try again, as ``Client.run`` takes them), run with a ``WAIT`` pipelined on one
        connection: one round trip. A first try that released the lease wrote on that
        connection, which the ``WAIT`` then covers; one that found the lease gone wrote
        nothing, and a try again may follow a first that landed on another connection:
        those are confirmed by :meth:`confirm`'s write and ``WAIT`` (pipelined with a try
        again; apart after a first try). A ``NOSCRIPT`` (the script not loaded on that
        node) runs it by its source, then confirms apart.

        Raises:
            BackendError: fewer replicas acknowledged within the timeout, or the store
                failed.
        """
        count, tail, again = parts
        write = _write(synced)
        wire = client.connections()
        tries = 0

        def send() -> list[Any]:
            nonlocal tail, tries
            if tries:  # a try again tells the script it may be a repeat
                tail = again()
            tries += 1
            command = b"*%d\r\n%b%b" % (count + 2, script.by_sha, tail)
            confirming = [self._wait] if tries == 1 else [write, self._wait]
            return wire.send_all_at(synced, [command, *confirming])

        replies = client.retried(send, "release", key)
        reply, acknowledged = replies[0], replies[-1]
        if isinstance(reply, NoScriptError):
            reply = client.run(
                script, count, tail, operation="release", key=key, again=again, wire=wire
            )
            self.confirm(client, synced, "release", key)
            return reply
        failed = next((r for r in replies if isinstance(r, ResponseError)), None)
        if failed is not None:
            raise client.error("release", key, failed)
        if reply == 0 and len(replies) == 2:  # nothing written before that WAIT
            self.confirm(client, synced, "release", key)
        else:
            self._judge(acknowledged, client, "release", key)
        return reply

    def _judge(self, acknowledged: int, client: Client, operation: str, key: str) -> None:
        """Raise unless ``acknowledged`` (a ``WAIT``'s reply) reaches ``count``."""
        if acknowledged < self.count:
            raise BackendError(
                f"redis {operation} of {key!r} is done on the primary, but {acknowledged} of "
                f"the {self.count} replicas asked for (replicas={self.count}) had it within "
                f"{self.timeout:g} s: not yet safe from a failover; it is tried again",
                client.url,
            )


def _write(synced: bytes) -> bytes:
    """The write of a bucket's ``synced`` key that a ``WAIT`` behind it covers."""
    return b"*5\r\n" + bulks([b"SET", synced, b"1", b"PX", _SYNCED_MS])
