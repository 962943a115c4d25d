"""LockedTask under the worker pools and settings the prefork tests do not cover, tried as a
demanding production user would, with real ``celery worker`` subprocesses on a Redis broker
and the Postgres (session liveness) and Redis (ttl) lock stores: ``--pool threads`` (several
bodies in one process, ``once``, ``dedupe``, a cold shutdown during a warm one), prefork
with a child recycled after each task, and a message redelivered after its child was
SIGKILLed (``acks_late`` + ``reject_on_worker_lost``) on a store whose leases live by
their ttl."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import Outcome
from tests.celery.prefork import Worker, running
from tests.celery.support import own_store
from tests.support import eventually

pytestmark = pytest.mark.slow


class PoolWorker(Worker):
    """A worker of ``tests.celery.pools_trial_app`` with the pool and options of
    ``DLOCK_TEST_POOL_ARGS`` (space-separated ``celery worker`` options)."""

    module = "pools_trial_app"

    def pool_options(self) -> list[str]:
        return self.env.get("DLOCK_TEST_POOL_ARGS", "--pool=threads").split()


@pytest.fixture(scope="module", params=["postgres", "redis"])
def store_url_of(request: pytest.FixtureRequest) -> Iterator[str]:
    """A lock store of this module's own: Postgres (session liveness) in a schema of its
    own, or Redis under a prefix of its own."""
    with own_store(request.param, "pools", ttl=3) as url:
        yield url


def pool_worker(tmp: Path, redis_url: str, lock_url: str, options: str) -> Any:
    return running(tmp, redis_url, lock_url, PoolWorker, DLOCK_TEST_POOL_ARGS=options)


def started(worker: Worker, key: str) -> dict[str, Any]:
    """The ledger's ``start`` event of the first body on ``key``, once written."""

    def start() -> dict[str, Any] | None:
        return next((e for e in worker.events() if e["key"] == key), None)

    return eventually(start, f"a body of {key} started")


def assert_never_overlapping(worker: Worker, key: str) -> None:
    events = [(e["event"], e["token"]) for e in worker.events() if e["key"] == key]
    assert len(events) % 2 == 0, events
    for start, end in zip(events[::2], events[1::2], strict=True):
        assert start[0] == "start" and end[0] == "end" and start[1] == end[1], events


def let_end(worker: Worker, *task_ids: str) -> None:
    """Let the bodies of ``task_ids`` end (``go-<task id>`` beside the ledger)."""
    for task_id in task_ids:
        (worker.ledger.parent / f"go-{task_id}").touch()


def test_a_threads_pool_holds_different_keys_at_once_and_one_key_in_turn(
    tmp_path: Path, redis_url: str, store_url_of: str
) -> None:
    run = uuid.uuid4().hex[:8]
    with pool_worker(tmp_path, redis_url, store_url_of, "--pool=threads") as worker:
        apart = [worker.tasks.hold.delay(f"{run}-{n}", 30) for n in range(4)]
        bodies = [started(worker, f"job:hold:{run}-{n}") for n in range(4)]
        # Four threads of one process hold four keys at once, each with its own lease.
        assert len({body["pid"] for body in bodies}) == 1
        assert len({body["thread"] for body in bodies}) == 4
        held = [worker.store.get(f"job:hold:{run}-{n}") for n in range(4)]
        assert [lease and lease.token for lease in held] == [body["token"] for body in bodies]
        let_end(worker, *(result.id for result in apart))
        same = [worker.tasks.hold.delay(f"{run}-same", 0.1) for _ in range(4)]
        results = [result.get(timeout=60) for result in apart + same]
        assert_never_overlapping(worker, f"job:hold:{run}-same")
        for result in results:
            records = [r for r in worker.history(result["key"]) if r.lease.token == result["token"]]
            assert [r.outcome for r in records] == [Outcome.SUCCEEDED]
            assert worker.store.get(result["key"]) is None


def test_once_and_dedupe_under_a_threads_pool(
    tmp_path: Path, redis_url: str, store_url_of: str
) -> None:
    run = uuid.uuid4().hex[:8]
    with pool_worker(tmp_path, redis_url, store_url_of, "--pool=threads") as worker:
        answers = [worker.tasks.charge.delay(run, 0.3) for _ in range(4)]
        assert len({str(answer.get(timeout=60)) for answer in answers}) == 1
        outcomes = [(r.outcome, r.problem) for r in worker.history(f"job:charge:{run}")]
        assert outcomes == [(Outcome.SUCCEEDED, None)] + [(Outcome.SKIPPED, "once")] * 3
        first = worker.tasks.sync.delay(run, 30)
        assert {worker.tasks.sync.delay(run, 30).id for _ in range(5)} == {first.id}
        let_end(worker, first.id)
        first.get(timeout=30)
        assert [e["event"] for e in worker.events() if e["key"] == f"job:sync:{run}"] == [
            "start",
            "end",
        ]


def test_a_threads_pool_stopped_cold_during_a_warm_shutdown_keeps_a_running_body_s_lease(
    tmp_path: Path, redis_url: str, store_url_of: str
) -> None:
    """SIGTERM, then SIGQUIT while the warm shutdown waits for the threads pool: Celery's
    threads pool cannot cancel a body (NotImplementedError, "Error on stopping Pool"), the
    worker goes on to ``worker_shutdown`` and ends with the body still running. That body's
    lease must not be released by the shutdown (it was, recorded ``revoked`` WorkerShutdown,
    while the body ran: another holder could get in beside it); the process's end frees it
    by the store's liveness, and the janitor records it."""
    run = uuid.uuid4().hex[:8]
    key = f"job:hold:{run}"
    worker = PoolWorker(tmp_path, redis_url, store_url_of, DLOCK_TEST_POOL_ARGS="--pool=threads")
    worker.loglevel = "DEBUG"
    worker.start()
    try:
        worker.tasks.hold.delay(run, 30)
        body = started(worker, key)
        assert worker.process is not None
        worker.process.send_signal(signal.SIGTERM)
        eventually(lambda: "Stopping Pool..." in worker.log.read_text(), "the pool stopping")
        worker.process.send_signal(signal.SIGQUIT)
        worker.process.wait(timeout=30)
        assert "Error on stopping Pool" in worker.log.read_text()
        assert [e["event"] for e in worker.events() if e["key"] == key] == ["start"]
        ours = [r for r in worker.history(key) if r.lease.token == body["token"]]
        assert ours == []  # nothing released it under the running body
        reaped = eventually(lambda: [r for r in worker.store.reap() if r.lease.key == key], "reap")
        assert [(r.lease.token, r.outcome) for r in reaped] == [
            (body["token"], Outcome.EXPIRED if "redis" in store_url_of else Outcome.DISCONNECTED)
        ]
        assert worker.store.get(key) is None
    finally:
        worker.stop()


@pytest.mark.parametrize("option", ["--max-tasks-per-child=1", "--max-memory-per-child=1"])
def test_a_child_recycled_after_its_task_released_its_lease_as_succeeded(
    tmp_path: Path, redis_url: str, store_url_of: str, option: str
) -> None:
    """Prefork with a child replaced after each task (``--max-tasks-per-child=1``; a
    ``--max-memory-per-child`` of 1 KiB, which every child exceeds): each child's lease is
    released by the child as ``succeeded`` before it exits (not left to its lock session's
    end, ``disconnected``), and no error is logged by the exits."""
    if "redis" in store_url_of:
        pytest.skip("not applicable: the lock session of a child is Postgres's")
    run = uuid.uuid4().hex[:8]
    key = f"job:hold:{run}"
    with pool_worker(tmp_path, redis_url, store_url_of, f"--pool=prefork {option}") as worker:
        answers = [worker.tasks.hold.delay(run, 0.05) for _ in range(2)]
        bodies = [answer.get(timeout=60) for answer in answers]
        assert len({body["pid"] for body in bodies}) == 2  # a new child for each task
        eventually(lambda: not _alive(bodies[0]["pid"]), "the first child gone")
        records = worker.history(key)
        assert sorted((r.lease.token, r.outcome) for r in records) == sorted(
            (body["token"], Outcome.SUCCEEDED) for body in bodies
        )
        assert worker.store.get(key) is None
        assert worker.store.reap() == []
        log = worker.log.read_text()
        assert "ERROR" not in log and "Traceback" not in log, log


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_redelivery_after_a_killed_child_ends_its_dead_attempt_s_lease_on_a_ttl_store(
    tmp_path: Path, redis_url: str, store_url_of: str
) -> None:
    """acks_late + reject_on_worker_lost, the child SIGKILLed in the body: the message comes
    back with no signal to the worker's parent, which releases a dead child's lease in the
    other cases. On Redis, whose leases live by their ttl, the redelivery found its own dead
    attempt's lease and was re-queued until the ttl ran out (60 s by default, 600 s here;
    recorded ``expired``). It ends that lease by its token, ``disconnected``, and runs; once: one
    body to its end, and a duplicate replays it."""
    run = uuid.uuid4().hex[:8]
    key = f"job:late:{run}"
    # A ttl the test never waits out: the parent may take seconds to see its child die.
    lasting = store_url_of.replace("ttl=3", "ttl=600")
    with pool_worker(tmp_path, redis_url, lasting, "--pool=prefork") as worker:
        (worker.ledger.parent / f"kill-{run}").touch()
        answer = worker.tasks.late.delay(run, 0).get(timeout=30)
        starts = [e for e in worker.events() if e["key"] == key and e["event"] == "start"]
        assert len({start["id"] for start in starts}) == 1 and len(starts) == 2
        dead, ran = starts[0]["token"], starts[1]["token"]
        records = [(r.lease.token, r.outcome) for r in worker.history(key)]
        assert records == [(dead, Outcome.DISCONNECTED), (ran, Outcome.SUCCEEDED)]
        assert answer["token"] == ran
        assert worker.tasks.late.delay(run, 0).get(timeout=60) == answer
        assert [e["event"] for e in worker.events() if e["key"] == key] == ["start", "start", "end"]
