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
from collections import Counter
from pathlib import Path

from celery_dlock import BackendError, LockBackend, backend_from_url

from .chaos import FREE_LIMIT, Chaos, Cutoff, Fleet
from .check import Report, check
from .ledger import Ledger, open_ledger
from .netns import Network
from .servers import DISK_FULL, PooledPostgresServer, Store, make_store
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
    partitions: int = 0
    diskfulls: int = 0  # the file store's disk full for a second (on a tmpfs, as root)
    cut_off: int = 2  # workers in the namespace that partitions cut off (if any)
    #: URL options of the cut-off workers (Postgres: their keepalives), e.g.
    #: ``keepalives_idle=1&keepalives_interval=1&keepalives_count=2&tcp_user_timeout=3000``.
    cut_off_options: str = ""
    #: More URL options of the store for every worker (``replicas=1``, say).
    store_options: str = ""
    ttl: float = 3.0
    wait: float = 2.0
    hold: float = 0.003
    ledger: str | None = None  # "file" or "postgres"; None: postgres for the Postgres store
    broken: bool = False
    seed: int = 0
    keep: Path | None = None  # keep the run's logs in this directory
    #: Acquisitions a run must make: once its faults are over, it goes on without faults
    #: until it has, for at most ``seconds`` more (a loaded machine makes fewer in the time
    #: its faults take: a killed holder's key stays held for its ttl).
    at_least: int = 0
    #: Holders per key at once (``Lock(limit=...)``): each in a slot ``key#i`` of its own,
    #: which the ledger and the checker treat as a key.
    limit: int = 1
    #: Keys taken at once, all or none (``celery_dlock.lock([...])``).
    together: int = 1
    #: The workers take their keys through ``AsyncLock`` on an event loop.
    asyncio: bool = False
    #: Each lease handed over once granted (``LockBackend.hand_over``: alive by its ttl
    #: alone, as a dedupe mark once its message is sent), released by its token.
    hand_over: bool = False


def _ledger_spec(settings: Settings, directory: Path, run_id: str) -> str:
    # A cut-off worker's namespace reaches the store only: its ledger is in files.
    shared = settings.store == "postgres" and not settings.partitions
    kind = settings.ledger or ("postgres" if shared else "file")
    if kind == "file":
        return f"file://{directory / 'ledger'}"
    if kind == "postgres":
        return f"{SHARED_POSTGRES}#torture_ledger_{run_id}"
    raise ValueError(f"ledger must be file or postgres, not {kind!r}")


def _store_url(
    store: Store, host: str = "127.0.0.1", migrate: bool = True, options: str = ""
) -> str:
    """The store's URL through ``host``, with ``options`` added; a Postgres store's tables
    made first (``migrate``), on the cluster itself (DDL does not go through a pooler)."""
    url = store.url(host)
    if isinstance(store, PooledPostgresServer):
        if migrate:
            _migrate(store.direct_url())
        url += "?liveness=ttl&ttl=3"  # the workers give their own ttl to every Lock
    elif store.name == "postgres":
        # Few waiter connections per process: 16 workers x 9 would crowd a small server.
        url += "?max_waiters=2"
        if migrate:
            _migrate(url)
    return url + ("&" if "?" in url else "?") + options if options else url


def _migrate(url: str) -> None:
    """Make the Postgres store's tables at ``url``."""
    from celery_dlock.backends.postgres import PostgresBackend  # the optional driver

    backend = PostgresBackend.from_url(url)
    try:
        backend.migrate()
    finally:
        backend.close()


def settle(backend: LockBackend, prefix: str, timeout: float) -> int:
    """Reap until no lease under ``prefix`` is left (a killed holder's lease is recorded when
    the store clears it); returns how many are left after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(BackendError):  # the store may still be coming back
            backend.reap(limit=1000)
            left = len(backend.leases(prefix))
            if left == 0:
                # A lease whose time ran out since that reap is listed no more (Redis drops
                # an expired lock at once and keeps its state for the janitor), yet still
                # to be recorded: one reap more.
                backend.reap(limit=1000)
                return 0
            if time.monotonic() > deadline:
                return left
        if time.monotonic() > deadline:
            return -1
        time.sleep(0.2)


def _cutoff(settings: Settings, store: Store, job: Job, network: Network | None) -> Cutoff | None:
    """The workers that partitions cut off: in the namespace, through its link, with no
    ttl on Postgres (its session's liveness alone, so the keepalives free the lease)."""
    if network is None:
        return None
    url = _store_url(store, network.host, migrate=False, options=settings.store_options)
    if settings.cut_off_options:
        url += ("&" if "?" in url else "?") + settings.cut_off_options
    ttl = None if store.name == "postgres" else job.ttl
    return Cutoff(network, dataclasses.replace(job, store_url=url, ttl=ttl), settings.cut_off)


def _run_workers(
    settings: Settings, store: Store, job: Job, directory: Path, cutoff: Cutoff | None
) -> Chaos:
    fleet = Fleet(job, directory, settings.workers, settings.seed, cutoff)
    faults = {
        "kills": settings.kills, "pauses": settings.pauses, "restarts": settings.restarts,
        "partitions": settings.partitions, "diskfulls": settings.diskfulls,
    }  # fmt: skip
    pause = settings.ttl + 1.0
    # What the partitions watch for the cut-off holder's lease to be freed.
    probe = backend_from_url(job.store_url) if cutoff is not None else None
    chaos = Chaos(fleet, store, faults, settings.seconds, pause, seed=settings.seed, probe=probe)
    deadline = time.monotonic() + settings.seconds
    fleet.start()
    chaos.start()
    try:
        # Partitions last as long as the store takes to free a lease: let them all happen.
        chaos.join(settings.seconds + settings.partitions * FREE_LIMIT)
        time.sleep(max(0.0, deadline - time.monotonic()))
        overtime = time.monotonic() + settings.seconds
        while acquisitions(directory) < settings.at_least and time.monotonic() < overtime:
            time.sleep(0.2)
    finally:
        chaos.stop()
        fleet.stop(timeout=settings.ttl + settings.wait + 15)
        if probe is not None:
            probe.close()
    return chaos


def acquisitions(directory: Path) -> int:
    """Acquisitions so far: the ``begin`` lines of every worker's log in ``directory``."""
    return sum(path.read_bytes().count(b'"e":"begin"') for path in directory.glob("*.jsonl"))


def check_disk(store: Store, report: Report) -> None:
    """Fail a run whose file store's tmpfs is still full once the filler is gone: its
    history filled it, and every acquire and release failed from then on (not one second
    per disk full)."""
    free = store.disk_free()
    if free is not None and free < DISK_FULL:
        report.fail(
            f"the file store's tmpfs ({store.directory}, {free} bytes free) filled up with "
            "its history: its disk stayed full (a larger tmpfs: servers.DISK_MIB_PER_SECOND)"
        )


def check_faults(
    plan: list[tuple[float, str]], done: dict[str, int], errors: list[str], report: Report
) -> None:
    """Fail a run that did fewer faults than its plan: each fault that failed is named, and
    those the run ended before (a loaded machine: each kill looks for a worker inside its
    section for up to 1.5 s) are counted, so that no "0 violations" stands for more chaos
    than there was."""
    for error in errors:
        report.fail(f"chaos: {error}")
    planned = Counter(what for _, what in plan)
    for what, count in sorted(planned.items()):
        did, failed = done.get(what, 0), sum(error.startswith(f"{what}: ") for error in errors)
        if did + failed < count:
            report.fail(
                f"chaos: {did} of {count} {what}s done, {failed} failed: the run "
                "ended before the rest (a longer --seconds, or fewer faults)"
            )


def torture(settings: Settings) -> Report:
    """Run ``settings`` and check it."""
    run_id = os.urandom(4).hex()
    directory = Path(tempfile.mkdtemp(prefix=f"dlock-torture-run-{settings.store}-"))
    store = make_store(
        settings.store,
        restart_delay=max(1.0, settings.ttl / 2),
        full_disk=settings.diskfulls > 0,
        seconds=settings.seconds * (2 if settings.at_least else 1),  # at_least: overtime
    )
    ledger: Ledger | None = None
    backend: LockBackend | None = None
    networked = settings.store in ("postgres", "redis")
    network = Network(run_id) if settings.partitions and networked else None
    try:
        if network is not None:
            network.start()
            store.reach(network.host, network.subnet)
        store.start()
        url = _store_url(store, options=settings.store_options)
        prefix = f"torture:{run_id}:"
        keys = [f"{prefix}{n}" for n in range(settings.keys)]
        spec = _ledger_spec(settings, directory, run_id)
        ledger = open_ledger(spec)
        slots = [f"{key}#{n}" for key in keys for n in range(settings.limit)]
        ledger.create(keys if settings.limit == 1 else slots)
        job = Job(
            url, spec, keys, settings.ttl, settings.wait, settings.hold, log="",
            stop=str(directory / "stop"), broken=settings.broken, limit=settings.limit,
            together=settings.together, asyncio=settings.asyncio, hand_over=settings.hand_over,
        )  # fmt: skip
        cutoff = _cutoff(settings, store, job, network)
        began = time.monotonic()
        chaos = _run_workers(settings, store, job, directory, cutoff)
        duration = time.monotonic() - began
        backend = backend_from_url(url)
        left = settle(backend, prefix, settings.ttl + 10)
        if settings.keep is not None:
            (directory / "ledger.json").write_text(json.dumps(ledger.dump()))
        report = check(directory, settings.store, backend, ledger)
        report.duration = duration
        check_disk(store, report)
        check_faults(chaos.plan, chaos.done, chaos.errors, report)
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
        if network is not None:
            network.close()
        if settings.keep is not None:
            shutil.copytree(directory, settings.keep / directory.name, dirs_exist_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
