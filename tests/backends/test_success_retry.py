"""A success that ``once`` must remember is not given up at the first store error: while the
store is unreachable the release is tried again with backoff, and stored once it answers;
past ``success_retry`` it gives up and says so. A real Redis behind a loopback proxy that
refuses every connection for a while, as a store's outage does."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from celery_dlock import BackendError, Holder, Lock, Outcome, Record
from celery_dlock.backends.redis import RedisBackend
from celery_dlock.celery import once
from celery_dlock.releasing import remember_success
from tests.backends.stores.redis import URL, delete_prefix, store_url
from tests.support.countingproxy import CountingProxy
from tests.support.services import redis_client

TASK = "payments.charge"


@pytest.fixture
def proxied() -> Iterator[tuple[CountingProxy, RedisBackend]]:
    redis_client(URL).close()
    prefix = f"retry{time.monotonic_ns()}"
    with CountingProxy("127.0.0.1", 6379) as proxy:
        base = URL.replace("127.0.0.1:6379", f"127.0.0.1:{proxy.port}")
        backend = RedisBackend.from_url(store_url(prefix, base, retries=0))
        try:
            yield proxy, backend
        finally:
            backend.close()
            delete_prefix(URL, prefix)


def test_a_success_is_stored_once_the_store_answers_again(
    proxied: tuple[CountingProxy, RedisBackend], caplog: pytest.LogCaptureFixture
) -> None:
    proxy, backend = proxied
    lock = Lock(backend, "job:order:7", holder=Holder.current(task_name=TASK))
    lease = lock.acquire()
    released: list[Record | None] = []
    proxy.refuse()  # the store goes away while the body runs
    with caplog.at_level(logging.WARNING, logger="celery_dlock"):
        releasing = threading.Thread(
            target=lambda: released.append(lock.release(result={"value": "ch_7"}))
        )
        releasing.start()
        time.sleep(1.0)  # a few attempts fail meanwhile
        proxy.accept()
        releasing.join(timeout=30)
    assert not releasing.is_alive()
    [record] = released
    assert record is not None and record.outcome is Outcome.SUCCEEDED
    assert record.lease.token == lease.token
    kept = backend.last_success("job:order:7", TASK)
    assert kept is not None and kept.lease.token == lease.token
    assert kept.result == {"value": "ch_7"}
    assert backend.get("job:order:7") is None
    said = [r.getMessage() for r in caplog.records]
    assert any("could not store the success of job:order:7" in m for m in said), said
    assert any(m.startswith("stored the success of job:order:7") for m in said), said


def test_past_success_retry_the_release_gives_up_and_says_so(
    proxied: tuple[CountingProxy, RedisBackend], caplog: pytest.LogCaptureFixture
) -> None:
    proxy, backend = proxied
    lock = Lock(backend, "job:order:8", holder=Holder.current(task_name=TASK))
    lease = lock.acquire()
    # Attempts at 0, 0.25 and 0.75 s (pauses 0.25, 0.5, then 1 s: past the budget, so it gives
    # up there); the second attempt has until 1 s to start (0.8 left a loaded machine 50 ms).
    lock.success_retry = 1.5
    proxy.refuse()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="celery_dlock"), pytest.raises(BackendError):
        lock.release(result={"value": "ch_8"})
    assert time.monotonic() - started >= 0.5  # tried again, not given up at once
    failed = [r for r in caplog.records if "could not store the success" in r.getMessage()]
    assert len(failed) >= 2
    [gave_up] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "gave up storing the success of job:order:8" in gave_up.getMessage()
    assert "once may run this task again" in gave_up.getMessage()
    proxy.accept()
    assert backend.last_success("job:order:8", TASK) is None
    current = backend.get("job:order:8")  # the lease stays for its ttl or the janitor
    assert current is not None and current.token == lease.token


def test_a_success_kept_apart_from_its_release_waits_for_the_store_too(
    proxied: tuple[CountingProxy, RedisBackend],
) -> None:
    """``remember_success`` (a replacement's own success, kept before its release): tried
    again while the store is away, kept once it answers."""
    proxy, backend = proxied
    lock = Lock(backend, "job:order:9", holder=Holder.current(task_name=TASK))
    lease = lock.acquire()
    step = f"{TASK} (replacement 1)"
    record = Record(lease.for_task(step), time.time(), Outcome.SUCCEEDED, None, None, {"value": 9})
    kept: list[bool] = []
    proxy.refuse()
    keeping = threading.Thread(target=lambda: kept.append(remember_success(backend, record, 30)))
    keeping.start()
    time.sleep(1.0)
    assert kept == []  # still trying
    proxy.accept()
    keeping.join(timeout=30)
    assert kept == [True]
    stored = backend.last_success("job:order:9", step)
    assert stored is not None and stored.lease.token == lease.token
    assert stored.result == {"value": 9}
    assert backend.last_success("job:order:9", TASK) is None  # the task's own name: not kept
    lock.release()


def test_a_replacement_whose_success_cannot_be_kept_says_so_and_goes_on_to_its_release(
    proxied: tuple[CountingProxy, RedisBackend], caplog: pytest.LogCaptureFixture
) -> None:
    proxy, backend = proxied
    lock = Lock(backend, "job:order:10", holder=Holder.current(task_name=TASK))
    lock.acquire()
    lock.success_retry = 0.5
    request = SimpleNamespace(dlock_step=f"{TASK} (replacement 2)")
    proxy.refuse()
    with caplog.at_level(logging.ERROR, logger="celery_dlock"):
        once.keep_step(request, lock, {"value": 10})  # does not raise
    said = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith(f"the success of job:order:10 is not kept as '{TASK} (replacement 2)'")
        for m in said
    ), said
    proxy.accept()
    assert backend.last_success("job:order:10", f"{TASK} (replacement 2)") is None
    assert lock.lease is not None  # the release is the caller's, next
    lock.release()
