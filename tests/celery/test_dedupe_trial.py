"""``dedupe`` tried as a demanding user would, with real prefork workers on a Redis broker
(and producers on RabbitMQ), on the Postgres and file lock stores: what Celery's canvas
sends on the caller's behalf (the last step of a chain, a callback) is always sent, as its
result is waited for under an id frozen in advance; ``revoke_queued`` leaves the mark of a
running task alone; a message's ``expires`` bounds its mark (RabbitMQ drops an expired
message itself: no worker ever sees it), while a taken message keeps its mark as it runs;
an ``until_finished`` body skipped for a busy key records its mark ``skipped``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from celery import chain

from celery_dlock import Lock, Outcome, backend_from_url
from celery_dlock.celery.dedupe import EXPIRY_GRACE
from tests.celery.prefork import BROKER_DB, HERE, RESULTS_DB, Worker, assert_never_overlapping
from tests.celery.test_dedupe import customer, mark_of, marks, started
from tests.support import eventually, unavailable

pytestmark = pytest.mark.slow

RABBITMQ = os.environ.get("DLOCK_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")


def runs(worker: Worker, key: str) -> list[tuple[str, str]]:
    """(event, task id) of every body run on ``key``, in ledger order."""
    return [(e["event"], e["id"]) for e in worker.events() if e["key"] == key]


def test_the_last_step_of_a_chain_is_sent_while_a_duplicate_is_queued(worker: Worker) -> None:
    """The worker sends a chain's last step under the id the chain's result waits for: a
    duplicate of a queued message or not, it must be sent (it was coalesced, and the
    chain's result never came)."""
    who = customer()
    report = worker.tasks.report
    queued = report.apply_async((who, 0), countdown=2)
    chained = chain(worker.tasks.serial.si(who, 1), report.si(who, 0)).apply_async()
    assert "fence" in chained.get(timeout=30)
    assert chained.id != queued.id
    alone = chain(report.si(who, 0)).apply_async()  # a chain of one: its result is frozen too
    alone.get(timeout=30)
    queued.get(timeout=60)
    events = runs(worker, f"job:report:{who}")
    assert {task_id for _, task_id in events} == {queued.id, chained.id, alone.id}
    assert_never_overlapping(events)  # the body lock still takes them in turn
    [record] = marks(worker, mark_of("w.report", f"report:{who}"), 1)
    assert record.lease.holder.task_id == queued.id  # the chain's steps took no mark
    assert record.outcome is Outcome.SUCCEEDED


def test_a_callback_is_sent_while_a_duplicate_is_queued(worker: Worker) -> None:
    """A callback (``link=``) is sent by the worker when its parent ends, under the id its
    frozen signature gave the caller."""
    who = customer()
    report = worker.tasks.report
    queued = report.apply_async((who, 0), countdown=2)
    callback = report.si(who, 0)
    promised = callback.freeze()
    worker.tasks.serial.apply_async((who, 1), link=callback)
    promised.get(timeout=30)
    queued.get(timeout=60)
    events = runs(worker, f"job:report:{who}")
    assert {task_id for _, task_id in events} == {queued.id, promised.id}
    assert_never_overlapping(events)


def test_revoke_queued_leaves_the_mark_of_a_running_until_finished_task(
    worker: Worker,
) -> None:
    """Nothing is queued while the task runs: as a plain revoke does, ``revoke_queued``
    leaves its mark (it released it as "revoked while queued", and a duplicate was sent
    while the first still ran)."""
    who = customer()
    report = worker.tasks.report
    running = report.delay(who, 6.0)
    started(worker, running.id)
    assert report.revoke_queued(who, 6.0) is None
    key = mark_of("w.report", f"report:{who}")
    mark = worker.store.get(key)
    assert mark is not None and mark.holder.task_id == running.id
    assert report.delay(who, 0).id == running.id  # still a duplicate
    running.get(timeout=60)
    [record] = marks(worker, key, 1)
    assert record.outcome is Outcome.SUCCEEDED and record.lease.holder.task_id == running.id


def _produce(env: dict[str, str], who: str, queue: str, expires: float | None = None) -> str:
    """Send ``w.sync(who, 0)`` to ``queue`` from a producer process of its own; its id."""
    options = f"queue={queue!r}" + ("" if expires is None else f", expires={expires!r}")
    code = f"import workerapp\nprint(workerapp.sync.apply_async(({who!r}, 0), {options}).id)\n"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=HERE,
        timeout=60,
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _waiting(broker: str, queue: str) -> int:
    """The messages ready in ``queue`` on RabbitMQ."""
    from kombu import Connection

    with Connection(broker, connect_timeout=5) as connection:
        return int(connection.default_channel.queue_declare(queue, passive=True).message_count)


def _reachable(broker: str) -> None:
    """Skip, visibly, without RabbitMQ (a failure under DLOCK_REQUIRE_ALL=1: .ci/run starts it)."""
    from kombu import Connection

    try:
        with Connection(broker, connect_timeout=3) as connection:
            connection.ensure_connection(max_retries=1)
    except Exception as exc:  # whatever stops us reaching it
        unavailable(f"RabbitMQ is not reachable at {broker} ({exc})")


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_message_that_expired_before_a_worker_took_it_lets_the_next_call_send(
    tmp_path: Any, redis_url: str, lock_url: str, broker: str
) -> None:
    """No worker reads the queue while the message expires. RabbitMQ drops it (per-message
    TTL): no worker ever sees it, so none releases its mark; on Redis, a worker would
    discard it only when it reaches it. The mark ends with the message's expiry (plus
    ``EXPIRY_GRACE``), and the next call sends (the mark blocked the key for
    ``dedupe_ttl``, an hour, coalescing every call into a message that never runs)."""
    url = RABBITMQ if broker == "rabbitmq" else f"{redis_url}/{BROKER_DB}"
    if broker == "rabbitmq":
        _reachable(url)
    queue = f"nowhere-{uuid.uuid4().hex[:8]}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DLOCK_TEST_")},
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "DLOCK_TEST_BROKER": url,
        "DLOCK_TEST_RESULTS": f"{redis_url}/{RESULTS_DB}",
        "DLOCK_TEST_LOCKS": lock_url,
        "DLOCK_TEST_LEDGER": str(tmp_path / "ledger"),
    }
    store = backend_from_url(lock_url)
    who = customer()
    key = mark_of("w.sync", f"sync:{who}")
    try:
        first = _produce(env, who, queue, expires=8.0)
        mark = store.get(key)
        assert mark is not None and mark.holder.task_id == first
        assert mark.expires_at is not None
        assert mark.expires_at - mark.acquired_at < 8.0 + EXPIRY_GRACE + 10  # not an hour
        assert _produce(env, who, queue) == first  # before the expiry: a duplicate
        time.sleep(max(0.0, mark.expires_at - time.time()) + 0.3)
        if broker == "rabbitmq":  # dropped by the broker itself
            eventually(lambda: _waiting(url, queue) == 0, "RabbitMQ dropped the message")
        sent = _produce(env, who, queue)
        assert sent not in ("", first)
        [record] = [r for r in store.history(key=key) if r.lease.token == mark.token]
        assert record.outcome is Outcome.EXPIRED
    finally:
        store.close()
        if broker == "rabbitmq":
            from kombu import Connection

            with Connection(url, connect_timeout=5) as connection:
                connection.default_channel.queue_delete(queue)


def test_a_message_taken_before_its_expiry_keeps_its_until_finished_mark_while_it_runs(
    worker: Worker,
) -> None:
    """Bounded by ``expires`` while queued, the mark is lengthened to ``dedupe_ttl`` when a
    worker takes the message: it can no longer expire, and its body may run long."""
    who = customer()
    report = worker.tasks.report
    running = report.apply_async((who, 3.0), expires=30)
    started(worker, running.id)
    key = mark_of("w.report", f"report:{who}")
    mark = worker.store.get(key)
    assert mark is not None and mark.expires_at is not None
    assert mark.expires_at - time.time() > 3000  # dlock_dedupe_ttl from the start, not 31 s
    assert report.delay(who, 0).id == running.id
    running.get(timeout=60)
    [record] = marks(worker, key, 1)
    assert record.outcome is Outcome.SUCCEEDED


def test_an_until_finished_body_skipped_for_a_busy_key_records_its_mark_skipped(
    worker: Worker,
) -> None:
    """``on_locked="skip"``: the body never ran, so its mark is recorded ``skipped`` (it was
    ``succeeded, finished on …``, as if the work were done)."""
    who = customer()
    with Lock(worker.store, f"job:report:{who}"):  # the body's key is busy
        result = worker.tasks.report_or_skip.delay(who)
        assert result.get(timeout=60) is None
    [record] = marks(worker, mark_of("w.report_or_skip", f"report:{who}"), 1)
    assert record.outcome is Outcome.SKIPPED, record
    assert record.lease.holder.task_id == result.id
    assert runs(worker, f"job:report:{who}") == []  # no body ran
    ran = worker.tasks.report_or_skip.delay(who)  # a free key: the body runs, succeeded
    ran.get(timeout=60)
    [_, done] = marks(worker, mark_of("w.report_or_skip", f"report:{who}"), 2)
    assert done.outcome is Outcome.SUCCEEDED and done.lease.holder.task_id == ran.id
    assert [event for event, _ in runs(worker, f"job:report:{who}")] == ["start", "end"]
