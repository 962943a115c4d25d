"""One contending worker process: ``python -m bench.torture.worker '<json Job>'``.

Until the stop file exists: pick a key (hot spots: key ``i`` is chosen with weight
``1 / (i + 1)``), take it through the public :class:`celery_dlock.Lock` (``ttl`` and ``wait``
set; ``limit``: one of its slots; ``together``: that many keys through :class:`Locks`;
``asyncio``: :class:`AsyncLock` on an event loop; ``hand_over``: the lease handed over once
granted, released by its token), read the ledger's counter, hold for a
moment, write counter + 1 with the lease's fence, release. Every step that the checker needs
goes to this process's own log, one JSON line per ``write`` on an ``O_APPEND`` descriptor, so
a SIGKILL leaves whole lines (each lease of a set its own):

- ``{"e": "start", "pid", "asyncio"}`` first;
- ``{"e": "begin", "key", "token", "fence", "t"}`` once the lease is held;
- ``{"e": "end", "token", "read", "accepted", "t"}`` just before the release;
- ``{"e": "rel", "token", "release", "t"}`` after it: ``ok``, ``lost`` (the release found the
  lease gone; its ``lost`` record is written when it returns) or ``error`` (the store failed);
- ``{"e": "busy"}`` after ``wait`` ran out, ``{"e": "store_error", "where"}`` when the store
  failed (the worker pauses and goes on), ``{"e": "ledger_error"}`` when the ledger's server
  did (``read`` or ``accepted`` of the ``end`` line is then null).

``t`` is ``time.monotonic()``: one clock for every process of the host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from celery_dlock import (
    AsyncLock,
    BackendError,
    Lease,
    Lock,
    LockBackend,
    LockNotAcquiredError,
    Locks,
    Outcome,
    Record,
    backend_from_url,
    releasing,
)
from celery_dlock.releasing import Ending

from .ledger import Ledger, LedgerError, open_ledger

__all__ = ["Job", "StealingLock", "main"]


@dataclasses.dataclass(frozen=True)
class Job:
    """What a worker does; the parent hands it over as JSON."""

    store_url: str
    ledger: str
    keys: list[str]
    ttl: float | None  # None: the store's liveness alone (a partitioned Postgres holder)
    wait: float
    hold: float
    log: str
    stop: str
    broken: bool = False
    seed: int = 0
    limit: int = 1  # holders per key at once, each in a slot ``key#i`` (the ledger's key)
    together: int = 1  # keys taken at once, all or none (``Locks``), each a section of its own
    asyncio: bool = False  # through AsyncLock on an event loop
    hand_over: bool = False  # each lease handed over once granted, released by its token

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        return cls(**json.loads(text))


class StealingLock:
    """A deliberately broken lock for ``--broken``: a busy key is released *by key alone*
    (whoever holds it, through the store's current lease) and taken, so that two holders
    are in the section at once. The checker must see it."""

    def __init__(self, backend: LockBackend, key: str, ttl: float | None, wait: float) -> None:
        self.backend, self.key = backend, key
        self.lock = Lock(backend, key, ttl=ttl, wait=wait)

    def acquire(self) -> Lease:
        try:
            return self.lock.acquire(wait=0)
        except LockNotAcquiredError:
            current = self.backend.get(self.key)
            if current is not None:
                self.backend.release(current, Outcome.FORCED, "broken", "released by key alone")
            return self.lock.acquire()

    def release(self) -> Record | None:
        return self.lock.release()


class Log:
    """This life's log: one JSON line per ``write`` (whole, or absent after a SIGKILL)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def __call__(self, **entry: Any) -> None:
        self.lines([entry])

    def lines(self, entries: list[dict[str, Any]]) -> None:
        """``entries`` in one ``write``: a SIGSTOP or SIGKILL cannot fall between them."""
        text = "".join(json.dumps(entry, separators=(",", ":")) + "\n" for entry in entries)
        os.write(self.fd, text.encode())


def section(job: Job, backend: LockBackend, ledger: Ledger, keys: list[str], log: Log) -> None:
    """One acquisition of ``keys`` (several: all or none, through :class:`Locks`) and its
    critical section: each lease is a section of its own to the log, the ledger and the
    checker, with the same span."""
    lock: Lock | Locks | StealingLock
    if job.broken:
        lock = StealingLock(backend, keys[0], job.ttl, job.wait)
    elif len(keys) > 1:
        lock = Locks(backend, keys, ttl=job.ttl, wait=job.wait)
    else:
        lock = Lock(backend, keys[0], ttl=job.ttl, wait=job.wait, limit=job.limit)
    try:
        taken = lock.acquire()
    except (LockNotAcquiredError, BackendError) as exc:  # LockTimeoutError included
        not_taken(exc, log)
        return
    leases = taken if isinstance(taken, list) else [taken]
    if job.hand_over and isinstance(lock, Lock):
        handed_section(job, backend, ledger, lock, log)
        return
    write(job, ledger, leases, log)
    # Locks.release, key by key, so that each lease's own release is logged.
    for one, lease in zip(lock.locks if isinstance(lock, Locks) else [lock], leases, strict=True):
        try:
            release = "ok" if one.release() is not None else "lost"
        except BackendError:
            release = "error"
        log(e="rel", token=lease.token, release=release, t=time.monotonic())


def handed_section(job: Job, backend: LockBackend, ledger: Ledger, lock: Lock, log: Log) -> None:
    """``--hand-over``: the lease just granted is handed over (alive by its ttl alone from
    then on, whatever becomes of this process or its session), then the section, then the
    release by its token, recorded ``lost`` if the lease was gone (as ``Lock.release``)."""
    lease = lock.detach()
    assert job.ttl is not None
    try:
        backend.hand_over(lease, job.ttl, if_unchanged=True)  # None: lost; its release says
    except BackendError:
        log(e="store_error", where="hand_over")
    write(job, ledger, [lease], log)
    ending = Ending(lease, Outcome.SUCCEEDED, None, None, None, False)
    try:
        release = "ok" if releasing.release(backend, ending, defer=False) is not None else "lost"
    except BackendError:
        release = "error"
    log(e="rel", token=lease.token, release=release, t=time.monotonic())


async def async_section(job: Job, backend: LockBackend, ledger: Ledger, key: str, log: Log) -> None:
    """``section`` through :class:`AsyncLock` (the store's asyncio client where it has one,
    renewal as a task of the loop); the section's blocking work (the ledger's calls, the
    hold) runs in a thread, as asyncio code does: a hold that blocked the loop past the ttl
    stopped the renewal and lost the lease (``--ttl 1 --hold 2.5``: 265 of 465 leases)."""
    lock = AsyncLock(backend, key, ttl=job.ttl, wait=job.wait, limit=job.limit)
    try:
        lease = await lock.acquire()
    except (LockNotAcquiredError, BackendError) as exc:
        not_taken(exc, log)
        await asyncio.sleep(0)  # let the loop run what the failed try left to it
        return
    await asyncio.to_thread(write, job, ledger, [lease], log)
    try:
        release = "ok" if await lock.release() is not None else "lost"
    except BackendError:
        release = "error"
    log(e="rel", token=lease.token, release=release, t=time.monotonic())


def not_taken(exc: Exception, log: Log) -> None:
    """Log an acquisition that failed: the key busy past ``wait``, or the store failing
    (then a short pause, as a client backing off)."""
    if isinstance(exc, LockNotAcquiredError):
        log(e="busy")
    else:
        log(e="store_error", where="acquire")
        time.sleep(random.uniform(0.05, 0.2))


def write(job: Job, ledger: Ledger, leases: list[Lease], log: Log) -> None:
    """The critical section of ``leases``: read each key's counter, hold, write each + 1
    with its lease's fence; logged ``begin`` and ``end`` per lease."""
    # One write for a set's begin lines: the checker takes a worker whose last line is a
    # begin for one inside its section, and a pause between two lines of a set made the
    # later ones look granted after the fences taken meanwhile (the key of a lease is the
    # slot taken, where a key has several).
    now = time.monotonic()
    log.lines(
        [
            {"e": "begin", "key": lease.key, "token": lease.token, "fence": lease.fence, "t": now}
            for lease in leases
        ]
    )
    read: dict[str, int | None] = {lease.token: None for lease in leases}
    accepted: dict[str, bool | None] = dict.fromkeys(read)
    try:
        for lease in leases:
            read[lease.token] = ledger.read(lease.key, lease.fence)
        time.sleep(random.uniform(0, job.hold))
        for lease in leases:
            counter = read[lease.token]
            assert counter is not None
            accepted[lease.token] = ledger.write(lease.key, lease.fence, counter + 1)
    except LedgerError:  # then the journal alone says whether the write landed
        log(e="ledger_error")
    for lease in leases:
        token = lease.token
        log(e="end", token=token, read=read[token], accepted=accepted[token], t=time.monotonic())


def main(argv: list[str]) -> int:
    job = Job.from_json(argv[1])
    random.seed(job.seed)
    weights = [1 / (rank + 1) for rank in range(len(job.keys))]
    backend = backend_from_url(job.store_url)
    ledger = open_ledger(job.ledger)
    log = Log(job.log)
    stop = Path(job.stop)

    def pick() -> list[str]:
        keys = set()
        while len(keys) < job.together:  # distinct keys, each chosen by its weight
            keys.add(random.choices(job.keys, weights)[0])
        return sorted(keys)

    async def run_async() -> None:
        while not stop.exists():
            await async_section(job, backend, ledger, pick()[0], log)

    log(e="start", pid=os.getpid(), asyncio=job.asyncio)
    if job.asyncio:
        asyncio.run(run_async())
    else:
        while not stop.exists():
            section(job, backend, ledger, pick(), log)
    ledger.close()
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
