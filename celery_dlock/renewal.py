"""Background renewal of leases that expire, and what happens when one is lost.

A :class:`Renewer` is a real OS thread (not a greenlet: a blocked event loop must not stop
renewals) that renews a lease every ``ttl / 3`` seconds. It starts half an interval before
the first renewal is due (:data:`HEAD_START`), from one thread per process that keeps the
first renewals of every lease: a lease released sooner (most task runs) costs no thread of
its own, and a first renewal is not late by the time a thread takes to start (a process
starting hundreds of them on a loaded CPU started the last ones more than a second late,
and their leases of a 3 s ttl expired). A renewal that returns None means
the lease is gone: the renewer marks it lost and calls ``on_lost`` once. A renewal that
raises (store unreachable) is retried until the lease would have expired by our own
monotonic clock; then the lease is treated as lost too, since someone else may hold it. So is
a renewal that has not answered by then (:class:`_Overdue`): a store cut off by a partition
that drops packets keeps the call waiting for its socket timeout, past the expiry. The
expiry is counted from when the last renewal that answered was sent, never later than the
store counts it.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable

from celery_dlock import metrics
from celery_dlock.backends.base import LockBackend
from celery_dlock.errors import DLockError
from celery_dlock.events import fields
from celery_dlock.records import Lease, Outcome

__all__ = ["Renewer", "report_lost"]

logger = logging.getLogger("celery_dlock.renewal")

#: Longest pause before another try to start a lease's renewal thread that failed to start.
START_RETRY = 0.1

#: How long before its first renewal is due, as a share of ``ttl / 3``, a lease's renewal
#: thread is started.
HEAD_START = 0.5


class Renewer:
    """Keeps one lease alive until :meth:`stop`.

    Args:
        backend: the store that holds the lease.
        lease: the lease to renew; :attr:`lease` is always the newest one.
        ttl: the lease's time to live, in seconds; renewals come every ``ttl / 3``.
        on_lost: called once, from the renewal thread, with the last known lease.
    """

    def __init__(
        self,
        backend: LockBackend,
        lease: Lease,
        ttl: float,
        on_lost: Callable[[Lease], None] | None = None,
    ) -> None:
        self.backend = backend
        self.lease = lease
        self.ttl = ttl
        self.interval = ttl / 3
        self.on_lost = on_lost
        #: Set once the lease is found gone (read from other threads). A bool, not an Event:
        #: most renewers live a few ms, and two Events each cost more than their lease.
        self.lost = False
        self._stopped = False
        self._mutex = threading.Lock()
        #: The thread and its sleep, made when the first renewal is due (guarded by _mutex).
        self._thread: threading.Thread | None = None
        self._stopping: threading.Event | None = None
        #: The thread reporting the loss found by :data:`_overdue` (guarded by _mutex).
        self._reporting: threading.Thread | None = None
        #: In the first renewals' heap and not stopped (guarded by that heap's lock).
        self._queued = False
        #: When :meth:`start` was called (monotonic): just after the grant.
        self._granted = 0.0
        #: The expiry (monotonic) of the lease while a renewal is in flight, else None: the
        #: call or :data:`_overdue`, whichever comes first, takes it (guarded by _mutex).
        self._in_flight: float | None = None

    def start(self) -> Renewer:
        """Renew from one ``interval`` on; the thread starts :data:`HEAD_START` of an
        interval sooner, if the lease is still held then."""
        self._granted = time.monotonic()
        _first_renewals.add(self, self._granted + self.interval * (1 - HEAD_START))
        return self

    def _begin(self) -> None:
        """The first renewal is due: start the thread, unless stopped meanwhile.

        Raises:
            RuntimeError: the thread could not be started (out of memory or of threads).
        """
        with self._mutex:
            if self._stopped:
                return
            stopping = threading.Event()
            thread = threading.Thread(
                target=self._run,
                args=(stopping,),
                name=f"dlock-renew:{self.lease.key}",
                daemon=True,
            )
            thread.start()  # kept only once started: ``stop`` joins it
            self._thread, self._stopping = thread, stopping

    def _unrenewed(self) -> None:
        """No thread could be started to renew the lease before it expired."""
        with self._mutex:
            if self._stopped:
                return
        self._expire(": no thread could be started to renew it")

    def stop(self) -> None:
        """Stop renewing and wait for a renewal under way, so none races the release, and
        for a report of the lease's loss under way, so ``on_lost`` is not called after."""
        with self._mutex:
            self._stopped = True
            threads = (self._thread, self._reporting)  # the renewals', a loss's report
            stopping = self._stopping
        _first_renewals.discard(self)
        if stopping is not None:
            stopping.set()
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join()

    def _run(self, stopping: threading.Event) -> None:
        # The grant (``start``), not one interval before this thread began: the process may
        # have been paused in between, and a lease's life is counted from its grant.
        renewed_at = self._granted
        wait = max(0.0, renewed_at + self.interval - time.monotonic())  # to the first renewal
        while not stopping.wait(wait):
            wait = self.interval
            sent = time.monotonic()
            try:
                lease = self._renew(renewed_at + self.ttl)
            except _Late:
                return  # reported lost when it expired, by _overdue
            except DLockError as exc:
                if time.monotonic() - renewed_at < self.ttl:
                    extra = fields("renew_failed", self.lease, backend=self.backend.url)
                    logger.warning(
                        "renewal of %s failed, will retry: %s", self.lease.key, exc, extra=extra
                    )
                    continue
                extra = fields("renew_expired", self.lease, backend=self.backend.url)
                logger.error(
                    "lease on %s expired while its store failed: %s",
                    self.lease.key,
                    exc,
                    extra=extra,
                )
                lease = None
            if stopping.is_set():
                return
            if lease is None:
                if not _exiting:  # else released by the process's exit: no loss
                    self._lose()
                return
            self.lease = lease
            renewed_at = sent

    def _renew(self, expiry: float) -> Lease | None:
        """The store's renewal of the lease, which expires at ``expiry`` by our clock.

        Raises:
            _Late: the answer came after the expiry, when the lease was reported lost.
        """
        with self._mutex:
            self._in_flight = expiry
        _overdue.arm(self, expiry)
        try:
            return self.backend.renew(self.lease, self.ttl)
        finally:
            with self._mutex:
                late, self._in_flight = self._in_flight is None, None
            if late:
                raise _Late  # its answer (or failure) no longer counts: the lease was lost

    def _expired(self, expiry: float) -> None:
        """From :data:`_overdue`: the lease reached ``expiry`` with a renewal in flight.

        It is reported from a thread of its own: ``on_lost`` may block (a release waits for
        the renewal in flight, up to the socket timeout), and the other leases cut off with
        it must be reported at their own expiry. :meth:`stop` waits for that thread, so
        that ``on_lost`` is never called after the release.
        """
        with self._mutex:
            if self._in_flight != expiry or self._stopped:
                return  # it answered in time, or the lease is being released
            self._in_flight = None
            self.lost = True  # at once: a release from now on knows it is reported
            reporting = threading.Thread(
                target=self._expire,
                args=(_UNANSWERED,),
                name=f"dlock-lost:{self.lease.key}",
                daemon=True,
            )
            try:
                reporting.start()
            except RuntimeError:  # out of threads: this one reports it
                inline = True
            else:
                inline, self._reporting = False, reporting
        if inline:
            self._expire(_UNANSWERED)

    def _expire(self, why: str) -> None:
        """Log that the lease expired (``why``, after its key) and report it lost."""
        extra = fields("renew_expired", self.lease, backend=self.backend.url)
        logger.error("lease on %s expired%s", self.lease.key, why, extra=extra)
        self._lose()

    def _lose(self) -> None:
        self.lost = True
        report_lost(self.lease, self.on_lost, backend=self.backend.url)


_UNANSWERED = " while its renewal went unanswered"


class _Late(Exception):
    """A renewal answered after its lease's expiry by our clock (already reported lost)."""


class _Overdue:
    """Renewals in flight, by when their lease expires: one thread per process that finds
    a lease lost at its expiry if its renewal has not answered by then, and has it reported
    from a thread of its own. An entry whose renewal answered is dropped when its time
    comes."""

    def __init__(self) -> None:
        self._order = itertools.count()
        self.forget()

    def forget(self) -> None:
        """Nothing in flight, and no thread yet: the one started by the next :meth:`arm`
        (in a forked child, the parent's lock may have been held at the fork)."""
        self._due: list[tuple[float, int, Renewer]] = []
        self._changed = threading.Condition()
        self._pid = 0

    def arm(self, renewer: Renewer, expiry: float) -> None:
        with self._changed:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="dlock-overdue", daemon=True).start()
            heapq.heappush(self._due, (expiry, next(self._order), renewer))
            if self._due[0][2] is renewer:
                self._changed.notify()

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self._changed:
                if self._pid != pid:
                    return
                now = time.monotonic()
                if not self._due or self._due[0][0] > now:
                    self._changed.wait(self._due[0][0] - now if self._due else None)
                    continue
                expiry, _, renewer = heapq.heappop(self._due)
            renewer._expired(expiry)  # outside the heap's lock: it may call on_lost


_overdue = _Overdue()
os.register_at_fork(after_in_child=_overdue.forget)


class _FirstRenewals:
    """When each held lease's renewal thread is due (:data:`HEAD_START` before its first
    renewal), in one thread per process, which starts that lease's :class:`Renewer` thread
    then (a forked child starts its own).

    A renewer stopped sooner (most task runs) stays in the heap until its turn, unless the
    stopped outnumber the queued: then the heap is rebuilt without them. So it holds at most
    about twice the leases held (not every lease granted within ``ttl / 3``: 20,000 entries
    at 1,000 tasks/s with a 60 s ttl), at an amortized constant cost per stop.

    The thread is woken only by a lease due before it would wake anyway: a lease taken and
    released in a loop (every task run) woke it at each grant, for nothing, and that cost
    30 µs of CPU per lease, twice the rest of ``Lock``.
    """

    def __init__(self) -> None:
        self._order = itertools.count()
        self._empty()

    def _empty(self) -> None:
        """No lease queued, and no thread yet: the one started by the next :meth:`add`."""
        self._due: list[tuple[float, int, Renewer]] = []
        self._stopped = 0  # entries in ``_due`` of renewers stopped before their turn
        self._changed = threading.Condition()
        self._pid = 0
        self._wakes = math.inf  # when the thread wakes by itself (guarded by ``_changed``)
        self._idle = math.inf  # the shortest wait for a thread's start: the empty heap's sleep

    def add(self, renewer: Renewer, at: float) -> None:
        with self._changed:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(
                    target=self._run, name="celery_dlock first renewals", daemon=True
                ).start()
                # Registered now, after the exit handler that releases the leases still
                # held (``process``), so that it runs before it.
                atexit.register(_exit)
            renewer._queued = True
            heapq.heappush(self._due, (at, next(self._order), renewer))
            self._idle = min(self._idle, max(renewer.interval * (1 - HEAD_START), 0.01))
            if at < self._wakes:
                self._changed.notify()

    def discard(self, renewer: Renewer) -> None:
        """``renewer`` was stopped: its entry is dead, and the heap is compacted once the
        dead outnumber the live."""
        with self._changed:
            if not renewer._queued:
                return
            renewer._queued = False
            self._stopped += 1
            if self._stopped * 2 > len(self._due):
                self._due = [entry for entry in self._due if entry[2]._queued]
                heapq.heapify(self._due)
                self._stopped = 0

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self._changed:
                unrenewed = self._start_due(pid)
            if unrenewed is None:
                return
            unrenewed._unrenewed()  # outside the heap's lock: it calls on_lost

    def _start_due(self, pid: int) -> Renewer | None:
        """Start the thread of each renewer when it is due, until this process is a forked
        child (None), or a lease expired before a thread could be started for it (its
        renewer). A thread that cannot be started (out of memory or of threads) is tried
        again shortly: this thread must live on, for the other leases."""
        while self._pid == pid:
            now = time.monotonic()
            self._wakes = self._due[0][0] if self._due else now + self._idle
            if self._wakes > now:
                self._changed.wait(None if math.isinf(self._wakes) else self._wakes - now)
                continue
            _, _, renewer = heapq.heappop(self._due)
            if not renewer._queued:
                self._stopped -= 1
                continue
            try:
                renewer._begin()
            except RuntimeError as exc:
                if now >= renewer._granted + renewer.ttl:
                    renewer._queued = False
                    return renewer
                extra = fields("renew_failed", renewer.lease, backend=renewer.backend.url)
                logger.warning(
                    "cannot start the renewal of %s, will retry: %s",
                    renewer.lease.key,
                    exc,
                    extra=extra,
                )
                again = now + min(renewer.interval, START_RETRY)
                heapq.heappush(self._due, (again, next(self._order), renewer))
                continue
            renewer._queued = False
        return None

    def forget(self) -> None:
        """In a forked child: the parent's thread and leases are not ours (its lock may
        have been held at the fork)."""
        for _, _, renewer in self._due:
            renewer._queued = False
        self._empty()


#: Set as the process ends normally, before its exit handler releases the leases still
#: held, as abandoned: a renewal that then finds its lease gone found that release (the
#: renewal threads run on until the interpreter stops them), not a loss to report.
_exiting = False


def _exit() -> None:
    global _exiting
    _exiting = True


_first_renewals = _FirstRenewals()
os.register_at_fork(after_in_child=_first_renewals.forget)


def report_lost(
    lease: Lease,
    on_lost: Callable[[Lease], None] | None,
    how: str = "",
    *,
    backend: str,
) -> None:
    """Log that ``lease`` was lost (``how``: a phrase after "was lost") and call ``on_lost``;
    an exception from the callback is logged, not raised. ``backend`` is the store's URL,
    password masked (``LockBackend.url``), for the records' ``backend`` field."""
    metrics.lost(lease)
    logger.error(
        "lease on %s (fence %d) of %s was lost%s: another holder may run now",
        lease.key,
        lease.fence,
        lease.holder.describe(),
        how,
        extra=fields("lease_lost", lease, outcome=Outcome.LOST, backend=backend),
    )
    if on_lost is not None:
        try:
            on_lost(lease)
        except Exception:
            extra = fields("on_lost_failed", lease, backend=backend)
            logger.exception("on_lost callback for %s failed", lease.key, extra=extra)
