"""The Celery soak (issue 18): ``python -m bench.torture.soak [--short] [--tasks N] ...``.

N orders, each submitted ``--duplicates`` times (5: the same order, five messages), through
a real ``celery worker -P prefork -c 4`` with ``acks_late`` and a short visibility timeout
(redeliveries), to ``soakapp.charge``: a ``LockedTask`` with ``lock_key="order:{order_id}"``
and ``once=True`` whose body does a read-modify-write of a fenced ledger (``ledger.py``) and
keeps its success in the same transaction. The broker is a private ``redis-server`` (database
7, ``appendfsync always``), the lock store (and the ledger) a private PostgreSQL: never the
shared ones (``servers.py``). Messages are published as the worker goes (at most ``BACKLOG``
waiting), in blocks of 100 orders whose duplicates are shuffled together, so duplicates often
run at once. Meanwhile, by publishing progress: ``--kills`` SIGKILLs of pool processes (one
inside a body when one is found), one broker restart (SIGKILL, restarted on its append-only
file) and one lock store restart (``pg_ctl -m fast``). A worker that exits by itself is
started again, as its supervisor would (Celery 5.7 can die of a broker restart: see
``supervise``), its exit recorded. Then ``soakcheck.py`` checks the
ledger, the bodies' logs and the store's history, prints the table and exits 1 on a
violation.

``--short`` (400 orders, 2 kills, one restart of each) is the CI size
(``tests/test_torture.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from celery_dlock import BackendError, LockBackend, backend_from_url

from .chaos import stopped
from .common import stop_worker
from .ledger import PostgresLedger
from .servers import PostgresServer, RedisServer
from .soakcheck import SoakReport, check, table

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
BROKER_DB = 7
#: Messages waiting in the broker's queue at most: the publisher keeps below it.
BACKLOG = 2000
BLOCK = 100


@dataclasses.dataclass(frozen=True)
class SoakSettings:
    tasks: int = 50_000
    duplicates: int = 5
    kills: int = 20
    concurrency: int = 4
    visibility: float = 10.0
    hold: float = 0.005
    timeout: float = 3600.0
    seed: int = 0
    keep: Path | None = None
    broken: bool = False  # charge without ``once``: the checker must see double charges


class Soak:
    """One soak run: servers, worker, publisher, chaos; ``run()`` returns the report."""

    def __init__(self, settings: SoakSettings) -> None:
        self.settings = settings
        self.random = random.Random(settings.seed)
        self.directory = Path(tempfile.mkdtemp(prefix="dlock-soak-"))
        self.logs = self.directory / "bodies"
        self.logs.mkdir()
        self.store = PostgresServer()
        self.broker = RedisServer(restart_delay=1.0)
        self.namespace = f"soak{os.urandom(3).hex()}"
        self.worker: subprocess.Popen[bytes] | None = None
        self.children: set[int] = set()  # the pool processes of the worker, as last seen
        self.killed: set[int] = set()
        self.published = 0
        self.events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()

    # -- servers and the worker ---------------------------------------------------------

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DLOCK_SOAK_BROKER": f"redis://127.0.0.1:{self.broker.port}/{BROKER_DB}",
            "DLOCK_SOAK_LOCKS": self.store.url(),
            "DLOCK_SOAK_LEDGER": f"{self.store.url()}#soak_ledger",
            "DLOCK_SOAK_NAMESPACE": self.namespace,
            "DLOCK_SOAK_LOGS": str(self.logs),
            "DLOCK_SOAK_VISIBILITY": str(self.settings.visibility),
            "DLOCK_SOAK_HOLD": str(self.settings.hold),
            "DLOCK_SOAK_BROKEN": "1" if self.settings.broken else "0",
        }

    def _start_worker(self) -> None:
        args = [
            sys.executable, "-m", "celery", "-A", "bench.torture.soakapp", "worker",
            "-P", "prefork", "-c", str(self.settings.concurrency), "--without-gossip",
            "--without-mingle", "--without-heartbeat", "--loglevel=WARNING",
        ]  # fmt: skip
        with open(self.directory / "worker.log", "ab") as log:
            self.worker = subprocess.Popen(
                args, env=self._env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )

    def _children(self) -> list[int]:
        worker = self.worker
        if worker is None:
            return []
        path = Path(f"/proc/{worker.pid}/task/{worker.pid}/children")
        try:
            children = [int(pid) for pid in path.read_text().split()]
        except OSError:
            return []
        self.children = set(children)
        return children

    def supervise(self) -> None:
        """Start the worker again if it exited by itself, recording its exit and
        SIGKILLing any pool process it left. Seen: on a broker restart, Celery 5.7's
        consumer failed to ack on the lost connection, then died of ``Unrecoverable error:
        AttributeError("'NoneType' object has no attribute 'hostname'")`` (kombu's
        ``_connparams``) instead of reconnecting."""
        worker = self.worker
        if worker is None or worker.poll() is None:
            self._children()
            return
        at = time.monotonic()
        left = sorted(self.children)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.record(e="exit", pid=worker.pid, code=worker.returncode, t=at, children=left)
        self.children = set()
        self._start_worker()

    # -- chaos ----------------------------------------------------------------------------

    def record(self, **event: Any) -> None:
        with self._lock:
            self.events.append(event)

    def _in_body(self, pid: int) -> dict[str, Any] | None:
        """The ``start`` line of the body ``pid`` is in, if its log's last line is one."""
        path = self.logs / f"body-{pid}.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 600))
                tail = f.read().splitlines()
        except FileNotFoundError:
            return None
        if tail and tail[-1].startswith(b'{"e":"start"'):
            start: dict[str, Any] = json.loads(tail[-1])
            return start
        return None

    def _victim(self) -> int:
        """A pool process, one inside a body if one is found within about a second; never
        one killed already (the worker lists a dead child until it has reaped it, 0-4 s)."""
        victim, children = 0, self._alive()
        for _ in range(500):
            children = self._alive() or children
            victim = self.random.choice(children) if children else 0
            if victim and self._in_body(victim) is not None:
                break
            time.sleep(0.002)
        if not victim:
            raise RuntimeError("the worker has no pool processes")
        return victim

    def _alive(self) -> list[int]:
        return [pid for pid in self._children() if pid not in self.killed]

    def kill(self, probe: LockBackend) -> None:
        """SIGKILL a pool process (``_victim``); note the leases it holds (the store's view
        while it is stopped, just before)."""
        while True:
            victim = self._victim()
            try:
                os.kill(victim, signal.SIGSTOP)
            except ProcessLookupError:  # it exited meanwhile: choose again
                continue
            if stopped(victim):  # frozen: its log and its leases are the ones it dies with
                break
            self.killed.add(victim)  # a zombie, or gone: never again
        start = self._in_body(victim)
        held = [
            (lease.key, lease.token)
            for lease in _patiently(lambda: probe.leases(f"{self.namespace}:"))
            if lease.holder.pid == victim
        ]
        self.record(e="kill", pid=victim, t=time.monotonic(), start=start, held=held)
        self.killed.add(victim)
        os.kill(victim, signal.SIGKILL)

    def restart(self, what: str) -> None:
        at = time.monotonic()
        if what == "broker":
            self.broker.restart("aof")
        else:
            self.store.restart("fast")
        self.record(e="restart", what=what, t=at, t_end=time.monotonic())

    def chaos(self, stop: threading.Event) -> None:
        """Faults at points of the publishing progress (fractions of every message)."""
        total = self.settings.tasks * self.settings.duplicates
        plan = [(self.random.uniform(0.05, 0.9), "kill") for _ in range(self.settings.kills)]
        plan += [(0.35, "broker"), (0.65, "store")]
        probe = backend_from_url(self.store.url())
        try:
            for at, what in sorted(plan):
                while self.published < at * total:
                    if stop.wait(0.05):
                        return
                try:
                    if what == "kill":
                        self.kill(probe)
                    else:
                        self.restart(what)
                except Exception as exc:  # a failed fault is reported, never fatal to the run
                    self.errors.append(f"{what}: {exc!r}")
        finally:
            probe.close()

    # -- publishing and waiting -----------------------------------------------------------

    def publish(self, redis: Any, stop: threading.Event) -> None:
        from .soakapp import charge

        orders = list(range(self.settings.tasks))
        for first in range(0, len(orders), BLOCK):
            block = [
                o for o in orders[first : first + BLOCK] for _ in range(self.settings.duplicates)
            ]
            self.random.shuffle(block)
            for order in block:
                while _waiting(redis) > BACKLOG:
                    if stop.wait(0.05):
                        return
                _retrying(lambda order=order: charge.apply_async((order,)), stop)
                self.published += 1

    def _done(self, ledger: PostgresLedger, redis: Any) -> bool:
        if ledger.written() < self.settings.tasks:
            return False
        return _waiting(redis) == 0 and _unacked(redis) == 0

    def _wait(self, ledger: PostgresLedger, broker: Any, deadline: float) -> None:
        """Until every order is charged and every message handled, or ``deadline``."""
        polled = 0.0
        while time.monotonic() < deadline:
            time.sleep(0.2)
            self.supervise()
            if time.monotonic() - polled < 2.0:
                continue
            polled = time.monotonic()
            with contextlib.suppress(Exception):  # the broker or the store restarting
                everything = self.settings.tasks * self.settings.duplicates
                if self.published == everything and self._done(ledger, broker):
                    return
        self.errors.append(f"not finished within {self.settings.timeout:.0f} s")

    def run(self) -> SoakReport:
        import redis as redis_py

        report = SoakReport(self.settings.tasks, self.settings.duplicates)
        stop = threading.Event()
        ledger: PostgresLedger | None = None
        try:
            self.store.start()
            self.broker.start()
            broker = redis_py.Redis(port=self.broker.port, db=BROKER_DB, socket_timeout=5)
            broker.flushdb()
            from celery_dlock.backends.postgres import PostgresBackend  # the optional driver

            store = PostgresBackend.from_url(self.store.url())
            store.migrate()
            store.close()
            ledger = PostgresLedger(self.store.url(), "soak_ledger")
            keys = [f"{self.namespace}:order:{n}" for n in range(self.settings.tasks)]
            ledger.create(keys)
            os.environ.update({k: v for k, v in self._env().items() if k.startswith("DLOCK_")})
            began = time.monotonic()
            self._start_worker()
            threads = [
                threading.Thread(target=self.publish, args=(broker, stop), daemon=True),
                threading.Thread(target=self.chaos, args=(stop,), daemon=True),
            ]
            for thread in threads:
                thread.start()
            self._wait(ledger, broker, began + self.settings.timeout)
            report.duration = time.monotonic() - began
            stop.set()
            for thread in threads:
                thread.join(60)
            self._stop_worker()
            report.published = self.published
            for error in self.errors:
                report.fail(f"chaos: {error}")
            check(
                report, self.logs, self.events, ledger, store_url=self.store.url(),
                namespace=self.namespace,
            )  # fmt: skip
            return report
        finally:
            stop.set()
            self._stop_worker()
            if ledger is not None:
                ledger.close()
            self.broker.stop()
            self.store.stop()
            if self.settings.keep is not None:
                (self.directory / "events.json").write_text(json.dumps(self.events))
                shutil.copytree(self.directory, self.settings.keep / self.directory.name)
            shutil.rmtree(self.directory, ignore_errors=True)

    def _stop_worker(self) -> None:
        stop_worker(self.worker)
        self.worker = None


def _waiting(redis: Any) -> int:
    try:
        return int(redis.llen("celery"))
    except Exception:  # the broker restarting: wait for it
        return BACKLOG + 1


def _unacked(redis: Any) -> int:
    return int(redis.hlen("unacked"))


def _patiently(read: Callable[[], T]) -> T:
    """``read()``, again while the store restarts (up to a minute)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return read()
        except BackendError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _retrying(publish: Any, stop: threading.Event) -> None:
    """Publish, again while the broker restarts (a message that landed all the same is one
    more duplicate)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            publish()
            return
        except Exception:
            if time.monotonic() > deadline or stop.wait(0.2):
                raise


SHORT = {"tasks": 400, "kills": 2}


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.torture.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--short", action="store_true", help=f"CI size: {SHORT}")
    parser.add_argument("--tasks", type=int, help="orders (50,000)")
    parser.add_argument("--duplicates", type=int, default=5, help="messages per order (5)")
    parser.add_argument("--kills", type=int, help="pool processes SIGKILLed (20)")
    parser.add_argument("--concurrency", type=int, default=4, help="pool processes (4)")
    parser.add_argument("--visibility", type=float, default=10.0, help="visibility timeout (10)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up after (3600 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--broken", action="store_true", help="charge without once: the checker must fail"
    )
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    parser.add_argument("--keep", type=Path, help="copy the run's logs into this directory")
    options = parser.parse_args(argv)
    sized: dict[str, Any] = dict(SHORT) if options.short else {}
    for name in ("tasks", "kills"):
        if getattr(options, name) is not None:
            sized[name] = getattr(options, name)
    settings = SoakSettings(
        duplicates=options.duplicates, concurrency=options.concurrency,
        visibility=options.visibility, timeout=options.timeout, seed=options.seed,
        keep=options.keep, broken=options.broken, **sized,
    )  # fmt: skip
    signal.signal(signal.SIGTERM, _exit)  # clean up the servers and the worker
    report = Soak(settings).run()
    for problem in report.problems:
        print(f"  {problem}", file=sys.stderr)
    print(table(report))
    print(report.summary())
    if options.json is not None:
        options.json.write_text(json.dumps(dataclasses.asdict(report), indent=2))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
