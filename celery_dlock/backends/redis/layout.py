"""Where the Redis backend keeps things: the names of its Redis keys.

Every name starts with a hash tag, ``{<prefix>}`` (or ``{<prefix>:<bucket>}`` when the
namespace is split into buckets), and the lock key comes last, verbatim::

    {dlock}:lock:job:order:42        the lock: the token, expiring by Redis's clock
    {dlock}:state:job:order:42       fence, lease (kept until recorded), last release
    {dlock}:signal:job:order:42      wake-ups for waiters
    {dlock}:success:12:tasks.charge:job:order:42    last success of a task (for once)
    {dlock}:index                    keys with a lease, scored by expiry
    {dlock}:history                  the capped stream of records
    {dlock}:epoch  {dlock}:quarantine    notice that Redis lost its data
    {dlock}:server                   the LASTSAVE and run_id of the server last seen
    {dlock}:layout                   ``buckets=N``: how the namespace is split (below)
    {dlock}:synced                   written before a ``WAIT`` (``replicas=N``; see replicas.py)

Redis Cluster hashes only what is between the first ``{`` and the next ``}``. The prefix
may not hold braces, so the tag is always ours whatever the lock key holds (braces,
colons, anything): all keys of a lock, *and* the index and history it writes, share one
slot, and each script touches one slot only. With ``buckets`` > 1 a key's bucket is its
CRC-32 modulo ``buckets``, which spreads the namespace over that many slots; readers of
the whole namespace (``history``, ``leases``, ``reap``) then visit every bucket.

Processes whose ``buckets`` differ name one lock by different keys, so both would hold it:
each process records its count in ``{prefix}:layout`` at its first call (``SET NX GET``),
on a Redis Cluster in the slots ``{prefix:0}`` .. ``{prefix:15}`` too (``Layout.markers``),
and one that finds another count in any of them refuses to work (:meth:`Layout.check`).
The keys go when Redis loses its data: a process claims them all again when an acquire
meets an epoch it has not seen (a new one after the loss, or a bucket's first, which
cannot tell a loss from a first use), and refuses to acquire while another count is
claimed in any (``Calls.judge``; each acquire then claims again, so that it works again
once the keys are its own). To change ``buckets``, stop every process of the namespace and
delete those keys. A cluster's node that loses some of the keys (a flush, a failover to an
empty replica) leaves the others to speak: a process started since with another count is
refused by those that survive. Not covered: the loss of all seventeen at once while an old
process's bucket beyond the sixteenth survives on another node
(tests/backends/test_redis_layout_trial.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import NamedTuple

from celery_dlock.errors import ConfigurationError

__all__ = ["MARKED_BUCKETS", "Layout", "LockNames"]

#: On a Redis Cluster the layout is also recorded in the slots of buckets 0 .. this - 1
#: (see ``Layout.markers``): the buckets of any split up to this count.
MARKED_BUCKETS = 16


class LockNames(NamedTuple):
    """The Redis keys one lock uses, in the order the scripts take them, and the key."""

    lock: bytes
    state: bytes
    leases: bytes
    history: bytes
    signal: bytes
    epoch: bytes
    quarantine: bytes
    server: bytes
    raw: bytes


class Layout:
    """Key names for one namespace (``prefix``) split into ``buckets`` hash slots."""

    def __init__(self, prefix: str, buckets: int = 1, *, cluster: bool = False) -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise ConfigurationError(
                f"the redis key prefix must be non-empty and hold no braces, not {prefix!r} "
                "(braces would change the cluster hash tag)"
            )
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise ConfigurationError(f"buckets must be an integer >= 1, not {buckets!r}")
        self.prefix = prefix
        self.buckets = buckets
        #: Whether the namespace lives on a Redis Cluster, whose nodes lose data apart.
        self.cluster = cluster
        self._tags = [self._tag(bucket) for bucket in range(buckets)]
        self._cache: dict[str, LockNames] = {}

    @property
    def marker(self) -> bytes:
        """The key that records how this namespace is split: ``{prefix}:layout``."""
        return b"{" + self.prefix.encode() + b"}:layout"

    @property
    def markers(self) -> tuple[bytes, ...]:
        """The keys that record it: the marker, and on a cluster one in the slot of each
        bucket of any split up to ``MARKED_BUCKETS`` (and of each of this one's beyond),
        ``{prefix:<b>}:layout``. A single Redis loses its data whole; a cluster's nodes
        lose theirs apart, and a node that lost the marker leaves these to speak: a
        process with another split finds the old count in those that survive, whichever
        of its own buckets were lost, and is refused."""
        if not self.cluster:
            return (self.marker,)
        spread = max(self.buckets, MARKED_BUCKETS)
        tags = (b"{%b:%d}:" % (self.prefix.encode(), bucket) for bucket in range(spread))
        return (self.marker, *(tag + b"layout" for tag in tags))

    def claims(self) -> tuple[tuple[bytes, ...], ...]:
        """The commands that record this process's ``buckets`` in each of :attr:`markers`
        unless one is recorded there, and answer the one recorded: each reply goes to
        :meth:`check`."""
        mine = b"buckets=%d" % self.buckets
        return tuple((b"SET", marker, mine, b"NX", b"GET") for marker in self.markers)

    def check(self, found: object, marker: bytes | None = None) -> None:
        """Refuse a namespace that another process splits into another number of buckets
        (``found``: the reply of one of :meth:`claims`, the one for ``marker``)."""
        mine = b"buckets=%d" % self.buckets
        if found is None or found == mine:
            return
        theirs = found.decode(errors="replace") if isinstance(found, bytes) else repr(found)
        where = (marker or self.marker).decode(errors="replace")
        keys = self.marker.decode()
        if self.cluster:
            keys += f" and each {{{self.prefix}:<n>}}:layout"
        raise ConfigurationError(
            f"the redis namespace {self.prefix!r} is split as {theirs} by another process "
            f"({where}), and as buckets={self.buckets} here: the two would name one lock by "
            "two keys and both hold it. Give every process the same buckets; to change it, "
            f"stop them all and delete {keys}"
        )

    def check_all(self, replies: Sequence[object]) -> None:
        """:meth:`check` each reply of :meth:`claims` (None: the command was refused, as
        by an ACL or a replica, which the doctor reports)."""
        for marker, found in zip(self.markers, replies, strict=True):
            self.check(found, marker)

    def _tag(self, bucket: int) -> bytes:
        text = self.prefix if self.buckets == 1 else f"{self.prefix}:{bucket}"
        return b"{" + text.encode() + b"}:"

    def bucket(self, key: str) -> int:
        if self.buckets == 1:
            return 0
        return zlib.crc32(key.encode("utf-8", "surrogatepass")) % self.buckets

    def by_bucket(self, keys: Sequence[str]) -> list[list[str]]:
        """``keys`` grouped by bucket: the names one command may take on a cluster. With 16
        buckets (a cluster's default) a lock's slots ``key#0`` .. ``key#9`` are each in a
        bucket of its own, whatever the key: CRC-32 is linear, so two names that differ in
        one character differ by a constant (checked for every pair, 300 random keys)."""
        groups: dict[int, list[str]] = {}
        for key in keys:
            groups.setdefault(self.bucket(key), []).append(key)
        return list(groups.values())

    def names(self, key: str) -> LockNames:
        """The keys of ``key``'s lock (cached: the hot path asks for the same few keys)."""
        names = self._cache.get(key)
        if names is None:
            tag = self._tags[self.bucket(key)]
            raw = key.encode("utf-8", "surrogatepass")
            names = LockNames(
                tag + b"lock:" + raw,
                tag + b"state:" + raw,
                tag + b"index",
                tag + b"history",
                tag + b"signal:" + raw,
                tag + b"epoch",
                tag + b"quarantine",
                tag + b"server",
                raw,
            )
            if len(self._cache) >= 4096:
                self._cache.clear()
            self._cache[key] = names
        return names

    def result(self, key: str, task_name: str) -> bytes:
        """The kept result of ``task_name`` on ``key``; the task name's length
        keeps names unambiguous whatever either holds."""
        task = task_name.encode("utf-8", "surrogatepass")
        raw = key.encode("utf-8", "surrogatepass")
        return self._tags[self.bucket(key)] + b"success:%d:" % len(task) + task + b":" + raw

    def forget_mark(self, key: str, task_name: str) -> bytes:
        """What a forget of ``task_name``'s result on ``key`` leaves for its retries: in the
        result's slot (its hash tag), its name after ``forgotten:``."""
        tag = self._tags[self.bucket(key)]
        return tag + b"forgotten:" + self.result(key, task_name)[len(tag) + len(b"success:") :]

    def synced(self, key: str) -> bytes:
        """The key written in ``key``'s slot before a ``WAIT`` for replicas."""
        return self._tags[self.bucket(key)] + b"synced"

    def index(self, bucket: int) -> bytes:
        return self._tags[bucket] + b"index"

    def history(self, bucket: int) -> bytes:
        return self._tags[bucket] + b"history"
