"""What the threads of one process share about the lock objects (made anew in a forked
child): the state last seen per object, the records known to be in history, a mutex per
stripe of keys, and the queue of waiters per key."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator

from celery_dlock.backends.objectstore.layout import LockState

__all__ = ["Local"]

_MEMO_SIZE = 1024
_SEEN_SIZE = 65536
_STRIPES = 64


class Local:
    """Per-process state of one backend.

    ``state``: the state this process last wrote or read per lock object, so that a
    renew or release of our own lease, or an acquire of a key we saw free, needs no read
    first (a stale guess fails its condition and costs the read it saved).
    ``flushed``: tokens of records known to be in ``history/``.
    ``stripe``: threads make one attempt on a key at a time (they would only race each
    other on the server).
    ``waiting``/``wake_one``: a release here wakes the first waiter of its key at once.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._states: OrderedDict[str, LockState] = OrderedDict()
        self._flushed: OrderedDict[str, None] = OrderedDict()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._waiters: dict[str, list[threading.Event]] = {}

    # -- states last seen --------------------------------------------------------------------

    def holding(self, name: str, token: str) -> LockState | None:
        """The state last seen of ``name`` if it held the lease with ``token``."""
        with self._mutex:
            state = self._states.get(name)
        if state is None or state.lease is None or state.lease.token != token:
            return None
        return state

    def free_state(self, name: str) -> LockState | None:
        """The state last seen of ``name`` if it was free."""
        with self._mutex:
            state = self._states.get(name)
        return state if state is not None and state.lease is None else None

    def saw(self, name: str, state: LockState | None) -> None:
        with self._mutex:
            if state is None:
                self._states.pop(name, None)
                return
            self._states[name] = state
            self._states.move_to_end(name)
            while len(self._states) > _MEMO_SIZE:
                self._states.popitem(last=False)

    # -- records in history --------------------------------------------------------------------

    def flushed(self, token: str) -> bool:
        with self._mutex:
            return token in self._flushed

    def mark_flushed(self, token: str) -> None:
        with self._mutex:
            self._flushed[token] = None
            while len(self._flushed) > _SEEN_SIZE:
                self._flushed.popitem(last=False)

    # -- threads ---------------------------------------------------------------------------------

    def stripe(self, name: str) -> threading.Lock:
        return self._stripes[hash(name) % _STRIPES]

    @contextlib.contextmanager
    def waiting(self, name: str) -> Iterator[threading.Event]:
        """Queue as a waiter of ``name``; the event is set when this process frees it."""
        woken = threading.Event()
        with self._mutex:
            self._waiters.setdefault(name, []).append(woken)
        try:
            yield woken
        finally:
            with self._mutex:
                queue = self._waiters.get(name, [])
                if woken in queue:
                    queue.remove(woken)
                if not queue:
                    self._waiters.pop(name, None)

    def wake_one(self, name: str) -> None:
        with self._mutex:
            queue = self._waiters.get(name)
            if queue:
                queue.pop(0).set()
