"""The lock as users hold it: :class:`Lock` and :func:`lock`, over any backend.

The backend makes single attempts; this module owns waiting (the backend's push wakeup,
with a bounded, jittered poll behind it since pushes can be lost), renewal of leases that
expire, and the record written when a ``with`` block ends.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from enum import Enum
from types import TracebackType
from typing import Any, Final, Literal

from celery_dlock.backends import backend_from_url, mask_url
from celery_dlock.backends.base import LockBackend, validate_ttl
from celery_dlock.errors import (
    ConfigurationError,
    LockLostError,
    LockNotAcquiredError,
    LockTimeoutError,
)
from celery_dlock.keys import validate_key
from celery_dlock.records import Holder, Lease, Outcome, Record, describe_exception
from celery_dlock.renewal import Renewer, report_lost

__all__ = ["Lock", "lock", "shared_backend", "validate_wait"]

logger = logging.getLogger("celery_dlock")

#: Longest sleep between two attempts while waiting, whatever the backend's push does.
POLL = 1.0


class _Default(Enum):
    DEFAULT = 0


#: "Use the value the Lock was made with."
DEFAULT: Final = _Default.DEFAULT

_shared: dict[str, LockBackend] = {}
_shared_mutex = threading.Lock()


def shared_backend(url: str) -> LockBackend:
    """The backend for ``url``, made once per process and reused (clients are costly)."""
    backend = _shared.get(url)
    if backend is None:
        with _shared_mutex:
            backend = _shared.get(url)
            if backend is None:
                backend = _shared[url] = backend_from_url(url)
    return backend


def forget_shared_backends() -> None:
    """Drop the shared backends without closing them: a forked child calls this so it makes
    its own, while the parent's stay open for the parent."""
    with _shared_mutex:
        _shared.clear()


def validate_wait(wait: float | None) -> float | None:
    """``wait`` as float seconds, or None for no limit; a ConfigurationError otherwise."""
    if wait is None:
        return None
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
        raise ConfigurationError(f"wait must be seconds >= 0 or None, not {wait!r}")
    return float(wait)


class Lock:
    """A lock on one key of one backend.

    Args:
        backend: a :class:`LockBackend`, or a URL (one backend per URL is shared in the
            process).
        key: the full key, e.g. ``job:report:daily``.
        ttl: seconds a lease lives without renewal; None for no expiry (liveness is then
            the holder's connection or process, where the backend has one).
        wait: seconds :meth:`acquire` waits for a busy key; 0 = do not wait, None = no limit.
        holder: who holds; by default this process, with a fresh nonce per acquisition.
        renew: renew the lease from a background thread every ``ttl / 3`` while held
            (default: when ``ttl`` is set).
        on_lost: called from a background thread when the lease is lost: a renewal found it
            gone, or (leases without ``ttl`` on a store whose liveness is a session) the
            holder's session ended.

    Raises:
        LockKeyError: ``key`` is empty, too long or has control characters.
        ConfigurationError: bad ``ttl`` or ``wait``.
    """

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
    ) -> None:
        self.backend = shared_backend(backend) if isinstance(backend, str) else backend
        self.key = validate_key(key)
        self.ttl = validate_ttl(ttl)
        self.wait = validate_wait(wait)
        self.holder = holder
        self.renew_in_background = self.ttl is not None if renew is None else renew
        self.on_lost = on_lost
        self._lease: Lease | None = None
        self._renewer: Renewer | None = None
        self._unwatch: Callable[[], None] | None = None
        self._lost = threading.Event()

    @property
    def lease(self) -> Lease | None:
        """The lease held now (the newest after renewals), or None."""
        if self._renewer is not None:
            return self._renewer.lease
        return self._lease

    @property
    def lost(self) -> bool:
        """True once background renewal found the lease gone, or its session ended."""
        if self._renewer is not None:
            return self._renewer.lost.is_set()
        return self._lost.is_set()

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
        deadline = None if limit is None else time.monotonic() + limit
        holder = self.holder or Holder.current()
        while True:
            lease = self.backend.try_acquire(self.key, holder, self.ttl, replace)
            if lease is not None:
                self._held(lease)
                return lease
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise self._busy(limit)
            pause = POLL * random.uniform(0.5, 1.0)
            self.backend.wait(self.key, pause if remaining is None else min(pause, remaining))

    def _busy(self, waited: float | None) -> LockNotAcquiredError:
        current = self.backend.get(self.key)
        holder = None if current is None else current.holder.describe()
        if not waited:
            return LockNotAcquiredError(self.key, holder)
        return LockTimeoutError(self.key, waited, holder)

    def _held(self, lease: Lease) -> None:
        self._lease = lease
        self._lost.clear()
        if self.renew_in_background and self.ttl is not None:
            self._renewer = Renewer(self.backend, lease, self.ttl, self.on_lost).start()
        else:
            self._unwatch = self.backend.watch(lease, self._session_lost)

    def _session_lost(self, lease: Lease) -> None:
        """From the backend's watcher: the session that kept ``lease`` alive ended."""
        self._lost.set()
        where = mask_url(self.backend.url)
        report_lost(lease, self.on_lost, f" with its holder's session [{where}]")

    def renew(self, ttl: float | Literal[_Default.DEFAULT] | None = DEFAULT) -> Lease:
        """Extend the lease to ``ttl`` seconds from now (default: the lock's ``ttl``).

        Raises:
            LockLostError: the lease is no longer ours.
        """
        lease = self._require_lease()
        new_ttl = self.ttl if ttl is DEFAULT else validate_ttl(ttl)
        renewed = self.backend.renew(lease, new_ttl)
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
    ) -> Record | None:
        """Release the lease and record how it ended.

        Returns:
            the record, or None if the lease had been lost (logged as ``lost``: an error,
            or a warning when the loss was reported already while the lease was held).
        """
        reported = self.lost
        lease = self.detach()
        record = self.backend.release(lease, outcome, problem, details, result)
        if record is None:
            logger.log(
                logging.WARNING if reported else logging.ERROR,
                "lease on %s (fence %d) was lost before release [%s] (outcome %s): %s not recorded",
                lease.key,
                lease.fence,
                mask_url(self.backend.url),
                Outcome.LOST,
                Outcome(outcome),
            )
        return record

    def detach(self) -> Lease:
        """Stop renewing and forget the lease without releasing it; returns it.

        For a lease that outlives this object: a Celery task keeps its lease for its retry,
        which takes it over with ``acquire(replace=lease.token)``.
        """
        lease = self._require_lease()
        if self._renewer is not None:
            self._renewer.stop()
            lease = self._renewer.lease
            self._renewer = None
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        self._lease = None
        return lease

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
        if exc is None:
            lease = self._require_lease()
            if self.release(Outcome.SUCCEEDED) is None:
                raise LockLostError(lease.key, lease.fence, "release")
            return
        problem, details = describe_exception(exc)
        self.release(Outcome.FAILED, problem, details)

    def __repr__(self) -> str:
        state = "held" if self._lease is not None else "free"
        return f"<Lock {self.key!r} {state} on {self.backend!r}>"


def lock(
    key: str,
    backend: LockBackend | str,
    ttl: float | None = None,
    wait: float | None = 0,
    **options: Any,
) -> Lock:
    """A :class:`Lock` to use in a ``with`` block, which gives the lease::

        with celery_dlock.lock("job:report:daily", backend=url, ttl=60, wait=5) as lease:
            write_report(fence=lease.fence)

    The block's end is recorded as ``succeeded``, or ``failed`` with the exception's type,
    message and traceback. If the lease was lost meanwhile, leaving the block raises
    :class:`LockLostError` (unless it already raised).
    """
    return Lock(backend, key, ttl, wait, **options)
