"""The lock as users hold it: :class:`Lock` and :func:`lock`, over any backend.

The backend makes single attempts; this module owns waiting (the backend's push wakeup,
with a bounded, jittered poll behind it since pushes can be lost), renewal of leases that
expire, and the record written when a ``with`` block ends.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Mapping
from enum import Enum
from types import TracebackType
from typing import Any, Final, Literal

from celery_dlock import metrics, releasing
from celery_dlock.backends import mask_url
from celery_dlock.backends.base import LockBackend, Place, remembered, validate_ttl
from celery_dlock.errors import (
    BackendError,
    ConfigurationError,
    DLockError,
    LockLostError,
    LockNotAcquiredError,
    LockTimeoutError,
)
from celery_dlock.events import fields
from celery_dlock.keys import slot_keys, validate_key, validate_limit
from celery_dlock.process import abandon, abandon_grant, held, shared_backend
from celery_dlock.records import Holder, Lease, Outcome, Record, check_metadata, new_token
from celery_dlock.releasing import Ending, end_block
from celery_dlock.renewal import Renewer, report_lost

__all__ = ["DEFAULT", "Lock", "validate_wait"]

logger = logging.getLogger("celery_dlock")

#: Longest sleep between two attempts while waiting, whatever the backend's push does.
POLL = 1.0
#: Held while a Lock takes the lease it was granted: one Lock object holds one lease.
_HOLDING = threading.Lock()


class _Default(Enum):
    DEFAULT = 0


#: "Use the value the Lock was made with."
DEFAULT: Final = _Default.DEFAULT


def validate_wait(wait: float | None) -> float | None:
    """``wait`` as float seconds, or None for no limit; a ConfigurationError otherwise."""
    if wait is None:
        return None
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
        raise ConfigurationError(f"wait must be seconds >= 0 or None, not {wait!r}")
    return float(wait)


class Lock:
    """A lock on one key of one backend.

    Args:
        backend: a :class:`LockBackend`, or a URL (one shared backend per URL).
        key: the full key, e.g. ``job:report:daily``.
        ttl: seconds a lease lives without renewal; None for the store's ``default_ttl``:
            no expiry (liveness is then the holder's connection or process, where the
            backend has one), or the lease length of a store that needs one.
        wait: seconds :meth:`acquire` waits for a busy key; 0 = do not wait, None = no limit.
        holder: who holds; by default this process, with a fresh nonce per acquisition.
        renew: renew from a background thread every ``ttl / 3`` while held (default: with a ttl).
        on_lost: called from a background thread when the lease is lost: a renewal found it
            gone, or (no ``ttl``, a store whose liveness is a session) its session ended.
        limit: at most this many holders at once (a semaphore; up to 1,000): each holds one of
            ``limit`` slots, the keys ``key#0`` .. ``key#<limit-1>``, with a lease, token
            and fence of its own; slots are tried in a random order, and a waiter is woken
            by the release of any of them (``wait_any``). 1: the key itself.
        metadata: a JSON object (at most 4 KiB) stored with each lease and its record,
            shown by ``leases`` and ``history``: who asked, an order's amount, a ticket.

    Attributes:
        success_retry: seconds :meth:`release` keeps trying to store a success with a
            result (the one ``once`` replays) while the store fails (default 30).

    Raises:
        LockKeyError: ``key`` is empty, too long or has control characters.
        ConfigurationError: bad ``ttl`` or ``wait``.
        ValueError: ``metadata`` is not a JSON object of at most 4 KiB.
    """

    success_retry: float = 30.0

    def __init__(
        self,
        backend: LockBackend | str,
        key: str,
        ttl: float | None = None,
        wait: float | None = 0,
        *,
        holder: Holder | None = None,
        renew: bool | None = None,
        on_lost: Callable[[Lease], None] | None = None,
        limit: int = 1,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(backend, LockBackend | str):  # lock(..., backend=os.environ.get(...))
            raise ConfigurationError(
                f"a lock's backend is a store URL or a LockBackend, not {backend!r}"
            )
        self.backend = shared_backend(backend) if isinstance(backend, str) else backend
        self.key = validate_key(key)
        self.metadata = check_metadata(metadata)
        self.limit = validate_limit(limit)
        #: The keys a holder may take: the key itself, or its ``limit`` slots.
        self.slots = (self.key,) if self.limit == 1 else slot_keys(self.key, self.limit)
        self.ttl = self.backend.default_ttl if ttl is None else validate_ttl(ttl)
        self.wait = validate_wait(wait)
        self.holder = holder
        self.renew_in_background = self.ttl is not None if renew is None else renew
        self.on_lost = on_lost
        self._lease: Lease | None = None
        self._renewer: Renewer | None = None
        self._unwatch: Callable[[], None] | None = None
        self._session_ended = False  # set by the backend's watcher thread

    def next_holder(self) -> Holder:
        """Who takes the next lease: ``holder``, or this process with a fresh nonce; with
        this lock's ``metadata``."""
        holder = self.holder or Holder.current()
        if self.metadata is None:
            return holder
        return dataclasses.replace(holder, metadata=self.metadata)

    @property
    def lease(self) -> Lease | None:
        """The lease held now (the newest after renewals), or None."""
        return self._lease if self._renewer is None else self._renewer.lease

    @property
    def lost(self) -> bool:
        """True once background renewal found the lease gone, or its session ended."""
        return self._session_ended if self._renewer is None else self._renewer.lost

    def acquire(
        self,
        wait: float | Literal[_Default.DEFAULT] | None = DEFAULT,
        *,
        replace: str | None = None,
    ) -> Lease:
        """Take the key, waiting up to ``wait`` seconds (default: the lock's ``wait``).

        ``replace`` names the token of a live lease this acquisition may take over: the
        lease a Celery task kept for its own retry (see ``LockBackend.try_acquire``).

        Raises:
            LockNotAcquiredError: the key is held and ``wait`` is 0.
            LockTimeoutError: the key was still held after ``wait`` seconds.
            BackendError: the store failed.
        """
        if self._lease is not None:
            raise ConfigurationError(f"lock {self.key!r} is already held by this Lock object")
        limit = self.wait if wait is DEFAULT else validate_wait(wait)
        began = time.monotonic()
        deadline = None if limit is None else began + limit
        holder = self.next_holder()
        place: Place | None = None  # in the store's queue of the key's waiters, if it has one
        try:
            while True:
                lease = self._try(holder, replace, place)  # held once it returns one
                if lease is not None:
                    metrics.waited(holder.task_name, time.monotonic() - began)
                    if replace is not None:
                        held().discard(replace)  # taken over: kept no longer
                    place = None  # used up, or left for another slot (took)
                    return lease
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self.busy_error(limit)
                pause = POLL * random.uniform(0.5, 1.0)
                place = self.wait_once(pause if remaining is None else min(pause, remaining), place)
        except BaseException as exc:  # after it was held (a soft limit): given back, abandoned
            if self._lease is not None and self._lease.holder.nonce == holder.nonce:
                abandon_grant(self.backend, [self.detach().key], holder, exc)
            raise
        finally:
            if place is not None:
                place.leave()

    def wait_once(self, timeout: float, place: Place | None = None) -> Place | None:
        """One wait on the store, of at most ``timeout`` seconds: for the key (``place``, the
        caller's in its queue, kept: the place returned), or for any of its slots."""
        if self.limit == 1:
            return self.backend.wait(self.key, timeout, place)
        self.backend.wait_any(self.slots, timeout)  # woken by the release of any of them
        return None

    def _try(self, holder: Holder, replace: str | None, place: Place | None) -> Lease | None:
        """One attempt at the key, or at each slot in a random order (the slot of the lease
        ``replace`` names first): the lease, held (:meth:`took`), or None. An exception
        raised meanwhile (a soft time limit) releases what the store may have granted."""
        started = time.perf_counter()
        try:
            lease = self._try_slots(holder, replace, place)
            metrics.store_call(self.backend.name, "acquire", started)
            if lease is not None:
                self.took(lease, place)
        except BackendError:
            metrics.store_error(self.backend.name, "acquire")
            raise
        except BaseException as exc:
            if self._lease is None and not isinstance(exc, DLockError):
                abandon_grant(self.backend, self.slots, holder, exc)
            raise
        return lease

    def _try_slots(self, holder: Holder, replace: str | None, place: Place | None) -> Lease | None:
        if self.limit == 1:
            return self.backend.try_acquire(self.key, holder, self.ttl, replace, place)
        slots = random.sample(self.slots, self.limit)
        if replace is not None:  # the slot of the lease it takes over first
            kept = held().lease(replace)  # kept by this process: no read of every slot
            ours = [kept] if kept else [lease for lease in self.holders() if lease.token == replace]
            first = {lease.key for lease in ours}
            slots.sort(key=lambda slot: slot not in first)
        for slot in slots:
            mine = place if place is not None and place.key == slot else None
            lease = self.backend.try_acquire(slot, holder, self.ttl, replace, mine)
            if lease is not None:
                return lease
        return None

    def attempt(self, place: Place | None = None) -> Lease | None:
        """One try, without waiting or raising for a busy key: the lease, now held, or None
        (:meth:`current` tells who holds the key). ``place``: the caller's in the store's
        queue of the key's waiters (from :meth:`wait_once`, for :class:`AsyncLock`), used
        up or left as in :meth:`took`."""
        if self._lease is not None:
            raise ConfigurationError(f"lock {self.key!r} is already held by this Lock object")
        return self._try(self.next_holder(), None, place)

    def took(self, lease: Lease, place: Place | None = None) -> None:
        """Hold ``lease``, taken by one's own call to the store (:class:`AsyncLock`'s
        asyncio client); ``place``, the caller's, is left if it was for another slot."""
        if place is not None and place.key != lease.key:
            place.leave()
        self._held(lease)

    def busy_error(
        self, waited: float | None, current: Lease | _Default | None = DEFAULT
    ) -> LockNotAcquiredError:
        """The error for this key found busy after waiting ``waited`` seconds, naming its
        holder (``current``, the lease on it, by default read from the store)."""
        found = self.current() if current is DEFAULT else current
        holder = None if found is None else found.holder.describe()
        if not waited:
            return LockNotAcquiredError(self.key, holder)
        return LockTimeoutError(self.key, waited, holder)

    def _held(self, lease: Lease) -> None:
        with _HOLDING:  # two threads' acquires of one Lock: the second gives its lease back
            taken, self._lease = self._lease, self._lease or lease
        if taken is not None:
            self.backend.release(lease, Outcome.SKIPPED, "held", "its Lock was held meanwhile")
            message = "was taken by another thread: give each thread its own Lock"
            raise ConfigurationError(f"lock {self.key!r} {message}")
        held().add(self.backend, lease)
        self._session_ended = False
        if self.renew_in_background and self.ttl is not None:
            self._renewer = Renewer(self.backend, lease, self.ttl, self.on_lost).start()
        else:
            self._unwatch = self.backend.watch(lease, self._session_lost)

    def __del__(self) -> None:
        # A Lock dropped while it holds its lease: release it, recorded as abandoned.
        lease = getattr(self, "_lease", None)
        if lease is None or sys.is_finalizing():
            return
        if self._renewer is not None:
            self._renewer.stop()
        if self._unwatch is not None:
            self._unwatch()
        abandon(lease.token, "was garbage-collected while held")

    def _session_lost(self, lease: Lease) -> None:
        """From the backend's watcher: ``lease``'s session ended, or a forced release ended it."""
        self._session_ended = True
        why = f" (its session ended, or it was ended by its token) [{mask_url(self.backend.url)}]"
        report_lost(lease, self.on_lost, why, backend=self.backend.url)

    def stop_watching(self) -> None:
        """Stop the store's watch of the held lease's session: its loss is known already
        (an AsyncLock's renewal found it), and the watcher is not to report it again."""
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    def renew(self, ttl: float | Literal[_Default.DEFAULT] | None = DEFAULT) -> Lease:
        """Extend the lease to ``ttl`` seconds from now (default: the lock's ``ttl``).

        Raises:
            LockLostError: the lease is no longer ours.
        """
        new_ttl = self.ttl if ttl is DEFAULT else validate_ttl(ttl)
        return self.renewed(self.backend.renew(self._require_lease(), new_ttl))

    def renewed(self, renewed: Lease | None) -> Lease:
        """Hold ``renewed``, what a renewal of the held lease gave (None: LockLostError)."""
        lease = self._require_lease()
        if renewed is None:
            raise LockLostError(lease.key, lease.fence, "renew")
        self._lease = renewed
        if self._renewer is not None:
            self._renewer.lease = renewed
        return renewed

    def release(
        self,
        outcome: Outcome = Outcome.SUCCEEDED,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
        *,
        reported: bool = False,
    ) -> Record | None:
        """Release the lease and record how it ended.

        A lease lost meanwhile is recorded ``lost``, with the outcome it could not record
        in the record's details; a success with a result (a ``once`` task's) is kept all
        the same, unless another success was kept first. While the store fails, the
        release of such a success is tried again with backoff for up to
        :attr:`success_retry` seconds before the error is raised.

        Returns:
            the record, or None if the lease had been lost (logged as ``lost``: an error,
            or a warning when the loss was reported already while the lease was held, by the
            Lock or, ``reported``, by its caller: an AsyncLock's renewal).

        Raises:
            BackendError: the store failed (for a success: still failing after
                ``success_retry`` seconds).
        """
        ending = self.ending(outcome, problem, details, result)
        ending = ending._replace(reported=True) if reported else ending
        if remembered(ending.outcome, result, ending.lease.holder.task_name) is None:
            return releasing.release(self.backend, ending)
        return releasing.release_success(self.backend, ending, self.success_retry)

    def ending(
        self, outcome: Outcome, problem: str | None, details: str | None, result: Any
    ) -> Ending:
        """Stop holding the lease (:meth:`detach`): what its release is to record."""
        reported = self.lost
        outcome = outcome if type(outcome) is Outcome else Outcome(outcome)
        return Ending(self.detach(), outcome, problem, details, result, reported)

    def record_success(self, connection: Any, result: Any, task_name: str | None = None) -> Record:
        """Keep this lease's success (``result``) for ``once`` inside the caller's own
        transaction on ``connection``, so that it commits or rolls back with the caller's
        writes (Postgres store, on the store's own database); under ``task_name`` rather
        than the holder's.

        Raises:
            AlreadySucceededError: another success is kept already; roll back.
            ConfigurationError: the store cannot, or ``connection`` does not reach it.
        """
        lease = self._require_lease().for_task(task_name)
        record = Record(lease, time.time(), Outcome.SUCCEEDED, None, None, result)
        self.backend.record_success(connection, record)
        return record

    def detach(self) -> Lease:
        """Stop renewing and forget the lease without releasing it; returns it.

        For a lease that outlives this object: a Celery task keeps its lease for its retry,
        which takes it over with ``acquire(replace=lease.token)``.
        """
        with _HOLDING:  # two threads' releases of one Lock: the second is told it is not held
            lease, renewer, unwatch = self._require_lease(), self._renewer, self._unwatch
            self._lease, self._renewer, self._unwatch = None, None, None
        if renewer is not None:
            renewer.stop()
            lease = renewer.lease
        if unwatch is not None:
            unwatch()
        held().discard(lease.token)
        return lease

    def keep(self, ttl: float) -> Lease | None:
        """Stop holding the lease without releasing it, and keep it alive ``ttl`` seconds
        from now (on every store, a session store included) for a later
        ``acquire(replace=lease.token)``: a Celery task keeps its lease for its retry.

        Returns:
            the kept lease, or None if it was lost meanwhile.
        """
        lease = self.detach()
        try:
            kept = self.backend.renew(lease, validate_ttl(ttl))
        except BackendError:
            extra = fields("keep_failed", lease, backend=self.backend.url)
            logger.exception("could not extend %s for its next acquisition", lease.key, extra=extra)
            kept = lease
        if kept is not None:
            held().add(self.backend, kept, kept=True)
        return kept

    def current(self) -> Lease | None:
        """The lease on this key now, whoever holds it, or None (with a ``limit``: one of
        the leases on its slots, see :meth:`holders`).

        Raises:
            BackendError: the store failed.
        """
        gets = (self.backend.get(slot) for slot in self.slots)  # one read a slot, up to one held
        return next((lease for lease in gets if lease is not None), None)

    def holders(self) -> list[Lease]:
        """Every lease on this key now (on each of its slots, with a ``limit``).

        Raises:
            BackendError: the store failed.
        """
        return [lease for slot in self.slots if (lease := self.backend.get(slot)) is not None]

    def end(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
    ) -> Record | None:
        """Release ``lease`` of this key, which this Lock does not hold (a dead process's,
        found by :meth:`current`), by its token; None if it was no longer current."""
        if lease.key not in self.slots:
            raise ConfigurationError(f"lease of {lease.key!r} given to the lock of {self.key!r}")
        record = self.backend.release(lease, outcome, problem, details)
        if record is not None:
            metrics.released(record)
        return record

    def last_success(self, task_name: str) -> Record | None:
        """The success of ``task_name`` kept on this key (its result is what ``once``
        replays), or None."""
        return self.backend.last_success(self.key, task_name)

    def record_skip(self, problem: str, details: str, holder: Holder | None = None) -> Record:
        """Record an attempt that ran nothing under this key (a busy key skipped): a
        ``skipped`` record of a lease with fence 0 and a token of its own."""
        now = time.time()
        lease = Lease(self.key, new_token(), 0, holder or self.next_holder(), now)
        record = Record(lease, now, Outcome.SKIPPED, problem, details)
        self.backend.add_record(record)
        return record

    def _require_lease(self) -> Lease:
        lease = self.lease
        if lease is None:
            raise ConfigurationError(f"lock {self.key!r} is not held by this Lock object")
        return lease

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        end_block(self.release, self._require_lease(), exc)

    def __repr__(self) -> str:
        state = "held" if self._lease is not None else "free"
        return f"<Lock {self.key!r} {state} on {self.backend!r}>"
