"""Enqueue-time de-duplication (``dedupe``) with a real prefork worker on a Redis broker, on
the Postgres and file lock stores: what a duplicate ``apply_async`` gets, and every way a
mark ends (started, finished, failed, retried, revoked while queued: by a plain revoke or
``revoke_queued``, both at once; expired, a send that fails, a child that dies), each
recorded in the history of the mark's key; what is not guarded at enqueue (``send_task``)
is still guarded by the body lock."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import chain, group

from celery_dlock import BackendError, DuplicateTaskError, Lock, Outcome, backend_from_url
from celery_dlock.records import Record
from tests.celery.prefork import (
    BROKER_DB,
    HERE,
    RESULTS_DB,
    Worker,
    assert_never_overlapping,
    bodies,
)
from tests.support import eventually

pytestmark = pytest.mark.slow


def customer() -> str:
    return uuid.uuid4().hex[:10]


def mark_of(task: str, resource: str) -> str:
    return f"job:{resource}#queued:{task}"


def started(worker: Worker, task_id: str) -> dict[str, Any]:
    return eventually(
        lambda: next(
            (e for e in worker.events() if e["id"] == task_id and e["event"] == "start"), None
        ),
        f"the body of {task_id} started",
    )


def marks(worker: Worker, key: str, count: int) -> list[Record]:
    """The ``count`` records of the mark ``key``, oldest first, once they are all there."""

    def enough() -> list[Record] | None:
        found = worker.history(key)
        return found if len(found) >= count else None

    return eventually(enough, f"{count} records of {key}")


def test_until_started_sends_one_message_and_lets_one_queue_behind_a_running_one(
    worker: Worker,
) -> None:
    who = customer()
    sync = worker.tasks.sync
    queued = [sync.apply_async((who, 1.0), countdown=1) for _ in range(5)]
    assert len({result.id for result in queued}) == 1  # one message; four got its result
    started(worker, queued[0].id)
    behind = sync.delay(who, 0.1)  # started: the mark is gone, one more may queue
    assert behind.id != queued[0].id
    assert sync.delay(who, 0.1).id == behind.id  # but only one
    queued[0].get(timeout=60)
    behind.get(timeout=60)
    events = bodies(worker, f"job:sync:{who}")
    assert len(events) == 4  # two bodies, one after the other
    assert_never_overlapping(events)
    key = mark_of("w.sync", f"sync:{who}")
    records = marks(worker, key, 2)
    assert [r.outcome for r in records] == [Outcome.DEQUEUED, Outcome.DEQUEUED]
    assert [r.lease.holder.task_id for r in records] == [queued[0].id, behind.id]
    assert worker.store.get(key) is None


def test_until_started_keeps_the_mark_of_a_message_re_queued_for_a_busy_key(
    worker: Worker,
) -> None:
    """The second message is picked up while the first body runs: its key is busy, so it
    goes back to the queue, still queued as far as its duplicates are concerned."""
    who = customer()
    sync = worker.tasks.sync
    first = sync.delay(who, 2.0)
    started(worker, first.id)
    second = sync.delay(who, 0)
    assert second.id != first.id
    eventually(lambda: f"[{second.id}] re-queued" in worker.log.read_text(), "a busy re-queue")
    assert sync.delay(who, 0).id == second.id  # still queued: a duplicate
    first.get(timeout=60)
    second.get(timeout=60)
    key = mark_of("w.sync", f"sync:{who}")
    records = marks(worker, key, 2)
    assert [r.lease.holder.task_id for r in records] == [first.id, second.id]
    assert [r.outcome for r in records] == [Outcome.DEQUEUED, Outcome.DEQUEUED]
    assert len(bodies(worker, f"job:sync:{who}")) == 4  # two runs, not three


def test_until_finished_holds_while_running_and_ends_with_the_bodys_outcome(
    worker: Worker,
) -> None:
    who = customer()
    report = worker.tasks.report
    first = report.delay(who, 1.0)
    started(worker, first.id)
    assert report.delay(who, 0).id == first.id  # running: still a duplicate
    first.get(timeout=60)
    key = mark_of("w.report", f"report:{who}")
    [done] = marks(worker, key, 1)
    assert done.outcome is Outcome.SUCCEEDED and done.lease.holder.task_id == first.id
    again = report.delay(who, 0)  # finished: a new run may be sent
    assert again.id != first.id
    again.get(timeout=60)


def test_a_failed_body_releases_its_mark_as_failed(worker: Worker) -> None:
    who = customer()
    result = worker.tasks.report.delay(who, 0, fail=True)
    with pytest.raises(ValueError, match="failed"):
        result.get(timeout=60)
    [record] = marks(worker, mark_of("w.report", f"report:{who}"), 1)
    assert record.outcome is Outcome.FAILED and "ValueError" in (record.details or "")
    assert record.problem == "ValueError"  # as a body's failed record names it


def test_a_retry_is_the_same_logical_task_and_keeps_the_mark(worker: Worker) -> None:
    who = customer()
    report = worker.tasks.report
    first = report.delay(who, 0, retry=True)
    eventually(
        lambda: [e for e in worker.events() if e["id"] == first.id and e.get("retries") == 0],
        "the first attempt",
    )
    assert report.delay(who, 0).id == first.id  # between the attempts: still queued
    first.get(timeout=60)
    key = mark_of("w.report", f"report:{who}")
    [record] = marks(worker, key, 1)  # one mark, ended once, by the retry's success
    assert record.outcome is Outcome.SUCCEEDED
    mine = [e for e in worker.events() if e["id"] == first.id]
    attempts = [e["retries"] for e in mine if e["event"] == "start"]
    assert attempts == [0, 1], (mine, worker.history(f"job:report:{who}"))


def test_a_plain_revoke_releases_the_mark_of_a_queued_message_at_once(worker: Worker) -> None:
    who = customer()
    sync = worker.tasks.sync
    queued = sync.apply_async((who, 0), countdown=60)  # the worker reaches it in a minute
    worker.app.control.revoke(queued.id)
    key = mark_of("w.sync", f"sync:{who}")
    # At once: long before the worker reaches the message (the wrapped revoke command).
    [record] = eventually(lambda: worker.history(key), "the mark released", timeout=15)
    assert record.outcome is Outcome.REVOKED and record.lease.holder.task_id == queued.id
    # Released by the wrapped revoke command, or, when the message reached the worker after
    # the revoke did (the worker then discards it at once), by the task_revoked signal.
    assert record.details in ("revoked while queued (a revoke reached the worker)", "revoked")
    assert worker.store.get(key) is None
    again = sync.delay(who, 0)  # the next call sends again
    assert again.id != queued.id
    again.get(timeout=60)
    assert [e for e in worker.events() if e["id"] == queued.id] == []


def test_a_revoke_without_terminate_leaves_a_running_tasks_mark(worker: Worker) -> None:
    who = customer()
    report = worker.tasks.report
    running = report.delay(who, 3.0)
    started(worker, running.id)
    worker.app.control.revoke(running.id)  # Celery lets a running task finish
    assert report.delay(who, 0).id == running.id  # until_finished: still a duplicate
    running.get(timeout=60)
    key = mark_of("w.report", f"report:{who}")
    [record] = marks(worker, key, 1)
    assert record.outcome is Outcome.SUCCEEDED  # ended by the body, not by the revoke


def test_revoke_queued_releases_the_mark_at_once_and_the_message_never_runs(
    worker: Worker,
) -> None:
    who = customer()
    sync = worker.tasks.sync
    queued = sync.apply_async((who, 0), countdown=3)
    assert sync.revoke_queued(who, 0) == queued.id
    key = mark_of("w.sync", f"sync:{who}")
    assert worker.store.get(key) is None  # at once, not when the worker reaches the message
    [record] = worker.history(key)
    assert record.outcome is Outcome.REVOKED and record.lease.holder.task_id == queued.id
    again = sync.delay(who, 0)  # the next call sends again
    assert again.id != queued.id
    again.get(timeout=60)
    eventually(lambda: queued.state == "REVOKED", "the queued message discarded")
    assert [e for e in worker.events() if e["id"] == queued.id] == []
    assert sync.revoke_queued(who, 0) is None  # nothing queued now


def test_an_expired_message_releases_its_mark_as_expired(worker: Worker) -> None:
    who = customer()
    sync = worker.tasks.sync
    queued = sync.apply_async((who, 0), countdown=2, expires=1)
    [record] = marks(worker, mark_of("w.sync", f"sync:{who}"), 1)
    assert record.outcome is Outcome.EXPIRED and record.lease.holder.task_id == queued.id
    assert bodies(worker, f"job:sync:{who}") == []


def test_a_send_that_fails_releases_the_mark_before_apply_async_raises(worker: Worker) -> None:
    who = customer()
    sync = worker.tasks.sync
    with pytest.raises(Exception, match="no-such-serializer"):
        sync.apply_async((who, 0), serializer="no-such-serializer")
    key = mark_of("w.sync", f"sync:{who}")
    assert worker.store.get(key) is None  # released before the exception reached us
    [record] = worker.history(key)
    assert record.outcome is Outcome.FAILED
    assert (record.details or "").startswith("the message was not sent")
    sent = sync.delay(who, 0)
    sent.get(timeout=60)


@pytest.mark.parametrize("delay", ["countdown", "eta", "eta as an ISO string"])
def test_a_countdown_or_eta_lengthens_the_marks_ttl(worker: Worker, delay: str) -> None:
    who = customer()
    eta = datetime.now(UTC) + timedelta(seconds=30)
    options: dict[str, Any] = {
        "countdown": {"countdown": 30},
        "eta": {"eta": eta},
        "eta as an ISO string": {"eta": eta.isoformat()},  # Celery takes this form too
    }[delay]
    queued = worker.tasks.sync.apply_async((who, 0), **options)
    mark = worker.store.get(mark_of("w.sync", f"sync:{who}"))
    assert mark is not None and mark.expires_at is not None
    assert mark.holder.task_id == queued.id
    lives = mark.expires_at - mark.acquired_at
    assert 3600 + 28 < lives < 3600 + 31  # dlock_dedupe_ttl past the countdown or eta
    worker.app.control.revoke(queued.id)


def test_a_duplicate_raises_a_picklable_error_naming_the_key_and_the_task(
    worker: Worker,
) -> None:
    who = customer()
    strict = worker.tasks.sync_strict
    queued = strict.apply_async((who,), countdown=2)
    with pytest.raises(DuplicateTaskError) as raised:
        strict.delay(who)
    error = raised.value
    key = mark_of("w.sync_strict", f"sync:{who}")
    assert error.key == key and error.task_id == queued.id
    assert key in str(error) and queued.id in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.key, copy.task_id, str(copy)) == (error.key, error.task_id, str(error))
    queued.get(timeout=60)


def test_a_callable_on_duplicate_decides_what_a_duplicate_returns(worker: Worker) -> None:
    who = customer()
    custom = worker.tasks.sync_custom
    queued = custom.apply_async((who,), countdown=2)
    answer = custom.delay(who)
    key = mark_of("w.sync_custom", f"sync:{who}")
    assert answer == {"task": "w.sync_custom", "mark": key, "queued": queued.id}
    queued.get(timeout=60)


def test_positional_and_keyword_calls_are_duplicates_of_each_other(worker: Worker) -> None:
    """celery-singleton keys positional and keyword calls apart unless told (unique_on);
    here the key is rendered from the bound arguments."""
    who = customer()
    sync = worker.tasks.sync
    queued = sync.apply_async((who, 0), countdown=2)
    assert sync.apply_async(kwargs={"customer": who, "seconds": 0}).id == queued.id
    assert sync.apply_async((who,), {"seconds": 0}).id == queued.id
    queued.get(timeout=60)


def test_send_task_is_not_guarded_at_enqueue_but_the_body_lock_still_is(
    worker: Worker,
) -> None:
    who = customer()
    sent = [worker.app.send_task("w.sync", (who, 0.5)) for _ in range(2)]
    assert sent[0].id != sent[1].id  # by name: no mark, two messages
    for result in sent:
        result.get(timeout=60)
    events = bodies(worker, f"job:sync:{who}")
    assert len(events) == 4
    assert_never_overlapping(events)
    assert worker.history(mark_of("w.sync", f"sync:{who}")) == []


def test_a_message_of_a_workflow_is_always_sent_and_its_bodies_still_take_turns(
    worker: Worker,
) -> None:
    who = customer()
    sync, report = worker.tasks.sync, worker.tasks.report
    grouped = group([sync.si(who, 0.3) for _ in range(3)]).apply_async()
    assert len({result.id for result in grouped.results}) == 3  # each member is sent
    assert len(grouped.get(timeout=60)) == 3  # and the group gets every result
    events = bodies(worker, f"job:sync:{who}")
    assert len(events) == 6
    assert_never_overlapping(events)  # the body lock still guards them
    chained = chain(report.si(who, 0), report.si(who, 0)).apply_async()
    chained.get(timeout=60)  # the first link, carrying the rest, was sent
    runs = [e for e in worker.events() if e["key"] == f"job:report:{who}" and e["event"] == "end"]
    assert len(runs) == 2
    assert worker.history(mark_of("w.sync", f"sync:{who}")) == []


def test_a_child_killed_mid_task_has_its_mark_released_by_the_parent(worker: Worker) -> None:
    who = customer()
    report = worker.tasks.report
    running = report.delay(who, 60)
    body = started(worker, running.id)
    os.kill(body["pid"], signal.SIGKILL)
    [record] = marks(worker, mark_of("w.report", f"report:{who}"), 1)
    assert record.outcome is Outcome.DISCONNECTED
    assert record.lease.holder.task_id == running.id
    assert report.delay(who, 0).id != running.id  # nothing left blocking the key


@pytest.mark.parametrize("request_class", ["locked", "celery"])
def test_a_child_killed_before_its_body_started_has_its_message_sent_again(
    worker: Worker, request_class: str
) -> None:
    """``until_started``: the calls coalesced into a message are promised a run that starts
    after them. A child killed while it waits for the busy key (its mark still held) ran no
    body: the parent sends the message again under its mark (state ``RETRY``, no
    ``FAILURE`` stored and no ``task_failure`` sent first), instead of ending the mark and
    dropping every coalesced call with the message (found by the dedupe soak:
    ``bench/torture/dedupesoak.py``). A task with Celery's own worker request class gets
    the same from the parent's ``task_failure`` handler, after Celery stored ``FAILURE``."""
    who, locked = customer(), request_class == "locked"
    sync = worker.tasks.sync_wait if locked else worker.tasks.sync_wait_celery_request
    key = mark_of(sync.name, f"sync:{who}")
    busy = Lock(worker.store, f"job:sync:{who}")
    busy.acquire()
    try:
        first = sync.delay(who)

        def result() -> Any:  # the caller's own; a fresh one where FAILURE may have been read
            return first if locked else sync.AsyncResult(first.id)

        waiting = eventually(
            lambda: next((e for e in worker.events() if e["id"] == first.id), None),
            "its child past task_prerun",
        )
        os.kill(waiting["pid"], signal.SIGKILL)
        eventually(lambda: result().state == "RETRY", "the message sent again")
        mark = worker.store.get(key)
        assert mark is not None and mark.holder.task_id == first.id
        assert sync.delay(who).id == first.id  # not started: still a duplicate
    finally:
        busy.release()
    assert result().get(timeout=60)["pid"] != waiting["pid"]  # the message sent again ran
    failure = [] if locked else ["failure"]  # Celery's request: task_failure, then the resend
    assert [e["event"] for e in worker.events() if e["id"] == first.id] == [
        "prerun", *failure, "prerun", "start", "end",
    ]  # fmt: skip
    [record] = marks(worker, key, 1)
    assert (record.outcome, record.lease.holder.task_id) == (Outcome.DEQUEUED, first.id)
    assert sync.delay(who).id != first.id


def test_a_producer_killed_between_mark_and_send_leaves_nothing_that_blocks_the_key(
    worker: Worker,
) -> None:
    """celery-once and celery-singleton keep such a key blocked until their TTL (or for
    ever); on Postgres and the file store the mark dies with its producer."""
    who = customer()
    dies = "lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)"
    code = (
        "import os, signal\n"
        "import workerapp\n"
        "from celery_dlock.celery import dedupe\n"
        f"dedupe.send(workerapp.sync, ({who!r}, 0), {{}}, {{}}, {dies})\n"
    )
    producer = subprocess.run(
        [sys.executable, "-c", code], env=worker.env, cwd=HERE, timeout=60, check=False
    )
    assert producer.returncode == -signal.SIGKILL
    key = mark_of("w.sync", f"sync:{who}")
    orphan = worker.store.get(key)
    assert orphan is not None  # the dead producer's mark is there, with no message behind it
    sent = worker.tasks.sync.delay(who, 0)
    assert sent.id != orphan.holder.task_id  # its holder is gone: taken over, and sent
    sent.get(timeout=60)
    first = worker.history(key)[0]
    assert first.outcome is Outcome.DISCONNECTED and first.lease.token == orphan.token


def produce(env: dict[str, str], who: str, *, then: str, send_ttl: float = 60.0) -> str:
    """Send ``w.sync(who, 0)`` (countdown 30 s) from a producer process of its own, which
    then exits normally (``then="exit"``) or is SIGKILLed after its send (``"kill"``) or
    before it (``"die-before-send"``); the task id it got, or "" if it died first."""
    send = {
        "exit": "print(workerapp.sync.apply_async((who, 0), countdown=30).id, flush=True)",
        "kill": "print(workerapp.sync.apply_async((who, 0), countdown=30).id, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)",
        "die-before-send": "dedupe.send(workerapp.sync, (who, 0), {}, {}, "
        "lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))",
    }[then]
    code = (
        "import os, signal, sys\n"
        "import workerapp\n"
        "from celery_dlock.celery import dedupe\n"
        f"dedupe.SEND_TTL = {send_ttl!r}\n"
        f"who = {who!r}\n"
        f"{send}\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=HERE,
        timeout=60,
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == (0 if then == "exit" else -signal.SIGKILL), done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("then", ["exit", "kill"])
def test_a_producer_gone_after_its_send_leaves_the_mark_to_its_message(
    worker: Worker, then: str
) -> None:
    """A script or a recycled web worker that sends and goes: the mark is the message's
    now (handed over), not the producer's, so its duplicates still coalesce."""
    who = customer()
    first = produce(worker.env, who, then=then)
    key = mark_of("w.sync", f"sync:{who}")
    time.sleep(0.5)  # for the store to see the producer's session or process gone
    assert worker.tasks.sync.delay(who, 0).id == first  # still a duplicate
    mark = worker.store.get(key)
    assert mark is not None and mark.holder.task_id == first
    assert worker.history(key) == []  # not taken over, nothing ended
    worker.app.control.revoke(first)
    [record] = marks(worker, key, 1)
    assert record.outcome is Outcome.REVOKED


def test_on_redis_a_producer_killed_before_its_send_blocks_the_key_for_send_ttl_only(
    tmp_path: Any, redis_url: str
) -> None:
    """Redis cannot tell that a producer died: its mark lives only as long as a send may
    take (``SEND_TTL``, shortened here), not ``dedupe_ttl`` (an hour): celery-once and
    celery-singleton keep such a key blocked until their own timeout."""
    # Database 1, which no test flushes, under a prefix of its own: database 5 (used here
    # until it failed 1 run in 6) is the broker of the fifth pytest process's workers,
    # flushed when that process starts its Celery tests, history and marks with it.
    locks = f"{redis_url}/1?prefix=orphan-{uuid.uuid4().hex[:8]}"
    env = producer_env(tmp_path, redis_url, locks)
    who = customer()
    # 12 s: the next producer must start and look within it (a Python process importing
    # Celery: 1-3 s on a loaded 2-core machine, where 2 s made this test fail in CI, and
    # 6 s did once, on a machine whose CI loop took 1.46 s).
    assert produce(env, who, then="die-before-send", send_ttl=12.0) == ""
    store = backend_from_url(locks)
    key = mark_of("w.sync", f"sync:{who}")
    orphan = store.get(key)
    assert orphan is not None and orphan.expires_at is not None
    assert orphan.expires_at - orphan.acquired_at == pytest.approx(12.0, abs=0.1)
    assert produce(env, who, then="exit") == orphan.holder.task_id  # blocked meanwhile
    time.sleep(max(0.0, orphan.expires_at - time.time()) + 0.3)
    sent = produce(env, who, then="exit")
    assert sent not in ("", orphan.holder.task_id)  # sent, under a new mark
    mark = store.get(key)
    assert mark is not None and mark.holder.task_id == sent
    assert mark.expires_at is not None and mark.expires_at - time.time() > 3000  # handed over
    ended = [r for r in store.history(key=key) if r.lease.token == orphan.token]
    assert [r.outcome for r in ended] == [Outcome.EXPIRED], store.history(key=key)


@pytest.mark.exclusive  # restarts the Postgres every test shares
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_postgres_restart_keeps_the_marks_a_clean_one_can_keep(
    worker: Worker, lock_url: str, mode: str
) -> None:
    """A clean restart (``-m fast``) keeps the locks table, and a mark handed over to its
    message lives by its ttl: duplicates still coalesce. A crash (``-m immediate``) empties
    the UNLOGGED locks table: a duplicate is sent, and the body lock still keeps the two
    runs apart."""
    if not lock_url.startswith("postgres"):
        pytest.skip("a Postgres restart")
    from tests.backends.test_postgres_restart import RESTART, ensure_server_up, restart_server

    if not RESTART:
        pytest.skip("DLOCK_PG_RESTART is empty: no restart command")
    who = customer()
    sync = worker.tasks.sync
    queued = sync.apply_async((who, 0.5), countdown=6)
    try:
        restart_server(RESTART.replace("-m fast", f"-m {mode}"))
    finally:
        ensure_server_up()
    again = eventually(lambda: _sent_or_none(sync, who, 0.5), "a send after the restart")
    results = [queued] if mode == "fast" else [queued, again]
    assert (again.id == queued.id) is (mode == "fast")
    for result in results:
        result.get(timeout=60)
    events = bodies(worker, f"job:sync:{who}")
    assert len(events) == 2 * len(results)
    assert_never_overlapping(events)


def _sent_or_none(task: Any, *args: Any) -> Any:
    """``task.delay(*args)``, or None while the lock store refuses (the server is starting)."""
    try:
        return task.delay(*args)
    except BackendError:
        return None


@pytest.mark.parametrize("persistence", ["none", "aof"])
def test_a_redis_restart_keeps_the_marks_its_persistence_keeps(
    tmp_path: Any, redis_url: str, persistence: str
) -> None:
    """The lock store is a Redis of its own, restarted by SIGKILL: without persistence its
    marks are gone and the next call sends (the body lock still keeps runs apart); with an
    append-only file synced on every write, the mark is there and the call is a duplicate."""
    from tests.support.redis_server import RedisServer

    extra = ("--appendonly", "yes", "--appendfsync", "always") if persistence == "aof" else ()
    directory = Path(tempfile.mkdtemp(prefix="dlock-redis-"))
    server = RedisServer(directory, *extra)
    server.start()
    try:
        env = producer_env(tmp_path, redis_url, server.url(f"dedupe-{persistence}"))
        who = customer()
        first = produce(env, who, then="exit")
        assert produce(env, who, then="exit") == first  # a duplicate before the restart
        server.restart()
        again = produce(env, who, then="exit")
        assert (again == first) is (persistence == "aof"), (first, again)
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def producer_env(tmp_path: Any, redis_url: str, locks: str) -> dict[str, str]:
    """The environment of a producer process on the Redis broker, with the lock store
    ``locks``, sending to a queue no worker reads."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("DLOCK_TEST_")},
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "DLOCK_TEST_BROKER": f"{redis_url}/{BROKER_DB}",
        "DLOCK_TEST_RESULTS": f"{redis_url}/{RESULTS_DB}",
        "DLOCK_TEST_LOCKS": locks,
        "DLOCK_TEST_LEDGER": str(tmp_path / "ledger"),
        "DLOCK_TEST_QUEUE": f"nowhere-{uuid.uuid4().hex[:8]}",
    }
