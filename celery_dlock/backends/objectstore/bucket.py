"""The bucket as the lock algorithm sees it: this process's adapter of the store, reads
and conditional writes timed against the server's clock, and a write whose answer was lost
settled by reading it back."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery_dlock.backends.base import MonotonicClock
from celery_dlock.backends.common import ProcessLocal
from celery_dlock.backends.objectstore import clock as server_clocks
from celery_dlock.backends.objectstore.clock import CALIBRATED, ServerClock, ServerNow
from celery_dlock.backends.objectstore.layout import LockState, encode, lock_body
from celery_dlock.backends.objectstore.local import Local
from celery_dlock.backends.objectstore.store import Found, ObjectStore, UnsureWrite, Written
from celery_dlock.errors import BackendError
from celery_dlock.records import Lease, new_token

__all__ = ["Bucket"]

_CALIBRATION_STEP = 0.04
_CALIBRATION_BUDGET = 2.5

#: Tries at raising the fence floor when other writers keep changing it.
_FLOOR_ATTEMPTS = 8

Reply = TypeVar("Reply", Found, Written)


class Bucket:
    """One backend's bucket, per process.

    Args:
        open_store: makes this process's adapter (called lazily, once per process).
        endpoint: what identifies the server whose clock is measured.
        clock: the local clock that measures time between responses.
        url: the backend's URL, for error messages.
        probe: the object read to learn the server's clock.
        floor: the object that keeps the fence floor (the highest fence of a deleted lock
            object).
    """

    def __init__(
        self,
        open_store: Callable[[], ObjectStore],
        endpoint: Callable[[], str],
        clock: MonotonicClock,
        url: Callable[[], str],
        *,
        probe: str,
        floor: str,
    ) -> None:
        self.clock = clock
        self._endpoint = endpoint
        self._url = url
        self._probe = probe
        self._floor = floor
        self._stores: ProcessLocal[ObjectStore] = ProcessLocal(open_store, _close_store)
        #: What this process last saw and wrote of each lock object, and its waiters.
        self.local: ProcessLocal[Local] = ProcessLocal(Local)

    def store(self) -> ObjectStore:
        return self._stores.get()

    def close(self) -> None:
        self._stores.reset()

    @property
    def server_clock(self) -> ServerClock:
        return server_clocks.shared(self._endpoint(), self.clock)

    def timed(self, call: Callable[[], Reply]) -> Reply:
        sent = self.clock()
        reply = call()
        self.server_clock.observe(reply.stamp, sent, self.clock())
        return reply

    def read(self, name: str) -> Found:
        store = self.store()
        return self.timed(lambda: store.read(name))

    def create(self, name: str, body: bytes) -> Written:
        store = self.store()
        return self.timed(lambda: store.create(name, body))

    def decode(self, found: Found, name: str) -> LockState | None:
        return LockState.decode(found, name, self._url())

    def now(self) -> ServerNow:
        now = self.server_clock.now()
        if now is None:
            self.read(self._probe)
            now = self.server_clock.now()
        if now is None:
            raise BackendError(
                "the object store sent no Date header: expiry cannot be judged by its clock",
                self._url(),
            )
        return now

    def calibrate(self) -> None:
        """Narrow the server clock's window by reading around a change of its ``Date``
        (at most ~2.5 s; once a window is narrow, ordinary traffic keeps it so)."""
        deadline = time.monotonic() + _CALIBRATION_BUDGET
        while self.server_clock.uncertainty > CALIBRATED and time.monotonic() < deadline:
            self.read(self._probe)
            time.sleep(_CALIBRATION_STEP)

    def put(
        self, name: str, body: bytes, version: str | None, write: str
    ) -> tuple[str | None, Found | None]:
        """Create (``version`` None) or swap ``name``; settle a lost answer by reading back.

        Returns:
            ``(version, None)`` if our body is now the object's, else ``(None, found)`` with
            what the object holds now.

        Raises:
            BackendError: the write may still be in flight (the object is unchanged and the
                request failed without an answer).
        """
        store = self.store()
        unsure: UnsureWrite | None = None
        try:
            if version is None:
                written = self.timed(lambda: store.create(name, body))
            else:
                written = self.timed(lambda: store.swap(name, body, version))
            if written.version is not None:
                return written.version, None
        except UnsureWrite as exc:
            unsure = exc
        # A 412 may answer the client library's retry of our own write that had landed.
        found = self.read(name)
        try:
            current = json.loads(found.body) if found.body is not None else None
        except ValueError:
            current = None
        if isinstance(current, dict) and current.get("write") == write:
            return found.version, None
        if unsure is not None and found.version == version:
            raise BackendError(
                f"a write to {name!r} failed without an answer and may still take effect",
                self._url(),
            ) from unsure
        return None, found

    def write_state(
        self,
        name: str,
        previous: LockState | None,
        key: str,
        fence: int,
        lease: Lease | None,
        *,
        freed_at: float | None = None,
        ended: dict[str, Any] | None = None,
        successes: dict[str, dict[str, Any]] | None = None,
    ) -> tuple[LockState | None, Found | None]:
        """Write a lock object over ``previous`` (None: create it). ``ended`` and
        ``successes`` default to those of ``previous`` (carried forward).

        Returns:
            ``(state, None)`` if written, else ``(None, found)``: what is there now.
        """
        write = new_token()
        if ended is None and previous is not None:
            ended = previous.ended
        if successes is None:
            successes = {} if previous is None else previous.successes
        body = lock_body(
            key, fence, lease, write=write, freed_at=freed_at, ended=ended, successes=successes
        )
        old = None if previous is None else previous.version
        version, found = self.put(name, body, old, write)
        if version is None:
            return None, found
        state = LockState(key, fence, lease, freed_at, write, ended, successes, version)
        self.local.get().saw(name, state)
        return state, None

    def floor(self) -> int:
        """The fence floor: fences of new lock objects continue above it."""
        found = self.read(self._floor)
        if found.body is None:
            return 0
        try:
            return int(json.loads(found.body)["fence"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BackendError(f"{self._floor!r} is corrupt ({exc})", self._url()) from exc

    def raise_floor(self, fence: int) -> None:
        """Raise ``fence-floor`` to at least ``fence`` (compare-and-swap, retried on races),
        before a lock object with that fence is deleted."""
        found = self.read(self._floor)
        for _ in range(_FLOOR_ATTEMPTS):
            current = 0 if found.body is None else int(json.loads(found.body)["fence"])
            if current >= fence:
                return
            write = new_token()
            body = encode({"fence": fence, "write": write})
            version, other = self.put(self._floor, body, found.version, write)
            if version is not None:
                return
            assert other is not None
            found = other
        raise BackendError(
            "could not raise the fence floor: too many concurrent changes", self._url()
        )


def _close_store(store: ObjectStore) -> None:
    with contextlib.suppress(Exception):
        store.close()
