"""What this process has: one backend per URL (:func:`shared_backend`), and the leases it
holds (the one registry of them; :func:`release_all` releases them all).

Both are per process: a forked child (a Celery pool child) makes its own backends and
clients, and starts holding nothing, while the parent's stay open, and in use, in the
parent.
"""

from __future__ import annotations

import atexit
import logging
import threading
import warnings
from collections import OrderedDict

from celery_dlock.backends import backend_from_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.common import ProcessLocal
from celery_dlock.errors import DLockError
from celery_dlock.events import fields
from celery_dlock.records import Lease, Outcome, Record

__all__ = ["abandon", "held", "release_all", "shared_backend"]

logger = logging.getLogger("celery_dlock")

_shared: ProcessLocal[dict[str, LockBackend]] = ProcessLocal(dict)
_shared_mutex = threading.Lock()


def shared_backend(url: str) -> LockBackend:
    """The backend for ``url``, made once per process and reused (clients are costly)."""
    backends = _shared.get()
    backend = backends.get(url)
    if backend is None:
        with _shared_mutex:
            backend = backends.get(url)
            if backend is None:
                backend = backends[url] = backend_from_url(url)
    return backend


class _Held:
    """The leases this process holds, or keeps alive for a later acquisition (a Celery
    task's lease kept for its retry): the one registry, so that they can all be released
    when the process stops (:func:`release_all`). Bounded: the oldest entries are dropped
    past ``limit`` (a leak of leases never released must not grow without end)."""

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self._mutex = threading.Lock()
        self._leases: OrderedDict[str, tuple[LockBackend, Lease, bool]] = OrderedDict()

    def add(self, backend: LockBackend, lease: Lease, kept: bool = False) -> None:
        with self._mutex:
            self._leases[lease.token] = (backend, lease, kept)
            while len(self._leases) > self.limit:
                self._leases.popitem(last=False)

    def discard(self, token: str) -> None:
        with self._mutex:
            self._leases.pop(token, None)

    def tokens(self) -> list[str]:
        with self._mutex:
            return list(self._leases)

    def take(self, token: str) -> tuple[LockBackend, Lease, bool] | None:
        """Remove and return the entry of ``token``, if it is still held."""
        with self._mutex:
            return self._leases.pop(token, None)

    def drain(self, backend: LockBackend | None = None) -> list[tuple[LockBackend, Lease, bool]]:
        """Remove and return every entry, or only those held on ``backend``."""
        with self._mutex:
            if backend is None:
                items = list(self._leases.values())
                self._leases.clear()
                return items
            mine = [token for token, entry in self._leases.items() if entry[0] is backend]
            return [self._leases.pop(token) for token in mine]


_held_here: ProcessLocal[_Held] = ProcessLocal(_Held)


def held() -> _Held:
    """The leases held by this process; a forked child starts with none of its parent's."""
    return _held_here.get()


def release_all(
    outcome: Outcome = Outcome.ABANDONED,
    problem: str | None = "release_all",
    details: str | None = "released by celery_dlock.release_all()",
    *,
    kept: Outcome | None = None,
    backend: LockBackend | None = None,
) -> list[Record]:
    """Release every lease this process holds (only those on ``backend``, when given),
    each by its own token, recorded as ``outcome`` (a lease kept alive for a later
    acquisition as ``kept``, by default the same). Failures are logged, not raised: this
    runs as the process stops. The Lock objects that held them find their leases gone
    (their release records ``lost``).

    Returns:
        the records written.
    """
    records = []
    for store, lease, was_kept in held().drain(backend):
        ending = (kept or outcome) if was_kept else outcome
        note = f"{details or ''} (kept for a later acquisition)".strip() if was_kept else details
        try:
            record = store.release(lease, ending, problem, note)
        except DLockError as exc:
            extra = fields("release_failed", lease, outcome=ending, backend=store.url)
            logger.error("cannot release %s: %s", lease.key, exc, extra=extra)
            continue
        if record is not None:
            records.append(record)
    return records


def abandon(token: str, why: str) -> Record | None:
    """Release the lease of ``token`` if this process still holds it, recorded
    ``abandoned`` with ``why``, with a ResourceWarning and a logged warning naming the key:
    its holder let go of it without a release."""
    entry = held().take(token)
    if entry is None:
        return None
    backend, lease, _ = entry
    message = f"lock on {lease.key!r} (fence {lease.fence}) {why}: released as abandoned"
    warnings.warn(message, ResourceWarning, stacklevel=2)
    extra = fields("abandoned", lease, outcome=Outcome.ABANDONED, backend=backend.url)
    logger.warning("%s", message, extra=extra)
    try:
        return backend.release(lease, Outcome.ABANDONED, "abandoned", why)
    except DLockError as exc:
        logger.error("cannot release %s: %s", lease.key, exc, extra=extra)
        return None


def _at_exit() -> None:
    """A process that ends normally releases what it still holds, as abandoned, and closes
    the backends it shared (their connections would otherwise be collected open)."""
    for token in held().tokens():
        abandon(token, "was still held when the process ended")
    for backend in list(_shared.get().values()):
        try:
            backend.close()
        except Exception as exc:
            logger.debug("closing %s at exit: %s", backend.url, exc, extra=fields("close_failed"))


atexit.register(_at_exit)
