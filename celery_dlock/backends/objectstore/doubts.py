"""Acquires whose outcome is unknown, and their settling.

An acquire's write of a lock object (create-if-absent or swap) can go unanswered (a
timeout, a reset) and the read-back that would settle it fail too, or find the write maybe
still in flight: the acquire raises :class:`BackendError`. If the write landed, the key is
held, until its ttl ends, by a lease nobody has. So this process notes the acquire's key
and token and, at its next acquire, release or renew on the backend, reads that key and,
if it still holds that token, ends the lease by its token, recorded ``disconnected`` (as
the Redis store settles its doubtful acquires); a lease with another token is left alone.
A settling the store does not answer either is tried again at the next call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from celery_dlock.backends.common import ProcessLocal
from celery_dlock.backends.objectstore.bucket import Bucket
from celery_dlock.backends.objectstore.clock import maybe_expired
from celery_dlock.backends.objectstore.layout import Layout, LockState
from celery_dlock.errors import BackendError
from celery_dlock.records import Outcome, Record

__all__ = ["Doubts", "End"]

#: Doubtful acquires kept per process (the Redis store's bound).
_LIMIT = 1000
_SETTLED = "the answer to this acquire was lost; its lease was released once the store answered"

#: The backend's ``_end``: swaps a held lock object to free with its lease's record.
End = Callable[[LockState, Outcome, "str | None", "str | None"], "Record | None"]


class _Pending:
    """This process's doubtful acquires, (key, token), oldest first."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.items: list[tuple[str, str]] = []


class Doubts:
    """The doubtful acquires of one backend, per process (a forked child starts with none).

    Args:
        objects: the backend's bucket.
        layout: the backend's object names.
    """

    def __init__(self, objects: Bucket, layout: Layout) -> None:
        self._objects = objects
        self._layout = layout
        self._pending: ProcessLocal[_Pending] = ProcessLocal(_Pending)

    def pending(self) -> list[tuple[str, str]]:
        pending = self._pending.get()
        with pending.mutex:
            return list(pending.items)

    @contextlib.contextmanager
    def unanswered(self, key: str, token: str) -> Iterator[None]:
        """Note (``key``, ``token``) if the block, an acquire's write of that lease and what
        follows it, raises :class:`BackendError`: the lease may be held unknown to anyone."""
        try:
            yield
        except BackendError:
            pending = self._pending.get()
            with pending.mutex:
                if len(pending.items) < _LIMIT:
                    pending.items.append((key, token))
            raise

    def settle(self, end: End) -> None:
        """End the leases of the doubtful acquires that landed (by token) and forget each
        once its key was read; stop at the first the store does not answer (the caller's
        own request then fails, with its own error, or gets through)."""
        if not self._pending.get().items:  # the usual case, on every call: no lock taken
            return
        for key, token in self.pending():
            try:
                self._settle(key, token, end)
            except BackendError:
                return
            pending = self._pending.get()
            with pending.mutex, contextlib.suppress(ValueError):
                pending.items.remove((key, token))

    def _settle(self, key: str, token: str, end: End) -> None:
        name = self._layout.lock(key)
        state = self._objects.decode(self._objects.read(name), name)
        if state is None or state.lease is None or state.lease.token != token:
            return  # it never landed, or it ended: nothing of ours is there
        if maybe_expired(state.lease, self._objects.now()):
            end(state, Outcome.EXPIRED, "expired", None)
        else:
            end(state, Outcome.DISCONNECTED, "disconnected", _SETTLED)
