"""What the locks on several keys share, :class:`KeySet`: the keys, each with its own lock,
the order of the next try, and the keys a try let go (recorded ``skipped``).

:class:`~celery_dlock.locks.Locks` (threads) and :class:`~celery_dlock.alocks.AsyncLocks`
(asyncio) are KeySets; each adds only its tries, waits and releases, which block or await.
The rules of a set (all or none, the busy key first, no waiting while holding part of it)
are in the docstring of ``locks.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar

from celery_dlock.backends.base import LockBackend
from celery_dlock.errors import ConfigurationError, LockLostError
from celery_dlock.keys import validate_key
from celery_dlock.lock import DEFAULT, _Default, validate_wait
from celery_dlock.process import shared_backend
from celery_dlock.records import Lease, Outcome, Record

__all__ = ["KeyLock", "KeySet", "lost_lease"]


class KeyLock(Protocol):
    """What a KeySet reads of the lock on one of its keys (a Lock or an AsyncLock)."""

    @property
    def key(self) -> str: ...

    @property
    def lease(self) -> Lease | None: ...

    @property
    def lost(self) -> bool: ...


L = TypeVar("L", bound=KeyLock)


class KeySet(Generic[L]):
    """A lock on several keys of one backend, all of them or none: the keys in key order,
    each with a lock of its own that never waits (the set waits), and what one try leaves
    to the next.

    Args:
        backend: a :class:`LockBackend`, or a URL.
        keys: the full keys (duplicates count once).
        ttl, wait: as for :class:`~celery_dlock.lock.Lock`; ``ttl`` for every key.
        options: the other arguments of each key's lock (``holder``, ``renew``, ...).

    Raises:
        LockKeyError: a key is empty, too long or has control characters.
        ConfigurationError: no key, or a bad ``ttl`` or ``wait``.
    """

    #: The subclass's name, in messages.
    _kind: str
    #: Makes the lock of one key: ``(backend, key, ttl, wait, **options)``.
    _per_key: Callable[..., L]

    def __init__(
        self,
        backend: LockBackend | str,
        keys: Iterable[str],
        ttl: float | None,
        wait: float | None,
        **options: Any,
    ) -> None:
        self.backend = shared_backend(backend) if isinstance(backend, str) else backend
        self.keys = tuple(sorted({validate_key(key) for key in keys}))
        if not self.keys:
            raise ConfigurationError(f"{self._kind} needs at least one key")
        #: The keys joined, for messages and logs.
        self.key = "+".join(self.keys)
        self.wait = validate_wait(wait)
        self.locks = tuple(self._per_key(self.backend, key, ttl, 0, **options) for key in self.keys)
        #: The lock of the key the next try takes first (the one found busy), or None.
        self._first: L | None = None
        #: The keys the last try took and let go (each recorded then) for a busy one.
        self._let_go_keys: frozenset[str] = frozenset()

    @property
    def leases(self) -> list[Lease]:
        """The leases held now, one per key in key order (empty when not held)."""
        leases = [lock.lease for lock in self.locks]
        return [lease for lease in leases if lease is not None]

    @property
    def lease(self) -> Lease | None:
        """The first key's lease, or None."""
        return self.locks[0].lease

    @property
    def lost(self) -> bool:
        """True once the lease of any key was lost."""
        return any(lock.lost for lock in self.locks)

    def _begin(
        self, wait: float | Literal[_Default.DEFAULT] | None
    ) -> tuple[float | None, float | None]:
        """A new acquire, its first try in key order: its wait (``DEFAULT``: the set's
        own) and its deadline on the monotonic clock (None: no limit)."""
        self._first = None
        limit = self.wait if wait is DEFAULT else validate_wait(wait)
        return limit, None if limit is None else time.monotonic() + limit

    def _order(self) -> tuple[L, ...]:
        """The locks in the order of the next try: key order, or the busy key's first."""
        # Trying the key found busy first takes nothing while it stays busy: the keys
        # before it were taken and let go (a record, a fence) at every wake-up otherwise.
        first = self._first
        return self.locks if first is None else (first, *(k for k in self.locks if k is not first))

    def _busy(self, lock: L, taken: Sequence[L]) -> tuple[Outcome, str, str]:
        """The try found ``lock``'s key busy after taking ``taken``, which it lets go now:
        the outcome, problem and details to record them with."""
        self._let_go_keys = frozenset(one.key for one in taken)
        # Out of order and then busy: sorted next time (see the doc of locks.py).
        self._first = None if self._first is not None and taken else lock
        why = f"{lock.key} of the same set was busy: released, to try the set again"
        return Outcome.SKIPPED, "locked", why

    @staticmethod
    def _pause(deadline: float | None, longest: float) -> float | None:
        """How long the next wait lasts: ``longest``, cut at ``deadline``; None once that
        has passed."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None
        return longest if remaining is None else min(longest, remaining)

    @staticmethod
    def _records(ended: Sequence[tuple[Lease, Record | None]]) -> list[Record] | None:
        """The records of a release, in key order, or None if a lease had been lost."""
        kept = [record for _, record in ended if record is not None]
        return kept if len(kept) == len(ended) else None

    @staticmethod
    def _raise_if_lost(ended: Sequence[tuple[Lease, Record | None]]) -> None:
        """Raise :class:`LockLostError` if a lease of a release had been lost: naming the
        key whose lease was lost, not the set's first key."""
        lost = [lease for lease, record in ended if record is None]
        if lost:
            raise LockLostError(lost[0].key, lost[0].fence, "release")

    def __repr__(self) -> str:
        state = "held" if self.lease is not None else "free"
        return f"<{self._kind} {self.key!r} {state} on {self.backend!r}>"


def lost_lease(lock: KeyLock | KeySet[Any]) -> Lease:
    """The lease ``lock`` lost: of a set, the first key's (in key order) that was lost, else
    its first lease; of a :class:`Lock` or an :class:`AsyncLock`, its lease. For the error
    that names the loss.

    Raises:
        ConfigurationError: ``lock`` holds nothing.
    """
    held: Sequence[KeyLock] = lock.locks if isinstance(lock, KeySet) else (lock,)
    found = [one.lease for one in held if one.lease is not None]
    lost = [one.lease for one in held if one.lost and one.lease is not None]
    if not found:
        raise ConfigurationError(f"lock {lock.key!r} is not held by this object")
    return (lost or found)[0]
