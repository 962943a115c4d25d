"""The backend contract: :class:`LockBackend` and its :class:`Capabilities`.

A backend performs single atomic steps and never waits on its own account: waiting,
retrying and renewal live in :mod:`celery_dlock.lock` and :mod:`celery_dlock.renewal`.
Every backend passes the shared contract suite in ``tests/backends/``.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

from celery_dlock.errors import ConfigurationError
from celery_dlock.records import Holder, Lease, Outcome, Record

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_TTL",
    "AsyncStore",
    "Capabilities",
    "Check",
    "Diagnosable",
    "LockBackend",
    "MonotonicClock",
    "Place",
    "WallClock",
    "hand_over_ttl",
    "remembered",
    "server_time",
    "success_task",
    "validate_ttl",
]

#: Seconds since the epoch, as ``time.time``: what leases and records carry. Backends whose
#: expiry uses the caller's clock take one (tests pass a fake that jumps).
WallClock = Callable[[], float]
#: Seconds from an arbitrary start that never steps, as ``time.monotonic``: only ever
#: subtracted from another reading of the same clock (the object stores' server-clock window).
MonotonicClock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store guarantees, as data the tests check.

    Attributes:
        liveness: how a dead holder is noticed. ``session``: its connection ends (Postgres);
            ``process``: its process is gone from this host (file); ``lease``: it stops
            renewing before ``expires_at`` (Redis, object stores, memory).
        push_wait: ``wait()`` is woken by the store when a key is released.
        cross_process: processes on one host share the locks.
        cross_host: processes on different hosts share the locks.
        durable_history: history survives a restart of the store.
        server_clock: expiry is judged by the store's clock, not the caller's.
    """

    liveness: Literal["session", "process", "lease"]
    push_wait: bool
    cross_process: bool
    cross_host: bool
    durable_history: bool
    server_clock: bool


#: The longest ttl (ten years): beyond it a store's clock arithmetic overflows (Postgres
#: intervals, a renewer's timer); a lease that should never expire has ttl None.
MAX_TTL = 10 * 365 * 86400.0
#: Longest key accepted, in UTF-8 bytes (``keys.validate_key``, the SQL functions).
MAX_KEY_BYTES = 1024


def validate_ttl(ttl: float | None) -> float | None:
    """``ttl`` as float seconds, or None for the store's default (:attr:`default_ttl`).

    Raises:
        ConfigurationError: for zero or negative values (a zero TTL would delete the lock in
            some stores and never expire it in others), NaN, infinity and more than
            :data:`MAX_TTL`.
    """
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TTL:
        raise ConfigurationError(
            f"ttl must be a positive number of seconds up to {MAX_TTL:.0f} (ten years),"
            f" or None for the store's default (no expiry where a lease lives by its holder's"
            f" connection or process; the URL's ttl, renewed, where it lives by its ttl alone),"
            f" not {ttl!r}"
        )
    return float(ttl)


def hand_over_ttl(ttl: float | None) -> float:
    """``ttl`` of a ``hand_over``, validated: required, since nothing else would free the key."""
    seconds = validate_ttl(ttl)
    if seconds is None:
        raise ValueError("hand_over needs a ttl: nothing else would ever free the key")
    return seconds


def handed_expiry(
    current: float | None, proposed: float, seen: float | None = None, if_unchanged: bool = False
) -> float:
    """The expiry of a lease handed over: ``proposed``, or its ``current`` one if later (a
    lease without one gets ``proposed``); with ``if_unchanged``, its ``current`` one as it
    is once it is not the ``seen`` one any more. See :meth:`LockBackend.hand_over`."""
    if current is None:
        return proposed
    if if_unchanged and current != seen:
        return current
    return max(current, proposed)


@dataclass(frozen=True, slots=True)
class Check:
    """One finding of ``diagnose()``: what was checked, whether it is fine, and the detail."""

    name: str
    ok: bool
    detail: str


_P = TypeVar("_P", bound="Place")


class Place(ABC):
    """A caller's place in a store's queue of waiters for ``key``, from ``wait``.

    Held by the caller, not by hidden per-thread state: passed to the next ``try_acquire``
    or ``wait`` of the key, and left when the caller gives up (or when collected).
    """

    key: str

    @classmethod
    def of(cls: type[_P], place: Place | None, key: str) -> _P | None:
        """``place`` if it is a place of this kind in the queue of ``key`` still held; a
        place of this kind for another key is left."""
        if not isinstance(place, cls) or not place.held:
            return None
        if place.key != key:
            place.leave()
            return None
        return place

    @property
    @abstractmethod
    def held(self) -> bool:
        """Whether the place is still the caller's: not left, not used up by an acquire."""

    @abstractmethod
    def leave(self) -> None:
        """Give the place up: the next waiter moves up. Idempotent."""

    async def leave_now(self) -> None:
        """:meth:`leave`, and return once the store has let the next waiter in: from an
        asyncio client, whose ``leave`` runs in a task of the event loop (which may end
        before the task has run, ``asyncio.run`` returning)."""
        self.leave()


@runtime_checkable
class Diagnosable(Protocol):
    """What a store with a clock and health checks of its own offers ``celery dlock
    doctor``, beside the lock contract (Redis, the object stores)."""

    def server_time(self) -> float:
        """The store's own clock now, in seconds since the epoch."""
        ...

    def diagnose(self) -> list[Check]:
        """Store-specific health checks (persistence, conditional writes...); may raise
        BackendError when the store cannot be reached."""
        ...


class AsyncStore(Protocol):
    """The calls of a lock's life, natively async: a store's own asyncio client, on the
    running event loop's connections (``LockBackend.async_store``). Each has the contract
    of the :class:`LockBackend` method of its name; the lease, record and stored form are
    the same, so a lease taken here may be released through the blocking API."""

    async def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None: ...

    async def release(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None: ...

    async def renew(self, lease: Lease, ttl: float | None) -> Lease | None: ...

    async def get(self, key: str) -> Lease | None: ...

    async def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None: ...

    async def wait_any(self, keys: Sequence[str], timeout: float) -> None: ...


def server_time(backend: LockBackend) -> float | None:
    """``backend``'s own clock now, or None where it has none it can tell (Diagnosable)."""
    return backend.server_time() if isinstance(backend, Diagnosable) else None


class LockBackend(ABC):
    """One lock store behind one narrow interface.

    Methods that change a lock are atomic and compare on the lease's token: a backend never
    deletes or overwrites a lock it does not own. Times are seconds since the epoch, kept to
    the microsecond.
    """

    #: Short name used in messages and the registry (``file``, ``postgres``...).
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    #: The URL with its password masked; set by ``from_url``.
    url: str = ""
    #: The ttl of a lease asked for with none: None (no expiry) but on a store whose only
    #: liveness is a lease's ttl, which must not keep one for ever (Redis, S3, GCS, Postgres
    #: with ``liveness=ttl``: their ``ttl`` option); a ``Lock`` then renews it.
    default_ttl: float | None = None

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, **options: Any) -> LockBackend:
        """Build the backend for ``url``; ``options`` override the URL's query options."""

    @abstractmethod
    def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None:
        """One attempt to take ``key``; never waits.

        If the current holder is provably gone (by the store's liveness rule) the key is
        taken over and the old lease recorded as ``disconnected`` or ``expired`` in the same
        atomic step.

        Args:
            replace: the token of a lease to take over although it is alive: a Celery retry
                continuing its own earlier attempt. That lease is recorded as ``retried``
                in the same atomic step; the new lease has a new token and fence.
            place: this caller's place in the key's queue of waiters, from ``wait``: the
                attempt goes first. Used up when the key is taken (or the attempt fails);
                still the caller's otherwise, for the next ``wait``. A place for another
                key is left.

        Returns:
            the new lease, or None if the key is held (by anyone but ``replace``).
        """

    @abstractmethod
    def release(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None:
        """Release ``lease`` if it is still ours and append its record, atomically.

        Returns:
            the record written, or None when the lease was no longer ours (the caller then
            reports it as ``lost``).
        """

    @abstractmethod
    def add_record(self, record: Record) -> None:
        """Append a record that ends no lease of this store: an attempt that was skipped
        because the key was held, or replayed for ``once``. Its lease has fence 0."""

    @abstractmethod
    def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        """Extend ``lease`` to ``ttl`` seconds from now if it is still ours, else None."""

    @abstractmethod
    def hand_over(self, lease: Lease, ttl: float, if_unchanged: bool = False) -> Lease | None:
        """Keep ``lease`` alive by its ``ttl`` alone from now on, ``ttl`` seconds from now:
        no longer tied to this process or its lock session, it outlives both (a dedupe mark
        is held on behalf of a queued message, not of the producer that sent it). It is
        released by its token as before, the janitor clears it only once it expired, and a
        waiter polls it. None if it is not ours any more.

        It never shortens the lease: an expiry later than ``ttl`` from now is kept (a
        worker that took a dedupe mark's message lengthens the mark to ``dedupe_ttl``,
        which another's hand-over for a shorter ``expires`` must not undo). :meth:`renew`
        shortens.

        With ``if_unchanged``, the expiry is set only if it is still ``lease.expires_at``:
        a lease renewed or handed over since ``lease`` was granted or read keeps the expiry
        it has (it is handed over all the same). A dedupe mark's producer hands it over so,
        after its send: a worker that took the message first and set the mark's end (to
        ``dedupe_ttl``, or shorter, to a replacement's ``expires``) has the last word.
        """

    @abstractmethod
    def get(self, key: str) -> Lease | None:
        """The current lease on ``key``, or None."""

    @abstractmethod
    def leases(self, prefix: str = "") -> list[Lease]:
        """Current leases whose key starts with ``prefix``, ordered by key."""

    @abstractmethod
    def history(
        self,
        key: str | None = None,
        outcome: Outcome | None = None,
        since: float | None = None,
        limit: int | None = 100,
    ) -> list[Record]:
        """Records, newest first, filtered by key, outcome and release time."""

    @abstractmethod
    def last_success(self, key: str, task_name: str) -> Record | None:
        """The ``succeeded`` record kept on ``key`` for ``task_name``: the first released
        with a ``result`` by a holder with this task name (or kept by ``remember``).

        Kept apart from history (``prune_history`` leaves it) for ``once``. Only a success
        released with a result (not None) and a holder with a task name leaves one, so the
        usual release pays nothing for it. A later release's success never replaces
        another lease's (it is still recorded in the history); the lease's own, kept by
        ``record_success`` earlier in its run, is updated.
        """

    @abstractmethod
    def remember(self, record: Record) -> bool:
        """Keep ``record`` as the last success of its key and its holder's task unless
        another lease's is kept already: the first success wins, another lease's is never
        overwritten; the lease's own (by token: kept by ``record_success`` earlier in its
        run, or by this call tried again) is updated, as a release updates it.

        For a body that succeeded after its lease was lost (the release found it gone), so
        that ``once`` does not forget the success, and for a ``Task.replace`` continuation's
        own success. ``record`` is a ``succeeded`` record with a result and a holder with a
        task name; it is not added to the history. Committed durably where the store has a
        choice.

        Returns:
            True if ``record`` is now the kept success, False if another lease's is.
        """

    @abstractmethod
    def forget_success(self, key: str, task_name: str, token: str) -> bool:
        """Forget the success kept on ``key`` for ``task_name`` (what ``last_success``
        answers) if it is still the one kept by the lease with ``token``: the next ``once``
        run of that task on that key runs its body. For an operator who undoes an effect
        (``celery-dlock forget``); a success kept since by another lease stays.

        Returns:
            True if that success was kept and is now forgotten, False if it was not kept.
        """

    @abstractmethod
    def reap(self, limit: int = 100) -> list[Record]:
        """Clear up to ``limit`` leases whose holder is gone or whose time ran out, each
        recorded as ``disconnected`` or ``expired``."""

    @abstractmethod
    def prune_history(self, before: float) -> int:
        """Delete records released before ``before``; returns how many went.

        ``last_success`` answers kept for ``once`` are not history and stay.
        """

    @abstractmethod
    def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None:
        """Return when ``key`` may have become free, or after ``timeout`` seconds.

        A push from the store where it has one, else a bounded, jittered poll; may return
        early. The caller tries again and calls again.

        A store that queues its waiters (Postgres) returns the caller's ``Place`` in that
        queue when woken: the caller hands it to its next ``try_acquire`` of ``key`` (which
        then goes before the waiters behind it) and, if that finds the key busy, to its
        next ``wait``; it ``leave()``s the place when it gives up. ``place`` is one that an
        earlier ``wait`` for ``key`` returned. None: no place is kept (a store without
        queues, a wait that timed out, a place left).
        """

    def wait_any(self, keys: Sequence[str], timeout: float) -> None:
        """Return when any of ``keys`` may have become free, or after ``timeout`` seconds:
        ``wait`` for a caller that will take whichever is free (the slots of a ``limit``),
        so without a place in any queue. May return early.

        This default waits on one of ``keys`` at random: a release of another is seen only
        at the caller's next look. A store whose push can watch several keys at once
        overrides it.
        """
        place = self.wait(random.choice(keys), timeout)
        if place is not None:
            place.leave()

    def record_success(self, connection: Any, record: Record) -> None:
        """``remember`` ``record`` inside the caller's own transaction on ``connection``, so
        that it commits with the caller's writes; only a store that lives in the caller's
        database can (Postgres).

        Raises:
            AlreadySucceededError: a success is kept already.
            ConfigurationError: this store cannot.
        """
        raise ConfigurationError(
            f"record_success needs the postgres store (the caller's own transaction on the "
            f"store's database); the {self.name} store keeps successes at release only"
        )

    def watch(self, lease: Lease, on_lost: Callable[[Lease], None]) -> Callable[[], None] | None:
        """Call ``on_lost(lease)`` once, from a background thread, if this process learns
        that ``lease`` died with the connection that kept it alive (a store whose liveness
        is a session: the session ended). Returns a function that stops watching, or None
        where leases do not die that way (they expire, and renewal reports the loss, or
        they live as long as this process)."""
        return None

    def async_store(self) -> AsyncStore | None:
        """This store's native asyncio client, for :class:`~celery_dlock.AsyncLock`, or
        None where it has none (its calls then run in a bounded pool of threads)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional for stores that hold nothing
        """Release clients and files held by this process."""

    def __enter__(self) -> LockBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


def remembered(outcome: Outcome | str, result: Any, task_name: str | None) -> str | None:
    """The task name under which a release becomes its key's last success (``last_success``,
    for ``once``): a success with a result, of a holder with a task name; else None.

    The one statement of the rule, for every backend, whatever form it holds a record in.
    """
    if result is not None and outcome == Outcome.SUCCEEDED:  # an Outcome or its value
        return task_name
    return None


def success_task(record: Record) -> str:
    """The task name under which ``remember`` keeps ``record``.

    Raises:
        ConfigurationError: ``record`` is not a success with a result of a named task.
    """
    task_name = remembered(record.outcome, record.result, record.lease.holder.task_name)
    if task_name is None:
        raise ConfigurationError(
            f"only a succeeded record with a result and a task name can be remembered, not "
            f"{record.outcome} on {record.key!r} (task {record.lease.holder.task_name!r})"
        )
    return task_name
