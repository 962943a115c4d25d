"""``wait`` on an object store: reads only, with jittered pauses from 50 ms doubling to
1 s, bounded by the time left and by the lease's expiry, ended at once by a release made
by another thread of this process."""

from __future__ import annotations

import random
import threading
import time

from celery_dlock.backends.objectstore.bucket import Bucket
from celery_dlock.backends.objectstore.clock import verdict

__all__ = ["poll"]

#: ``wait`` polls first after this, then doubles up to the cap (jittered).
_POLL_FIRST = 0.05
_POLL_CAP = 1.0


def poll(objects: Bucket, name: str, deadline: float, woken: threading.Event) -> None:
    """Read the lock object ``name`` until it is free or its lease expired (by the
    server's clock), ``deadline`` (``time.monotonic``) passed, or ``woken`` is set."""
    pause = _POLL_FIRST
    while True:
        found = objects.read(name)
        state = objects.decode(found, name)
        objects.local.get().saw(name, state)
        if state is None or state.lease is None:
            return
        now = objects.now()
        if verdict(state.lease, now, found.stamp.date) == "expired":
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        sleep = min(remaining, pause * random.uniform(0.5, 1.0))
        if state.lease.expires_at is not None:
            sleep = min(sleep, max(_POLL_FIRST, state.lease.expires_at - now.low))
        if woken.wait(sleep):
            return
        pause = min(_POLL_CAP, pause * 2)
