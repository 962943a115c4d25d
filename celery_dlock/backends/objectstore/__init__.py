"""Locks in a bucket: the compare-and-swap algorithm shared by the GCS and S3 backends.

A store module (``gcs.py``, ``s3.py``) adapts one object store to :class:`ObjectStore`
(``store.py``): read, create-if-absent, compare-and-swap, list, delete, and the server's
clock in each response. This package owns everything else: the objects and their bodies
(``layout.py``), expiry by the server's clock (``clock.py``), timed reads and settled
conditional writes (``bucket.py``), the records (``history.py``), what the threads of a
process share (``local.py``), polling for ``wait`` (``polling.py``), the doctor's checks
(``doctor.py``) and, here, the algorithm.

Writes
    A lock object is written only by create-if-absent or by a swap conditional on the
    version read (GCS generation, S3 ETag), and deleted only by the janitor, conditionally
    on the version of an object free for ``gc_after``, after raising ``fence-floor`` to its
    fence. Release swaps the object to ``free``, keeping its fence; the next fence is the
    stored fence + 1, so fences strictly increase. A write whose answer was lost (timeout,
    reset, or a 412 on the client library's own retry of a write that had landed) is
    settled by reading the object back and comparing the body's write nonce; an acquire
    whose write stays unsettled has its lease, if it landed, ended later (``doubts.py``).

Records
    The record of a lease that ends is written into the lock object by the same swap that
    frees it (``ended``), then copied to ``history/`` (create-if-absent, so twice is
    harmless). A writer killed (or refused) between the two leaves it in ``ended``, which
    stays there until the next swap that writes a record of its own: that writer first
    copies the one it replaces (one more request, unless this process wrote it) and makes
    no swap if it cannot; ``reap`` copies the ``ended`` of free objects. ``successes`` in
    the lock object keeps ``once`` exact meanwhile. A release keeps its success there only
    if it first created its ``success/`` object, create-if-absent (the first wins).

Waiting
    ``wait`` reads, never writes: jittered pauses from 50 ms doubling to 1 s, bounded by the
    time left and by the lease's expiry; a release by another thread of this process wakes
    the first waiter of that key at once. Real GCS allows about one write per second per
    object name, so these locks suit coarse work (cron singletons, batch jobs).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import replace
from typing import Any, ClassVar

from celery_dlock.backends.base import (
    Capabilities,
    Check,
    LockBackend,
    MonotonicClock,
    Place,
    hand_over_ttl,
    handed_expiry,
    validate_ttl,
)
from celery_dlock.backends.common import retried, taken_over
from celery_dlock.backends.objectstore import history as records
from celery_dlock.backends.objectstore.bucket import Bucket
from celery_dlock.backends.objectstore.clock import (
    ServerClock,
    maybe_expired,
    verdict,
)
from celery_dlock.backends.objectstore.doctor import checks
from celery_dlock.backends.objectstore.doubts import Doubts
from celery_dlock.backends.objectstore.layout import Layout, LockState, Successes, us
from celery_dlock.backends.objectstore.polling import poll
from celery_dlock.backends.objectstore.store import (
    Found,
    ObjectStore,
    Stamp,
    UnsureWrite,
    Written,
    checked_option,
)
from celery_dlock.errors import ConfigurationError
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token

__all__ = [
    "Found",
    "ObjectStore",
    "ObjectStoreBackend",
    "ServerClock",
    "Stamp",
    "UnsureWrite",
    "Written",
]


_DAY = 86400.0
#: Attempts when a race (a swap that lost to another writer) leaves the outcome open.
_ATTEMPTS = 4
#: ``reap`` copies a lost record to history only if it is younger than this: older ones
#: may have been pruned on purpose.
_REPAIR_WINDOW = 3600.0


class ObjectStoreBackend(LockBackend):
    """The lock algorithm over an :class:`ObjectStore`; subclasses open the store.

    Args:
        bucket: the bucket's name.
        prefix: where in the bucket the objects go (``""`` for the top).
        gc_after: ``reap`` deletes lock objects free for this many seconds.
        clock: the local clock that measures time between responses (default
            ``time.monotonic``); its offset from true time does not matter, only its rate.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        liveness="lease",
        push_wait=False,
        cross_process=True,
        cross_host=True,
        durable_history=True,
        server_clock=True,
    )

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        gc_after: float = _DAY,
        clock: MonotonicClock | None = None,
    ) -> None:
        if not isinstance(bucket, str) or not bucket or "/" in bucket or ":" in bucket:
            raise ConfigurationError(
                f"the {self.name} backend takes a bucket's name, not {bucket!r}"
                f" (for a URL: {type(self).__name__}.from_url or backend_from_url)"
            )
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.gc_after = float(checked_option(self.name, "gc_after", gc_after, least=0, above=False))
        self.clock: MonotonicClock = clock or time.monotonic
        self.layout = Layout(self.prefix)
        self.objects = Bucket(
            self._open_store,
            self._endpoint,
            self.clock,
            lambda: self.url,
            probe=self.layout.probe,
            floor=self.layout.floor,
        )
        #: Acquires of this process whose outcome is unknown: settled at the next call.
        self.doubts = Doubts(self.objects, self.layout)

    @abstractmethod
    def _open_store(self) -> ObjectStore:
        """This process's adapter (called lazily, once per process)."""

    @abstractmethod
    def _endpoint(self) -> str:
        """What identifies the server whose clock we measure (its endpoint)."""

    def store(self) -> ObjectStore:
        """This process's adapter of the bucket."""
        return self.objects.store()

    @property
    def server_clock(self) -> ServerClock:
        return self.objects.server_clock

    def close(self) -> None:
        self.objects.close()

    # -- acquire -------------------------------------------------------------------------------

    def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None:
        ttl = validate_ttl(self.default_ttl if ttl is None else ttl)
        self.doubts.settle(self._end)
        name = self.layout.lock(key)
        with self.objects.local.get().stripe(name):
            return self._attempt(name, key, holder, ttl, replace)

    def _attempt(
        self, name: str, key: str, holder: Holder, ttl: float | None, replace: str | None
    ) -> Lease | None:
        # A key this process saw free is swapped at once; a stale guess fails its
        # condition and costs the read it saved.
        previous = self.objects.local.get().free_state(name)
        date: float | None = None
        if previous is None:
            found = self.objects.read(name)
            previous, date = self.objects.decode(found, name), found.stamp.date
        for _ in range(_ATTEMPTS):
            now = self.objects.now()
            record: Record | None = None
            fence = self.objects.floor() + 1 if previous is None else previous.fence + 1
            held = None if previous is None else previous.lease
            if held is not None and replace is not None and held.token == replace:
                record = retried(held, holder, records.released_at(held, now))
            elif held is not None:
                if verdict(held, now, date) != "expired":
                    self.objects.local.get().saw(name, previous)
                    return None
                record = records.ending(held, now, Outcome.EXPIRED, problem="expired")
            expires_at = None if ttl is None else us(now.high + ttl)
            # Never before the end of the lease it follows (another process's clock window
            # may reach lower), so that the history's intervals of a key never overlap.
            freed = record.released_at if record is not None else previous and previous.freed_at
            start = max(now.low, freed or now.low)
            lease = Lease(key, new_token(), fence, holder, us(start), expires_at)
            ended = None if record is None else record.to_dict()
            if ended is not None and previous is not None and previous.ended is not None:
                records.keep(self, previous)  # its ended, replaced below: in history first
            with self.doubts.unanswered(key, lease.token):
                state, other = self.objects.write_state(
                    name, previous, key, fence, lease, ended=ended
                )
                if state is not None:
                    if ended is not None:
                        self._flush(ended)
                        taken_over(ended["outcome"])
                    return None if self._too_late(state) else state.lease
            # Another writer was first: judge again what is there now.
            assert other is not None
            previous, date = self.objects.decode(other, name), other.stamp.date
        return None

    # -- release, renew, force -------------------------------------------------------------------

    def _ours(self, lease: Lease) -> LockState | None:
        """The lock object's state if it holds ``lease`` (by token): the state this process
        last saw if it held that lease (a stale guess fails its write's condition), else
        read."""
        name = self.layout.lock(lease.key)
        state = self.objects.local.get().holding(name, lease.token)
        if state is None or self.objects.server_clock.now() is None:
            state = self.objects.decode(self.objects.read(name), name)
        if state is None or state.lease is None or state.lease.token != lease.token:
            return None
        return state

    def _end(
        self,
        state: LockState,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
        *,
        own: bool = False,
        taker: bool = False,
    ) -> Record | None:
        """Swap the lock object from ``state`` (held) to free, with the record of its lease.

        If the swap loses to a renewal of the same lease (same token, new version), it is
        retried on the new version; the record is returned only if our swap took effect.
        ``own``: the holder's own release. A swap of it that finds the key changed may
        follow an earlier try that landed with its answer lost: that try's record is
        returned if it is there (``records.landed``). ``taker``: another client ends a
        lease it proved expired (``reap``): a renewal that landed after its read (sent
        before the expiry) makes the lease alive again, so it is judged anew first.
        """
        name = self.layout.lock(state.key)
        for _ in range(_ATTEMPTS):
            lease = state.lease
            assert lease is not None
            record = records.ending(
                lease, self.objects.now(), outcome, problem=problem, details=details, result=result
            )
            data = record.to_dict()
            if state.ended is not None:
                records.keep(self, state)  # its ended, replaced below: in history first
            successes = records.succeed(self, state, data)
            written, found = self.objects.write_state(
                name,
                state,
                state.key,
                state.fence,
                None,
                freed_at=record.released_at,
                ended=data,
                successes=successes,
            )
            if written is not None:
                self._flush(data)  # its success/ object, if any, was made before the swap
                self.objects.local.get().wake_one(name)
                return record
            assert found is not None
            current = self.objects.decode(found, name)
            if current is None or current.lease is None or current.lease.token != lease.token:
                self.objects.local.get().saw(name, current)
                return records.landed(self, lease, outcome, current) if own else None
            if taker and verdict(current.lease, self.objects.now(), found.stamp.date) != "expired":
                self.objects.local.get().saw(name, current)
                return None
            state = current
        return None

    def release(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None:
        self.doubts.settle(self._end)
        state = self._ours(lease)
        if state is None or state.lease is None:
            return None
        if maybe_expired(state.lease, self.objects.now()):
            self._end(state, Outcome.EXPIRED, "expired")
            return None
        return self._end(state, outcome, problem, details, result, own=True)

    def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        return self._prolong(lease, validate_ttl(self.default_ttl if ttl is None else ttl))

    def hand_over(self, lease: Lease, ttl: float, if_unchanged: bool = False) -> Lease | None:
        """:meth:`renew` that never shortens: leases here live by their ttl alone."""
        return self._prolong(lease, hand_over_ttl(ttl), True, if_unchanged)

    def _prolong(
        self, lease: Lease, ttl: float | None, longer: bool = False, if_unchanged: bool = False
    ) -> Lease | None:
        self.doubts.settle(self._end)
        state = self._ours(lease)
        name = self.layout.lock(lease.key)
        for _ in range(_ATTEMPTS):
            if state is None or state.lease is None:
                return None
            now = self.objects.now()
            if maybe_expired(state.lease, now):
                self._end(state, Outcome.EXPIRED, "expired")
                return None
            expires_at = None if ttl is None else us(now.high + ttl)
            if longer and expires_at is not None:
                expires_at = handed_expiry(
                    state.lease.expires_at, expires_at, lease.expires_at, if_unchanged
                )
            renewed = replace(state.lease, expires_at=expires_at)
            written, found = self.objects.write_state(name, state, state.key, state.fence, renewed)
            if written is not None:
                return None if self._too_late(written) else written.lease
            assert found is not None
            current = self.objects.decode(found, name)
            if current is None or current.lease is None or current.lease.token != lease.token:
                return None
            state = current
        return None

    def _too_late(self, written: LockState) -> bool:
        """Whether the lease just written had (maybe) expired by the time its answer came:
        a request slowed or retried past the ttl grants nothing, since a taker may hold the
        key already. Such a lease is ended as expired, so that its record is kept."""
        assert written.lease is not None
        if not maybe_expired(written.lease, self.objects.now()):
            return False
        self._end(written, Outcome.EXPIRED, "expired")
        return True

    # -- looking -------------------------------------------------------------------------------

    def get(self, key: str) -> Lease | None:
        name = self.layout.lock(key)
        state = self.objects.decode(self.objects.read(name), name)
        self.objects.local.get().saw(name, state)
        return None if state is None else state.lease

    def leases(self, prefix: str = "") -> list[Lease]:
        found = []
        for name in self.store().names(self.layout.locks_of(prefix)):
            state = self.objects.decode(self.objects.read(name), name)
            if state is not None and state.lease is not None and state.key.startswith(prefix):
                found.append(state.lease)
        return sorted(found, key=lambda lease: lease.key)

    # -- the janitor ---------------------------------------------------------------------------

    def reap(self, limit: int = 100) -> list[Record]:
        reaped: list[Record] = []
        calibrated = False
        for name in self.store().names(self.layout.locks):
            if len(reaped) >= limit:
                break
            found = self.objects.read(name)
            state = self.objects.decode(found, name)
            if state is None:
                continue
            if state.lease is None:
                self._tidy(name, state)
                continue
            judged = verdict(state.lease, self.objects.now(), found.stamp.date)
            if judged == "unsure" and not calibrated:
                self.objects.calibrate()
                calibrated = True
                found = self.objects.read(name)
                state = self.objects.decode(found, name)
                if state is None or state.lease is None:
                    continue
                judged = verdict(state.lease, self.objects.now(), found.stamp.date)
            if judged == "expired":
                record = self._end(state, Outcome.EXPIRED, "expired", taker=True)
                if record is not None:
                    reaped.append(record)
        return reaped

    def _tidy(self, name: str, state: LockState) -> None:
        """Copy a free lock object's last record to history if nobody did (its writer died
        in between), and collect the key if it has been free for ``gc_after``."""
        now = self.objects.now()
        ended = state.ended
        if ended is not None and now.low - float(ended["released_at"]) < _REPAIR_WINDOW:
            self._flush(ended)  # a success/ object is made before its lock object's swap
        if state.freed_at is not None and now.low - state.freed_at >= self.gc_after:
            self._collect(name, state)

    def _collect(self, name: str, state: LockState) -> None:
        """Remove the lock object of a key idle past ``gc_after``, keeping its fence (in the
        fence floor) and its results (under ``success/``)."""
        for success in state.successes.values():
            self._flush(success, state.successes, history=False)
        self.objects.raise_floor(state.fence)
        if self.store().delete_if(name, state.version):
            self.objects.local.get().saw(name, None)

    # -- history (history.py) ---------------------------------------------------------------------

    def _flush(
        self, record: dict[str, Any], successes: Successes | None = None, *, history: bool = True
    ) -> None:
        records.flush(self, record, successes, history=history)

    def add_record(self, record: Record) -> None:
        records.add(self, record)

    def history(
        self,
        key: str | None = None,
        outcome: Outcome | None = None,
        since: float | None = None,
        limit: int | None = 100,
    ) -> list[Record]:
        return records.query(self, key, outcome, since, limit)

    def last_success(self, key: str, task_name: str) -> Record | None:
        return records.last_success(self, key, task_name)

    def remember(self, record: Record) -> bool:
        return records.remember(self, record)

    def forget_success(self, key: str, task_name: str, token: str) -> bool:
        return records.forget(self, key, task_name, token)

    def prune_history(self, before: float) -> int:
        return records.prune(self, before)

    # -- waiting -------------------------------------------------------------------------------

    def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None:
        """Poll ``key`` (reads only) with jittered, doubling pauses up to 1 s, until it is
        free or its lease expired, or ``timeout`` seconds passed. A release made by this
        process (another thread) ends a pause at once."""
        deadline = time.monotonic() + timeout
        name = self.layout.lock(key)
        with self.objects.local.get().waiting(name) as woken:
            poll(self.objects, name, deadline, woken)
        return None  # no queue: nothing to keep

    # -- the doctor ----------------------------------------------------------------------------

    def server_time(self) -> float:
        self.objects.read(self.layout.probe)
        now = self.objects.now()
        return (now.low + now.high) / 2

    def diagnose(self) -> list[Check]:
        """Whether the bucket honours what the locks rest on, and how well the server's
        clock is known (see ``doctor.py``)."""
        return checks(self)
