"""One contending worker process: ``python -m bench.torture.worker '<json Job>'``.

Until the stop file exists: pick a key (hot spots: key ``i`` is chosen with weight
``1 / (i + 1)``), take it through the public :class:`celery_dlock.Lock` (``ttl`` and ``wait``
set), read the ledger's counter, hold for a moment, write counter + 1 with the lease's fence,
release. Every step that the checker needs goes to this process's own log, one JSON line per
``write`` on an ``O_APPEND`` descriptor, so a SIGKILL leaves whole lines:

- ``{"e": "begin", "key", "token", "fence", "t"}`` once the lease is held;
- ``{"e": "end", "token", "read", "accepted", "t"}`` just before the release;
- ``{"e": "rel", "token", "release"}`` after it: ``ok``, ``lost`` (the release found the lease
  gone) or ``error`` (the store failed);
- ``{"e": "busy"}`` after ``wait`` ran out, ``{"e": "store_error", "where"}`` when the store
  failed (the worker pauses and goes on), ``{"e": "ledger_error"}`` when the ledger's server
  did (``read`` or ``accepted`` of the ``end`` line is then null).

``t`` is ``time.monotonic()``: one clock for every process of the host.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from celery_dlock import (
    BackendError,
    Lease,
    Lock,
    LockBackend,
    LockNotAcquiredError,
    Outcome,
    Record,
    backend_from_url,
)

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
        os.write(self.fd, (json.dumps(entry, separators=(",", ":")) + "\n").encode())


def section(job: Job, backend: LockBackend, ledger: Ledger, key: str, log: Log) -> None:
    """One acquisition of ``key`` and its critical section."""
    lock: Lock | StealingLock
    if job.broken:
        lock = StealingLock(backend, key, job.ttl, job.wait)
    else:
        lock = Lock(backend, key, ttl=job.ttl, wait=job.wait, limit=job.limit)
    try:
        lease = lock.acquire()
    except LockNotAcquiredError:  # LockTimeoutError included
        log(e="busy")
        return
    except BackendError:
        log(e="store_error", where="acquire")
        time.sleep(random.uniform(0.05, 0.2))
        return
    key = lease.key  # the slot taken, where a key has several
    log(e="begin", key=key, token=lease.token, fence=lease.fence, t=time.monotonic())
    counter: int | None = None
    accepted: bool | None = None
    try:
        counter = ledger.read(key, lease.fence)
        time.sleep(random.uniform(0, job.hold))
        accepted = ledger.write(key, lease.fence, counter + 1)
    except LedgerError:  # then the journal alone says whether the write landed
        log(e="ledger_error")
    log(e="end", token=lease.token, read=counter, accepted=accepted, t=time.monotonic())
    try:
        release = "ok" if lock.release() is not None else "lost"
    except BackendError:
        release = "error"
    log(e="rel", token=lease.token, release=release)


def main(argv: list[str]) -> int:
    job = Job.from_json(argv[1])
    random.seed(job.seed)
    weights = [1 / (rank + 1) for rank in range(len(job.keys))]
    backend = backend_from_url(job.store_url)
    ledger = open_ledger(job.ledger)
    log = Log(job.log)
    stop = Path(job.stop)
    while not stop.exists():
        key = random.choices(job.keys, weights)[0]
        section(job, backend, ledger, key, log)
    ledger.close()
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
