"""A waiter for a key with a ``limit`` is woken by the release of any of its slots, not only
of the one slot it happened to wait on: with two holders on the two slots of ``limit=2``, the
release of the slot the waiter's old code did not watch used to be seen only at its next
look (up to a second later; measured 300-640 ms on Redis and the file store).

The looks are pushed out of reach here: ``Lock``'s poll (``POLL``), ``AsyncLock``'s step
(``SLICE``) and Redis's ``BLPOP`` fallback are made minutes long, while the test waits at
most 60 s for the waiter, so only the store's wake-up for the released slot can hand it
over in time. ``random.choice`` picks the first slot, so the old code waited on ``#0``
and the test releases ``#1``. On Postgres the slots take turns of ``waiting.ANY_SLICE``
(one statement waits on one lock), and on a Redis Cluster the buckets of the slots take
turns of ``calls.TURN`` (a ``BLPOP`` stays in one hash slot): that turn, not the lock's poll,
wakes the waiter there.
Stores that only poll (object stores, Postgres with ``liveness=ttl``) are skipped."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

import celery_dlock.aio  # noqa: F401 - loaded for no_polls
from celery_dlock import AsyncLock, Lease, Lock, Outcome
from celery_dlock.backends.base import LockBackend
from tests.backends.storecase import StoreCase
from tests.support import eventually

#: Longer than the test waits for anything: a look (a poll) never comes in time.
NEVER = 600.0


@pytest.fixture
def no_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``celery_dlock.lock`` is also the name of the function ``lock``: the module by name.
    monkeypatch.setattr(sys.modules["celery_dlock.lock"], "POLL", NEVER)
    monkeypatch.setattr(sys.modules["celery_dlock.aio"], "SLICE", NEVER)
    try:
        import celery_dlock.backends.redis.calls as redis_calls
    except ImportError:
        pass
    else:
        monkeypatch.setattr(redis_calls, "FALLBACK", NEVER)
    monkeypatch.setattr(random, "choice", lambda seq: seq[0])


def spied(store: object, entered: threading.Event) -> None:
    """Set ``entered`` whenever ``store`` (a backend or its asyncio client) starts a wait."""
    for name in ("wait", "wait_any"):
        original = getattr(store, name, None)
        if original is None:
            continue

        def spy(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            entered.set()
            return _original(*args, **kwargs)

        setattr(store, name, functools.wraps(original)(spy))


def waiter(
    backend: LockBackend, key: str, client: str, got: list[Any], done: threading.Event
) -> None:
    """Acquire a slot of ``key`` (limit 2), waiting up to 120 s; the lease (or the error)
    goes in ``got``, and the slot is held until ``done``."""
    if client == "blocking":
        lock = Lock(backend, key, wait=120, limit=2)
        got.append(lock.acquire())
        done.wait(120)
        lock.release()
        return

    async def on_a_loop() -> None:
        lock = AsyncLock(backend, key, wait=120, limit=2)
        got.append(await lock.acquire())
        await asyncio.to_thread(done.wait, 120)
        await lock.release()

    asyncio.run(on_a_loop())


@pytest.mark.parametrize("client", ["blocking", "asyncio"])
@pytest.mark.usefixtures("no_polls")
def test_a_limit_waiter_is_woken_by_the_release_of_a_slot_it_did_not_wait_on(
    store: StoreCase, client: str
) -> None:
    backend = store.backend
    if not backend.capabilities.push_wait or type(backend).__name__ == "PostgresTTLBackend":
        pytest.skip(f"{type(backend).__name__}: waits poll (no push from the store)")
    key = f"job:limit-wait:{os.urandom(4).hex()}"
    holders = [Lock(backend, key, limit=2) for _ in range(2)]
    leases = {lease.key: lease for lease in (lock.acquire() for lock in holders)}
    assert sorted(leases) == [f"{key}#0", f"{key}#1"]
    other = store.second()
    entered, done = threading.Event(), threading.Event()
    spied(other, entered)
    if client == "asyncio" and (native := other.async_store()) is not None:
        spied(native, entered)
    got: list[Any] = []

    def run() -> None:
        try:
            waiter(other, key, client, got, done)
        except Exception as exc:  # the test asserts there was none
            got.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        eventually(entered.is_set, "the waiter waited")
        freed = leases[f"{key}#1"]
        [lock] = [lock for lock in holders if lock.lease == freed]
        assert lock.release() is not None
        eventually(lambda: got, "the waiter woken by the release of the other slot", 60)
        [lease] = got
        assert isinstance(lease, Lease), lease
        assert lease.key == f"{key}#1" and lease.fence > freed.fence
        current = backend.get(f"{key}#1")
        assert current is not None and current.token == lease.token
        kept = backend.get(f"{key}#0")
        assert kept is not None and kept.token == leases[f"{key}#0"].token
        [record] = backend.history(key=f"{key}#1")
        assert record.outcome is Outcome.SUCCEEDED and record.lease.token == freed.token
    finally:
        done.set()
        for lock in holders:
            if lock.lease is not None:
                lock.release()
        thread.join(60)
    assert not thread.is_alive() and len(got) == 1
    assert [r.lease.token for r in backend.history(key=f"{key}#1")][:1] == [lease.token]
