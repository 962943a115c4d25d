"""One torture run on one store: private server, ledger, workers, chaos, settling, checking.

The store under test is always a private one (``servers.py``). The ledger must outlive the
store's restarts: for the Postgres store it is a table with a unique name on the shared
PostgreSQL (``DLOCK_POSTGRES_URL``, default ``postgresql://postgres@127.0.0.1:5432/test``),
dropped at the end; for the file and Redis stores, files in the run's directory (or the
shared PostgreSQL with ``ledger="postgres"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from celery_dlock import BackendError, LockBackend, backend_from_url

from .chaos import Chaos, Fleet
from .check import Report, check
from .ledger import Ledger, open_ledger
from .servers import Store, make_store
from .worker import Job

__all__ = ["Settings", "torture"]

SHARED_POSTGRES = os.environ.get("DLOCK_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run's parameters (see ``python -m bench.torture --help``)."""

    store: str
    workers: int = 16
    keys: int = 8
    seconds: float = 60.0
    kills: int = 10
    pauses: int = 2
    restarts: int = 2
    ttl: float = 3.0
    wait: float = 2.0
    hold: float = 0.003
    ledger: str | None = None  # "file" or "postgres"; None: postgres for the Postgres store
    broken: bool = False
    seed: int = 0
    keep: Path | None = None  # keep the run's logs in this directory


def _ledger_spec(settings: Settings, directory: Path, run_id: str) -> str:
    kind = settings.ledger or ("postgres" if settings.store == "postgres" else "file")
    if kind == "file":
        return f"file://{directory / 'ledger'}"
    if kind == "postgres":
        return f"{SHARED_POSTGRES}#torture_ledger_{run_id}"
    raise ValueError(f"ledger must be file or postgres, not {kind!r}")


def _store_url(store: Store) -> str:
    url = store.url()
    if store.name == "postgres":
        from celery_dlock.backends.postgres import PostgresBackend  # the optional driver

        # Few waiter connections per process: 16 workers x 9 would crowd a small server.
        url += "?max_waiters=2"
        backend = PostgresBackend.from_url(url)
        try:
            backend.migrate()
        finally:
            backend.close()
    return url


def settle(backend: LockBackend, prefix: str, timeout: float) -> int:
    """Reap until no lease under ``prefix`` is left (a killed holder's lease is recorded when
    the store clears it); returns how many are left after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(BackendError):  # the store may still be coming back
            backend.reap(limit=1000)
            left = len(backend.leases(prefix))
            if left == 0 or time.monotonic() > deadline:
                return left
        if time.monotonic() > deadline:
            return -1
        time.sleep(0.2)


def _run_workers(settings: Settings, store: Store, job: Job, directory: Path) -> Chaos:
    fleet = Fleet(job, directory, settings.workers, settings.seed)
    faults = {"kills": settings.kills, "pauses": settings.pauses, "restarts": settings.restarts}
    pause = settings.ttl + 1.0
    chaos = Chaos(fleet, store, faults, settings.seconds, pause, seed=settings.seed)
    deadline = time.monotonic() + settings.seconds
    fleet.start()
    chaos.start()
    try:
        chaos.join(settings.seconds)
        time.sleep(max(0.0, deadline - time.monotonic()))
    finally:
        chaos.stop()
        fleet.stop(timeout=settings.ttl + settings.wait + 15)
    return chaos


def torture(settings: Settings) -> Report:
    """Run ``settings`` and check it."""
    run_id = os.urandom(4).hex()
    directory = Path(tempfile.mkdtemp(prefix=f"dlock-torture-run-{settings.store}-"))
    store = make_store(settings.store, restart_delay=max(1.0, settings.ttl / 2))
    ledger: Ledger | None = None
    backend: LockBackend | None = None
    try:
        store.start()
        url = _store_url(store)
        prefix = f"torture:{run_id}:"
        keys = [f"{prefix}{n}" for n in range(settings.keys)]
        spec = _ledger_spec(settings, directory, run_id)
        ledger = open_ledger(spec)
        ledger.create(keys)
        job = Job(
            url, spec, keys, settings.ttl, settings.wait, settings.hold, log="",
            stop=str(directory / "stop"), broken=settings.broken,
        )  # fmt: skip
        began = time.monotonic()
        chaos = _run_workers(settings, store, job, directory)
        duration = time.monotonic() - began
        backend = backend_from_url(url)
        left = settle(backend, prefix, settings.ttl + 10)
        if settings.keep is not None:
            (directory / "ledger.json").write_text(json.dumps(ledger.dump()))
        report = check(directory, settings.store, backend, ledger)
        report.duration = duration
        for error in chaos.errors:
            report.fail(f"chaos: {error}")
        if left:
            report.fail(f"{left} leases still held (or the store unreachable) after the run")
        return report
    finally:
        if backend is not None:
            backend.close()
        if ledger is not None:
            with contextlib.suppress(Exception):
                ledger.drop()
            ledger.close()
        store.stop()
        if settings.keep is not None:
            shutil.copytree(directory, settings.keep / directory.name, dirs_exist_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
