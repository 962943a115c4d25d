"""A real prefork worker for the tests: a `celery worker --pool=prefork` subprocess on a Redis
broker, what its bodies write to a ledger, and the checks read from it."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kombu.exceptions
import redis.exceptions

from celery_dlock import backend_from_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.records import Record
from tests.support import eventually

HERE = Path(__file__).parent


#: The Redis database pairs (broker, results) of the Celery tests, one per pytest process.
_PAIRS = ((2, 3), (10, 11), (12, 13), (14, 15), (5, 9))
_claimed: list[int] = []  # the lock file descriptor of the pair this process holds, for its life


def _databases() -> tuple[int, int]:
    """The Redis databases of the broker and the results, flushed at this process's start:
    its pytest-xdist worker's own pair first (gw0: 2 and 3, gw1: 10 and 11, ...), else the
    first pair no other pytest process on this machine holds (an ``flock`` on a file per
    pair). Two sessions at once (a developer's beside CI) once flushed each other's broker."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    for n in range(len(_PAIRS)):
        pair = _PAIRS[(worker + n) % len(_PAIRS)]
        path = Path(tempfile.gettempdir()) / f"celery-dlock-tests-redis-{pair[0]}.lock"
        lock = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            continue
        _claimed.append(lock)
        return pair
    raise RuntimeError(
        f"the Celery tests' Redis database pairs {_PAIRS} are all held by other pytest "
        "processes on this machine: at most 5 at once"
    )


_pair: list[int] = []


def databases() -> tuple[int, int]:
    """This process's (broker, results) databases, claimed on first use: a pytest-xdist
    controller, which only loads the conftest, claims none."""
    if not _pair:
        _pair.extend(_databases())
    return _pair[0], _pair[1]


def __getattr__(name: str) -> int:
    """``BROKER_DB`` and ``RESULTS_DB``: :func:`databases`."""
    if name not in ("BROKER_DB", "RESULTS_DB"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return databases()[0 if name == "BROKER_DB" else 1]


class Worker:
    """A `celery worker --pool=prefork` subprocess and what it writes."""

    #: Its ``--loglevel`` (a test that reads the pool's debug lines sets ``DEBUG``).
    loglevel = "INFO"

    def __init__(self, tmp: Path, redis_url: str, lock_url: str, **env: str) -> None:
        self.ledger = tmp / "ledger.jsonl"
        self.ledger.touch()
        self.log = tmp / "worker.log"
        # A queue of its own: two workers on one queue would restore each other's messages.
        self.queue = f"q-{uuid.uuid4().hex[:8]}"
        self.hostname = f"w-{self.queue}@{socket.gethostname()}"
        # Not another worker's settings (a visibility timeout of an acks_late test, say):
        # they stay in os.environ after that worker, which set them for its import.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("DLOCK_TEST_")}
        self.env = {
            **inherited,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DLOCK_TEST_BROKER": f"{redis_url}/{databases()[0]}",
            "DLOCK_TEST_RESULTS": f"{redis_url}/{databases()[1]}",
            "DLOCK_TEST_LOCKS": lock_url,
            "DLOCK_TEST_LEDGER": str(self.ledger),
            "DLOCK_TEST_QUEUE": self.queue,
            **env,
        }
        self.process: subprocess.Popen[bytes] | None = None
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("DLOCK_TEST_")})
        # Imported only now: it reads the DLOCK_TEST_* settings just set when first imported.
        # Its own app's module only: another app's default queue would stay on this worker's
        # queue after it stopped, and the tests after it would send there.
        workerapp = importlib.import_module(f"tests.celery.{self.module}")
        self.app = workerapp.app
        self.previous_queue = self.app.conf.task_default_queue
        self.app.conf.update(
            broker_url=self.env["DLOCK_TEST_BROKER"],
            result_backend=self.env["DLOCK_TEST_RESULTS"],
            dlock_backend=lock_url,
            task_default_queue=self.queue,
        )
        self.tasks = workerapp
        self.store: LockBackend = backend_from_url(lock_url)

    #: The module (beside this file) of the app the worker runs.
    module = "workerapp"

    def pool_options(self) -> list[str]:
        """The ``celery worker`` options of its pool (a subclass tries other pools)."""
        return ["--pool=prefork"]

    def start(self, concurrency: int = 4) -> Worker:
        args = [
            sys.executable, "-m", "celery", "-A", self.module, "worker", *self.pool_options(),
            f"--concurrency={concurrency}", "--without-gossip", "--without-mingle",
            "--without-heartbeat", f"--loglevel={self.loglevel}", f"--queues={self.queue}",
            f"--hostname={self.hostname}",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(args, env=self.env, stdout=log, stderr=log, cwd=HERE)
        try:
            eventually(self._ready, "worker ready", timeout=60)
        except BaseException:
            self.stop()  # else its process runs on, and its Popen warns in a later test
            raise
        return self

    def _ready(self) -> bool:
        """Whether the worker answers a ping. A broker connection of this process that the
        server closed while idle in the app's pool (seen twice in full runs on a loaded
        machine: "Connection closed by server" at its health check) is not the worker's
        answer: asked again, on a new connection."""
        try:
            return bool(self.app.control.ping(destination=[self.hostname], timeout=0.5))
        except (redis.exceptions.ConnectionError, kombu.exceptions.OperationalError):
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # warm shutdown
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        self.store.close()
        self.app.conf.task_default_queue = self.previous_queue

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.ledger.read_text().splitlines() if line]

    def history(self, key: str) -> list[Record]:
        return list(reversed(self.store.history(key=key, limit=None)))


def settled(worker: Worker) -> None:
    """Every message sent so far has been taken and ended: nothing reserved, active or due.

    Before a worker's warm shutdown after a soft time limit, too: a job whose result the
    worker has not read yet when it shuts down gets its soft time limit again (billiard's
    ``check_timeouts`` in ``on_stop_not_started``), a second SIGUSR1 that can cut the
    child's write of that result, and the worker then waits on the torn pipe until killed
    (30 s per such teardown in CI)."""
    inspect = worker.app.control.inspect(destination=[worker.hostname], timeout=1.0)

    def idle() -> bool:
        for reply in (inspect.active(), inspect.reserved(), inspect.scheduled()):
            if not reply or any(reply.values()):
                return False
        return worker.app.connection_for_write().default_channel.client.llen(worker.queue) == 0

    eventually(idle, "the worker idle", timeout=60)


@contextmanager
def running(
    tmp: Path, redis_url: str, lock_url: str, kind: type[Worker] = Worker, **env: str
) -> Iterator[Any]:
    """A started worker of ``kind`` (its own start's concurrency), its log printed if the
    block fails, stopped at the end."""
    worker = kind(tmp, redis_url, lock_url, **env)
    worker.start()
    try:
        yield worker
    except BaseException:
        print(worker.log.read_text()[-5000:])
        raise
    finally:
        worker.stop()


def bodies(worker: Worker, key: str) -> list[tuple[str, str]]:
    """(event, attempt token) of every body run on ``key``, in ledger order."""
    return [(e["event"], e["token"]) for e in worker.events() if e["key"] == key]


def assert_never_overlapping(events: list[tuple[str, str]]) -> None:
    """Every start is followed by its own end before any other start."""
    assert len(events) % 2 == 0, events
    for start, end in zip(events[::2], events[1::2], strict=True):
        assert start[0] == "start" and end[0] == "end" and start[1] == end[1], events
