"""What each hot call of the Redis backend sends and what its reply means, apart from how
it is sent: the blocking client (``RedisBackend``) and the asyncio one (``AsyncRedis``)
share these, so both speak the same scripts the same way.

Each call is a ``*_call`` method that packs it and a method that reads its reply; the
packed parts that never change for a key are packed once (``segment``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace as with_fields
from typing import Any

from celery_dlock.backends.base import remembered, validate_ttl
from celery_dlock.backends.common import retried_details, taken_over
from celery_dlock.backends.redis.fields import encode_json, holder_json, optional_seconds
from celery_dlock.backends.redis.layout import Layout
from celery_dlock.backends.redis.resp import bulks
from celery_dlock.errors import ConfigurationError
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token

__all__ = ["FALLBACK", "TURN", "Calls", "ms"]

#: How long a release's wake-up waits in the signal list for a waiter, in ms.
_SIGNAL_MS = "1000"
#: Longest single BLPOP: a wake-up can be lost (its waiter died before taking the key), so
#: waiters look again at least this often. ``Lock`` polls every second on its own anyway;
#: this bounds direct callers, and stays above the contract's 10 s test of the push.
FALLBACK = 15.0
#: Longest ``BLPOP`` on one bucket's signal lists when a wait for several keys spans buckets
#: (on a cluster one command stays in one hash slot): the buckets take turns.
TURN = 0.1
#: Parts of an ``ACQUIRE`` and of a ``RELEASE`` after ``EVALSHA sha``: the number of keys,
#: the keys (8; 5, or 6 with a result to keep), the 3 shared arguments and the lock's key,
#: then 8 and 7 of their own.
_ACQUIRE_PARTS = 1 + 8 + 4 + 8
_RELEASE_PARTS = 1 + 5 + 4 + 7
#: Packed: no lease to take over, and no details for its record (an acquire's last parts).
_NONE_REPLACED = bulks(["", ""])
#: Packed: each outcome, and a record's problem, details and result all null.
_OUTCOMES = {outcome: bulks([outcome.value]) for outcome in Outcome}
_NULLS = bulks(["null"] * 3)
#: The details of a lease released because the reply to its acquire was lost.
_SETTLED = encode_json(
    "the reply to this acquire was lost; its lease was released once Redis answered"
)


def ms(seconds: float) -> str:
    """``seconds`` as whole milliseconds (at least 1), as the scripts take them."""
    return str(max(1, round(seconds * 1000)))


class Calls:
    """The packing and replies of one backend's script calls.

    Args:
        layout: where each key's parts live.
        history_maxlen, gc_after, restart_delay, success_ttl: the backend's options.
        slack: extra seconds a blocking read may take beyond its own timeout.
    """

    def __init__(
        self,
        layout: Layout,
        *,
        history_maxlen: int,
        gc_after: float,
        restart_delay: float,
        success_ttl: float,
        slack: float,
        default_ttl: float | None = None,
    ) -> None:
        self.layout = layout
        #: The ttl of a lease asked for with none (the ``ttl`` option): its only liveness.
        self.default_ttl = default_ttl
        #: The arguments every lease-ending script takes first.
        self.common = (str(history_maxlen), ms(gc_after), _SIGNAL_MS)
        self.success_ms = ms(success_ttl)
        self.slack = slack
        self._restart_ms = bulks(["0" if restart_delay == 0 else ms(restart_delay)])
        self._ttls: dict[float | None, bytes] = {}
        # The epoch seen per bucket: knowledge, not a resource, so a forked child keeps it.
        self._epochs: dict[bytes, bytes] = {}
        #: Whether an acquire met an epoch not seen before since the layout was last
        #: claimed: a new one (Redis lost its data, the layout's marker with it) or a
        #: bucket's first, which cannot tell a loss from a first use (the store claims the
        #: marker again).
        self.lost_data = False
        #: Why this process may not acquire: the layout claimed again after a loss found
        #: another split (``judge``); None while it may (each acquire claims again till then).
        self.refused: str | None = None
        self._holder: tuple[Holder, bytes] | None = None
        self._segments: dict[tuple[str, int], bytes] = {}

    def _segment_count(self, numkeys: int) -> int:
        """How many parts ``_segment(key, numkeys)`` packs."""
        return 2 + numkeys + len(self.common)

    def _segment(self, key: str, numkeys: int) -> bytes:
        """The packed parts of a script call on ``key`` that never change: the number of
        keys, the first ``numkeys`` keys, the shared arguments and the key itself."""
        segment = self._segments.get((key, numkeys))
        if segment is None:
            names = self.layout.names(key)
            segment = bulks([numkeys, *names[:numkeys], *self.common, names.raw])
            if len(self._segments) >= 4096:
                self._segments.clear()
            self._segments[key, numkeys] = segment
        return segment

    def _ttl_ms(self, ttl: float | None) -> bytes:
        """``ttl`` packed as the scripts take it (empty: none), for the few ttls in use."""
        packed = self._ttls.get(ttl)
        if packed is None:
            packed = bulks(["" if ttl is None else ms(ttl)])
            if len(self._ttls) >= 64:
                self._ttls.clear()
            self._ttls[ttl] = packed
        return packed

    def _holder_json(self, holder: Holder) -> bytes:
        """The holder as stored, for the last holder seen (a worker acquires as one)."""
        cached = self._holder
        if cached is not None and cached[0] is holder:
            return cached[1]
        text = holder_json(holder).encode()
        self._holder = (holder, text)
        return text

    # -- acquire ---------------------------------------------------------------------------

    def acquire_call(
        self, key: str, holder: Holder, ttl: float | None, replace: str | None
    ) -> tuple[list[str], int, bytes, Callable[[], bytes]]:
        """The tokens tried (one now; the retry adds its own), the part count and packed
        tail of an ``ACQUIRE``, and the tail of its retry: a fresh token and the earlier
        ones, so that a try whose lease Redis expired is never granted again."""
        ttl = validate_ttl(self.default_ttl if ttl is None else ttl)
        tokens = [new_token()]
        head = self._segment(key, 8)
        text = self._holder_json(holder)
        epoch = self._epochs.get(self.layout.names(key).epoch, b"")
        # ttl, holder, epoch, quarantine, the token of a lease to take over and its details
        args = b"%b$%d\r\n%b\r\n$%d\r\n%b\r\n%b%b" % (
            self._ttl_ms(ttl),
            len(text),
            text,
            len(epoch),
            epoch,
            self._restart_ms,
            _NONE_REPLACED
            if replace is None
            else bulks([replace, encode_json(retried_details(holder))]),
        )

        def again() -> bytes:
            earlier = " ".join(tokens)
            tokens.append(new_token())
            return head + bulks([tokens[-1]]) + args + bulks([earlier])

        tail = b"%b$%d\r\n%b\r\n%b$0\r\n\r\n" % (head, len(tokens[0]), tokens[0].encode(), args)
        return tokens, _ACQUIRE_PARTS, tail, again

    def acquired(self, key: str, holder: Holder, token: str, reply: bytes) -> Lease | None:
        """The lease an ``ACQUIRE`` sent last as ``token`` grants (or an earlier try of it,
        whose token the reply names), or None; the epoch it reports kept, and the expired
        lease it recorded counted (``taken_over``)."""
        parts = reply.split()
        if parts[-1] == b"expired":
            taken_over(Outcome.EXPIRED)
            parts.pop()
        if len(parts) == 5:
            fence, acquired, expires, _, earlier = parts
            token = earlier.decode()
        else:
            if parts[-1] != b"-":
                self._saw(self.layout.names(key).epoch, parts[-1])
            if len(parts) == 2:
                return None
            fence, acquired, expires, _ = parts
        return Lease(key, token, int(fence), holder, float(acquired), optional_seconds(expires))

    def _saw(self, name: bytes, epoch: bytes) -> None:
        """Keep the ``epoch`` an acquire's reply names for its bucket; one that differs from
        the epoch seen before is a loss of Redis's data (the scripts begin a new epoch). So
        is a bucket's first, maybe: a process that saw no epoch of it before the loss (it
        only read, released or renewed, or used other buckets) cannot tell, and a process
        with another split may have claimed the lost marker meanwhile."""
        if self._epochs.get(name) != epoch:
            self.lost_data = True
        self._epochs[name] = epoch

    def judge(self, found: Sequence[object]) -> None:
        """Judge the replies of the layout's claims sent again after a loss of data: another
        split found in any refuses every acquire of this process (its leases on the new
        data, none, it may still release) until the claims find the same or none (the
        operator stopped the other split and deleted the markers), which ends the doubt and
        the refusal.

        Raises:
            ConfigurationError: another process claimed another split since the loss.
        """
        try:
            self.layout.check_all(found)
        except ConfigurationError as exc:
            self.refused = str(exc)
            raise
        self.lost_data = False
        self.refused = None

    def settle_call(self, key: str, token: str) -> tuple[Sequence[bytes], list[Any]]:
        """Keys and arguments of the ``RELEASE`` that ends the lease of an acquire whose
        reply was lost (recorded ``disconnected``)."""
        names = self.layout.names(key)
        args: list[Any] = [*self.common, names.raw, token, Outcome.DISCONNECTED.value]
        args += [encode_json("disconnected"), _SETTLED, "null", "0", ""]
        return names[:5], args

    # -- release and renew -----------------------------------------------------------------

    def release_call(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None,
        details: str | None,
        result: Any,
    ) -> tuple[int, bytes, Callable[[], bytes]]:
        """Part count and packed tail of a ``RELEASE``, and the tail of its retry."""
        key = lease.key
        task_name = remembered(outcome, result, lease.holder.task_name)
        if task_name is None:
            head = self._segment(key, 5)
            count, result_ms = _RELEASE_PARTS, b"$0\r\n\r\n"
        else:
            names = self.layout.names(key)
            keys = [*names[:5], self.layout.result(key, task_name)]
            head = bulks([6, *keys, *self.common, names.raw])
            count, result_ms = _RELEASE_PARTS + 1, bulks([self.success_ms])
        token = lease.token.encode()
        if problem is None and details is None and result is None:
            ending = _OUTCOMES[outcome] + _NULLS
        else:
            ending = bulks([outcome.value, *map(encode_json, (problem, details, result))])
        body = b"%b$%d\r\n%b\r\n%b" % (head, len(token), token, ending)
        return count, body + b"$1\r\n0\r\n" + result_ms, lambda: body + b"$1\r\n1\r\n" + result_ms

    @staticmethod
    def released(
        reply: Any,
        lease: Lease,
        *,
        outcome: Outcome,
        problem: str | None,
        details: str | None,
        result: Any,
    ) -> Record | None:
        """The record a ``RELEASE`` reply stands for, or None (the lease was not ours)."""
        if reply == 0:
            return None
        released, expires = reply.split()
        expires_at = optional_seconds(expires)
        if expires_at != lease.expires_at:
            lease = with_fields(lease, expires_at=expires_at)
        return Record(lease, float(released), outcome, problem, details, result)

    def renew_call(
        self, lease: Lease, ttl: float | None, hand_over: bool = False, if_unchanged: bool = False
    ) -> tuple[int, bytes]:
        """Part count and packed tail of a ``RENEW`` (of a ``hand_over``: never shorter; with
        ``if_unchanged``, only while its expiry is still ``lease``'s, in milliseconds)."""
        ttl = validate_ttl(self.default_ttl if ttl is None else ttl)
        seen = lease.expires_at
        args = [
            lease.token,
            "" if ttl is None else ms(ttl),
            "1" if hand_over else "",
            ("-" if seen is None else round(seen * 1000)) if if_unchanged else "",
        ]
        return self._segment_count(5) + 4, self._segment(lease.key, 5) + bulks(args)

    @staticmethod
    def renewed(lease: Lease, reply: Any) -> Lease | None:
        """The lease a ``RENEW`` reply extends, or None (it was not ours)."""
        if reply == 0:
            return None
        return with_fields(lease, expires_at=optional_seconds(reply))

    # -- reading and waiting ---------------------------------------------------------------

    def peek_keys(self, key: str) -> Sequence[bytes]:
        """The keys of the ``PEEK`` of ``key``'s state."""
        return self.layout.names(key)[:2]

    def probe_call(self, key: str, timeout: float) -> tuple[list[bytes], list[Any]]:
        """Keys and arguments of the ``PROBE`` before a wait of ``timeout`` seconds."""
        names = self.layout.names(key)
        # The waiter's note in the state outlives the longest BLPOP by a margin for a slow
        # client; a waiter slower still wakes by its own timeout.
        blocking_ms = int((min(timeout, FALLBACK) + self.slack) * 1000)
        return [names.lock, names.quarantine, names.state], [blocking_ms]

    @staticmethod
    def pause(left: int, timeout: float) -> float | None:
        """How long to block on the signal list after a ``PROBE`` that answered ``left``
        (ms until the lease expires, -1: no expiry, -2: free), or None: not at all."""
        if left == -2:
            return None
        pause = min(timeout, FALLBACK)
        if left >= 0:
            pause = min(pause, left / 1000 + 0.001)
        return pause if pause >= 0.001 else None
