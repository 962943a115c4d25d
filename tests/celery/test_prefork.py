"""LockedTask in a real prefork worker (subprocess), Redis broker, Postgres lock store.

These are the tests that show what no embedded worker can: concurrent children, a child
SIGKILLed mid-task, time limits, revoke, broker redelivery, beat, warm shutdown.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import Holder, LockLostError, Outcome, backend_from_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.records import Lease, Record
from tests.support import eventually, unavailable
from tests.support.holders import kill, spawn_holder
from tests.support.services import lease_session_pids, postgres_admin

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
BROKER_DB, RESULTS_DB = 2, 3


@pytest.fixture(scope="module")
def redis_url() -> str:
    try:
        import redis
    except ImportError:
        unavailable("redis-py is not installed: pip install 'celery-dlock[redis]'")
    client = redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        unavailable(f"Redis is not reachable on 127.0.0.1:6379 ({exc})")
    for db in (BROKER_DB, RESULTS_DB):
        redis.Redis(host="127.0.0.1", port=6379, db=db).flushdb()
    return "redis://127.0.0.1:6379"


@pytest.fixture(scope="module", params=["postgres", "file"])
def lock_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The lock store: Postgres in a schema of its own, and the default local file store."""
    if request.param == "file":
        yield f"file://{tmp_path_factory.mktemp('locks')}"
        return
    if importlib.util.find_spec("psycopg") is None:
        unavailable("psycopg is not installed: pip install 'celery-dlock[postgres]'")
    import psycopg

    schema = f"dlock_prefork_{uuid.uuid4().hex[:8]}"
    base = "postgresql://postgres@127.0.0.1:5432/test"
    try:
        with psycopg.connect(base, connect_timeout=3, autocommit=True) as connection:
            connection.execute("select 1")
    except psycopg.Error as exc:
        unavailable(f"PostgreSQL is not reachable on 127.0.0.1:5432 ({exc})")
    url = f"{base}?schema={schema}"
    backend = backend_from_url(url)
    backend.migrate()  # type: ignore[attr-defined]
    backend.close()
    yield url
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'drop schema if exists "{schema}" cascade')


class Worker:
    """A `celery worker --pool=prefork` subprocess and what it writes."""

    def __init__(self, tmp: Path, redis_url: str, lock_url: str, **env: str) -> None:
        self.ledger = tmp / "ledger.jsonl"
        self.ledger.touch()
        self.log = tmp / "worker.log"
        # A queue of its own: two workers on one queue would restore each other's messages.
        self.queue = f"q-{uuid.uuid4().hex[:8]}"
        self.hostname = f"w-{self.queue}@{socket.gethostname()}"
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DLOCK_TEST_BROKER": f"{redis_url}/{BROKER_DB}",
            "DLOCK_TEST_RESULTS": f"{redis_url}/{RESULTS_DB}",
            "DLOCK_TEST_LOCKS": lock_url,
            "DLOCK_TEST_LEDGER": str(self.ledger),
            "DLOCK_TEST_QUEUE": self.queue,
            **env,
        }
        self.process: subprocess.Popen[bytes] | None = None
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("DLOCK_TEST_")})
        # Imported only now: it reads the DLOCK_TEST_* settings just set when first imported.
        workerapp = importlib.import_module("tests.celery.workerapp")
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

    def start(self, concurrency: int = 4) -> Worker:
        args = [
            sys.executable, "-m", "celery", "-A", "workerapp", "worker",
            "--pool=prefork", f"--concurrency={concurrency}", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "--loglevel=INFO", f"--queues={self.queue}",
            f"--hostname={self.hostname}",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(args, env=self.env, stdout=log, stderr=log, cwd=HERE)
        eventually(
            lambda: self.app.control.ping(destination=[self.hostname], timeout=0.5),
            "worker ready",
            timeout=60,
        )
        return self

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


@contextmanager
def running(tmp: Path, redis_url: str, lock_url: str, **env: str) -> Iterator[Worker]:
    worker = Worker(tmp, redis_url, lock_url, **env).start()
    try:
        yield worker
    except BaseException:
        print(worker.log.read_text()[-5000:])
        raise
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, lock_url: str
) -> Iterator[Worker]:
    with running(tmp_path_factory.mktemp("worker"), redis_url, lock_url) as started:
        yield started


def bodies(worker: Worker, key: str) -> list[tuple[str, str]]:
    """(event, attempt token) of every body run on ``key``, in ledger order."""
    return [(e["event"], e["token"]) for e in worker.events() if e["key"] == key]


def assert_never_overlapping(events: list[tuple[str, str]]) -> None:
    """Every start is followed by its own end before any other start."""
    assert len(events) % 2 == 0, events
    for start, end in zip(events[::2], events[1::2], strict=True):
        assert start[0] == "start" and end[0] == "end" and start[1] == end[1], events


# -- many submissions, one order ---------------------------------------------------------


def test_twenty_concurrent_submissions_run_one_at_a_time(worker: Worker) -> None:
    order = int(uuid.uuid4().int % 10**9)
    results = [worker.tasks.serial.delay(order, n) for n in range(20)]
    for result in results:
        result.get(timeout=120)
    events = bodies(worker, f"job:serial:{order}")
    assert len(events) == 40  # all 20 ran...
    assert_never_overlapping(events)  # ...never two at once


def test_twenty_concurrent_submissions_with_once_run_the_body_once(worker: Worker) -> None:
    order = int(uuid.uuid4().int % 10**9)
    other = order + 1
    results = [worker.tasks.charge.delay(order, 10) for _ in range(20)]
    results.append(worker.tasks.charge.delay(other, 5))
    answers = [result.get(timeout=120) for result in results]
    assert len({json.dumps(a) for a in answers[:20]}) == 1  # every caller got the first result
    key = f"job:order:{order}"
    events = bodies(worker, key)
    assert len(events) == 2
    assert_never_overlapping(events)
    outcomes = [record.outcome for record in worker.history(key)]
    assert outcomes.count(Outcome.SUCCEEDED) == 1
    assert outcomes.count(Outcome.SKIPPED) == 19  # replays of the stored result
    assert len(bodies(worker, f"job:order:{other}")) == 2  # another order was not blocked


# -- a child that dies -------------------------------------------------------------------


def started_body(worker: Worker, key: str) -> dict[str, Any]:
    return eventually(
        lambda: next((e for e in worker.events() if e["key"] == key), None), f"body of {key}"
    )


def test_a_sigkilled_child_is_released_and_recorded_disconnected(worker: Worker) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:hold:{order}"
    result = worker.tasks.hold.delay(order, 60)
    body = started_body(worker, key)
    killed_at = time.time()
    os.kill(body["pid"], signal.SIGKILL)
    record = eventually(lambda: next(iter(worker.history(key)), None), "a record of the dead child")
    assert record.outcome is Outcome.DISCONNECTED
    assert record.lease.token == body["token"]
    assert record.lease.holder.pid == body["pid"]
    assert record.problem == "WorkerLostError"
    assert worker.store.get(key) is None
    with pytest.raises(Exception, match=r"WorkerLostError|Worker exited"):
        result.get(timeout=30)
    print(f"\nkill → disconnected record: {record.released_at - killed_at:.3f} s")


def test_a_body_whose_lock_session_ends_is_stopped_with_on_lock_lost_raise(
    worker: Worker, lock_url: str
) -> None:
    if not lock_url.startswith("postgresql"):
        pytest.skip("not applicable: a file lease lives as long as its process")
    order = uuid.uuid4().hex[:8]
    key = f"job:fragile:{order}"
    result = worker.tasks.fragile.delay(order)
    body = started_body(worker, key)
    with postgres_admin() as admin:
        [pid] = lease_session_pids(admin, lock_url.split("schema=")[1], body["fence"])
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(LockLostError) as info:
        result.get(timeout=30)
    assert info.value.key == key and info.value.fence == body["fence"]
    assert [e["event"] for e in worker.events() if e["key"] == key] == ["start"]  # stopped
    taken = worker.store.try_acquire(key, Holder.current(), None)
    assert taken is not None  # free for the next holder, whose takeover records the old one
    ended = {r.outcome: r for r in worker.history(key) if r.lease.token == body["token"]}
    # The takeover records the dead session's lease; the body's own end is recorded lost.
    assert set(ended) == {Outcome.DISCONNECTED, Outcome.LOST}
    assert str(ended[Outcome.LOST].details).startswith("failed not recorded")
    assert worker.store.release(taken, Outcome.SUCCEEDED) is not None


@pytest.mark.parametrize("transactional", [True, False], ids=["record_success", "at_release"])
def test_a_child_killed_after_its_commit_charges_once_only_with_record_success(
    worker: Worker, lock_url: str, transactional: bool
) -> None:
    """The child commits its charge, then is SIGKILLed before its release (the hook in
    ``w.pay``); the duplicate that comes after replays the charge only when the success
    was written in the charge's own transaction. Without it the order is charged twice:
    the hole this option closes."""
    if not lock_url.startswith("postgresql"):
        pytest.skip("not applicable: record_success needs the Postgres store")
    import psycopg

    url, table = lock_url.partition("?")[0], f'"{lock_url.split("schema=")[1]}".charges'
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"CREATE TABLE IF NOT EXISTS {table} (order_id text, token text)")
    order = uuid.uuid4().hex[:8]
    key = f"job:pay:{order}"
    (worker.ledger.parent / f"kill-{order}").touch()
    first = worker.tasks.pay.delay(order, transactional)
    with pytest.raises(Exception, match=r"WorkerLostError|Worker exited"):
        first.get(timeout=60)
    eventually(lambda: worker.store.get(key) is None, "the dead child's lease released")

    duplicate = worker.tasks.pay.delay(order, transactional).get(timeout=60)

    with psycopg.connect(url) as connection:
        tokens = connection.execute(
            f"SELECT token FROM {table} WHERE order_id = %s", (order,)
        ).fetchall()
    committed = [e for e in worker.events() if e["key"] == key and e["event"] == "committed"]
    if transactional:
        assert len(tokens) == 1 and len(committed) == 1  # charged once
        assert duplicate == {"order": order, "fence": committed[0]["fence"]}  # replayed
        kept = worker.store.last_success(key, "w.pay")
        assert kept is not None and kept.lease.token == committed[0]["token"]
    else:
        assert len(tokens) == 2 and len(committed) == 2  # the double charge, shown


def test_a_hard_time_limit_is_recorded_once(worker: Worker) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:hard:{order}"
    result = worker.tasks.hard.delay(order)
    body = started_body(worker, key)
    with pytest.raises(Exception, match="TimeLimitExceeded"):
        result.get(timeout=60)
    # task_failure fires twice for a hard time limit, both before billiard SIGKILLs the
    # child; each firing waits for the child to be gone, then releases by its token.
    killed = f"pid:{body['pid']} exited with 'signal 9"
    eventually(lambda: killed in worker.log.read_text(), "the child killed by the time limit")
    records = eventually(lambda: worker.history(key), "a record after the time limit")
    assert [r.lease.token for r in records] == [body["token"]]
    assert records[0].outcome in (Outcome.DISCONNECTED, Outcome.REVOKED)
    assert worker.store.get(key) is None


def test_a_soft_time_limit_is_recorded_failed(worker: Worker) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:soft:{order}"
    with pytest.raises(Exception, match="SoftTimeLimitExceeded"):
        worker.tasks.soft.delay(order).get(timeout=60)
    [record] = worker.history(key)
    assert record.outcome is Outcome.FAILED
    assert record.problem == "billiard.exceptions.SoftTimeLimitExceeded"
    assert record.details is not None and "Traceback" in record.details


def test_revoke_with_terminate_releases_as_revoked(worker: Worker) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:hold:{order}"
    result = worker.tasks.hold.delay(order, 60)
    body = started_body(worker, key)
    result.revoke(terminate=True)
    record = eventually(lambda: next(iter(worker.history(key)), None), "a record of the revoke")
    assert record.outcome is Outcome.REVOKED
    assert record.lease.token == body["token"]
    assert worker.store.get(key) is None


# -- redelivery, beat, shutdown -------------------------------------------------------


def test_acks_late_redelivery_never_runs_a_second_body_at_once(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    # A visibility timeout shorter than the body: Redis hands the same message (same task
    # id) to another child while the first attempt still runs.
    with running(tmp_path, redis_url, lock_url, DLOCK_TEST_VISIBILITY="1") as late:
        order = uuid.uuid4().hex[:8]
        key = f"job:late:{order}"
        result = late.tasks.late.delay(order, 6)
        skipped = eventually(
            lambda: next((r for r in late.history(key) if r.outcome is Outcome.SKIPPED), None),
            "a redelivered attempt refused by the lock",
        )
        assert skipped.lease.holder.task_id == result.id  # the same task id, a new attempt
        events = bodies(late, key)
        eventually(lambda: len(bodies(late, key)) >= 2, "the first body to end")
        events = bodies(late, key)
        assert_never_overlapping(events[:2])
        first_token = events[0][1]
        assert skipped.lease.token != first_token


def test_beat_triggers_the_janitor_which_reaps_a_dead_holder(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    # A holder that was SIGKILLed outside any worker: only the janitor can clear it.
    process, orphan = spawn_holder(lock_url, "job:orphan")
    kill(process)
    with running(tmp_path, redis_url, lock_url, DLOCK_TEST_JANITOR="1") as janitor_worker:
        env = janitor_worker.env
        beat_args = [
            sys.executable, "-m", "celery", "-A", "workerapp", "beat",
            "--schedule", str(tmp_path / "beat-schedule"), "--max-interval", "1",
            "--loglevel=INFO",
        ]  # fmt: skip
        with open(tmp_path / "beat.log", "ab") as log:
            beat = subprocess.Popen(beat_args, env=env, stdout=log, stderr=log, cwd=HERE)
        try:
            runs = eventually(
                lambda: [
                    r
                    for r in janitor_worker.history("job:celery_dlock.janitor")
                    if r.outcome is Outcome.SUCCEEDED
                ],
                "a janitor run sent by beat",
                timeout=60,
            )
        finally:
            beat.terminate()
            beat.wait(timeout=30)
        reaped = [r for r in janitor_worker.history("job:orphan") if r.lease.token == orphan.token]
        assert [r.outcome for r in reaped] == [Outcome.DISCONNECTED]
        assert sum(run.result["reaped"] for run in runs) >= 1
        assert "Sending due task celery_dlock.janitor" in (tmp_path / "beat.log").read_text()


def test_warm_shutdown_releases_a_lease_kept_for_a_retry(
    tmp_path: Path, redis_url: str, lock_url: str
) -> None:
    order = uuid.uuid4().hex[:8]
    key = f"job:later:{order}"
    with running(tmp_path, redis_url, lock_url) as short_lived:
        short_lived.tasks.later.delay(order)
        # Kept: the attempt ended and its lease got a backstop expiry for the retry's wait.
        kept: Lease = eventually(
            lambda: (lease := short_lived.store.get(key)) and lease.expires_at and lease,
            "the lease kept for the retry",
        )
        assert short_lived.store.try_acquire(key, Holder.current(), None) is None
    # The worker stopped (warm shutdown): what it kept is released and recorded.
    store = backend_from_url(lock_url)
    try:
        assert store.get(key) is None
        [record] = [r for r in store.history(key=key) if r.lease.token == kept.token]
        assert record.outcome is Outcome.RETRIED and record.problem == "WorkerShutdown"
    finally:
        store.close()
