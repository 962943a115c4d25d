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
from collections.abc import Sequence

from celery_dlock.backends import backend_from_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.common import ProcessLocal
from celery_dlock.errors import DLockError
from celery_dlock.events import fields
from celery_dlock.records import Holder, Lease, Outcome, Record

__all__ = ["abandon", "abandon_grant", "held", "release_all", "shared_backend"]

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
    past ``limit`` (a leak of leases never released must not grow without end). Each entry
    remembers the thread that took it: a lease another live thread holds may still guard
    that thread's work (a body of a Celery threads pool)."""

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self._mutex = threading.Lock()
        self._leases: OrderedDict[str, tuple[LockBackend, Lease, bool]] = OrderedDict()
        self._threads: dict[str, threading.Thread] = {}

    def add(self, backend: LockBackend, lease: Lease, kept: bool = False) -> None:
        with self._mutex:
            self._leases[lease.token] = (backend, lease, kept)
            self._threads[lease.token] = threading.current_thread()
            while len(self._leases) > self.limit:
                token, _ = self._leases.popitem(last=False)
                self._threads.pop(token, None)

    def lease(self, token: str) -> Lease | None:
        """The lease of ``token``, if this process holds or keeps it."""
        with self._mutex:
            entry = self._leases.get(token)
        return None if entry is None else entry[1]

    def discard(self, token: str) -> None:
        with self._mutex:
            self._leases.pop(token, None)
            self._threads.pop(token, None)

    def tokens(self, in_use: bool = True) -> list[str]:
        """The tokens held; with ``in_use=False``, not those in use by another thread."""
        with self._mutex:
            running = _running()
            return [t for t in self._leases if in_use or not self._in_use(t, running)]

    def backends(self) -> list[LockBackend]:
        """The backends of the leases held."""
        with self._mutex:
            return [backend for backend, _, _ in self._leases.values()]

    def take(self, token: str) -> tuple[LockBackend, Lease, bool] | None:
        """Remove and return the entry of ``token``, if it is still held."""
        with self._mutex:
            self._threads.pop(token, None)
            return self._leases.pop(token, None)

    def drain(
        self, backend: LockBackend | None = None, in_use: bool = True
    ) -> list[tuple[LockBackend, Lease, bool]]:
        """Remove and return every entry, or only those held on ``backend``; with
        ``in_use=False``, not those in use by another thread (see :meth:`_in_use`)."""
        with self._mutex:
            running = _running()
            mine = [
                token
                for token, entry in self._leases.items()
                if (backend is None or entry[0] is backend)
                and (in_use or not self._in_use(token, running))
            ]
            for token in mine:
                self._threads.pop(token, None)
            return [self._leases.pop(token) for token in mine]

    def _in_use(self, token: str, running: set[int]) -> bool:
        """Whether ``token``'s lease may guard work under way: held (not kept for a later
        acquisition) by another thread that still runs (its ``id`` in ``running``). Its work
        goes on while we release, so releasing would let another holder in beside it."""
        thread = self._threads.get(token)
        kept = self._leases[token][2]
        current = threading.current_thread()
        return not kept and thread is not None and thread is not current and id(thread) in running


def _running() -> set[int]:
    """The ``id`` of every thread of this process that has not ended. Not
    ``Thread.is_alive()``: a ``join()`` interrupted by a signal handler's exception marks
    a running thread stopped on Python 3.11 and 3.12 (its bpo-45274 fix; seen when a
    worker's SIGQUIT interrupts its threads pool's shutdown), while the thread stays among
    ``threading.enumerate()`` until it really ends."""
    return {id(thread) for thread in threading.enumerate()}


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
    in_use: bool = True,
) -> list[Record]:
    """Release every lease this process holds (only those on ``backend``, when given),
    each by its own token, recorded as ``outcome`` (a lease kept alive for a later
    acquisition as ``kept``, by default the same). Failures are logged, not raised: this
    runs as the process stops. The Lock objects that held them find their leases gone
    (their release records ``lost``). With ``in_use=False``, a lease held by another
    thread that still runs is left to it (a worker stopping while a body of its threads
    pool runs: that body releases it when it ends, or, if the process ends first, the
    store's liveness frees it).

    Returns:
        the records written.
    """
    records = []
    for store, lease, was_kept in held().drain(backend, in_use):
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
    extra = fields("abandoned", lease, outcome=Outcome.ABANDONED, backend=backend.url)
    try:
        record = backend.release(lease, Outcome.ABANDONED, "abandoned", why)
    except DLockError as exc:
        logger.error("cannot release %s: %s", lease.key, exc, extra=extra)
        record = None
        end = "its release failed"
    else:  # said after the release: a lease that had ended meanwhile is not "released"
        end = "released as abandoned" if record is not None else "it had ended already"
    message = f"lock on {lease.key!r} (fence {lease.fence}) {why}: {end}"
    warnings.warn(message, ResourceWarning, stacklevel=2)
    logger.warning("%s", message, extra=extra)
    return record


def abandon_grant(
    backend: LockBackend, keys: Sequence[str], holder: Holder, exc: BaseException
) -> list[Record]:
    """Release what the store may have granted ``holder`` on ``keys`` while ``exc`` cut the
    attempt: an exception raised between the store's grant and its holder's hold (a Celery
    soft time limit, an interrupt) would leave the key held by nobody in a process that
    lives on (on Postgres and the file store, until it ends). A lease of ``holder`` (its
    nonce) is released ``abandoned``; failures are logged."""
    records = []
    for key in keys:
        try:
            lease = backend.get(key)
            if lease is None or lease.holder.nonce != holder.nonce:
                continue
            why = f"its acquisition was cut by {type(exc).__name__} after the store granted it"
            record = backend.release(lease, Outcome.ABANDONED, type(exc).__name__, why)
        except DLockError as error:
            extra = fields(
                "release_failed", key=key, outcome=Outcome.ABANDONED, backend=backend.url
            )
            logger.error("cannot look for a lease granted on %s: %s", key, error, extra=extra)
            continue
        if record is not None:
            extra = fields("abandoned", lease, outcome=Outcome.ABANDONED, backend=backend.url)
            logger.warning("lock on %r (fence %d) %s", key, lease.fence, why, extra=extra)
            records.append(record)
    return records


def _at_exit() -> None:
    """A process that ends normally releases what it still holds, as abandoned, and closes
    the backends it shared (their connections would otherwise be collected open). A lease
    that a thread still running holds (a daemon thread, or a pool's thread the interpreter
    did not wait for) is not released under it: the process's end frees it by the store's
    liveness, once that thread can no longer run."""
    for token in held().tokens(in_use=False):
        abandon(token, "was still held when the process ended")
    in_use = {id(backend) for backend in held().backends()}  # what is left is in use
    for backend in list(_shared.get().values()):
        if id(backend) in in_use:
            continue  # its session keeps a running thread's lease: the process's end ends it
        try:
            backend.close()
        except Exception as exc:
            logger.debug("closing %s at exit: %s", backend.url, exc, extra=fields("close_failed"))


atexit.register(_at_exit)
