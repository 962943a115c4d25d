"""Object-store backends under faults, through a loopback HTTP proxy in front of the real
server: answers lost after the server acted (the client library retries and gets 412 for
its own write), connections reset with no retry, S3's 409 ConditionalRequestConflict, a
local clock stepped mid-request; and what goes on the wire (every lock-object write and
delete carries a precondition; ``wait`` only reads)."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from celery_dlock import BackendError, Holder, Lease, Outcome
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.objectstore import ObjectStoreBackend
from tests.backends.test_objectstore import workload
from tests.support import eventually
from tests.support.objectstore_servers import (  # noqa: F401 - fixtures
    Fault,
    HTTPProxy,
    Logged,
    Server,
    object_server,
    proxy,
    unique_prefix,
)


def holder() -> Holder:
    return Holder.current()


def _path(request: Logged) -> str:
    return unquote(urlsplit(request.path).path)


def _query(request: Logged) -> dict[str, list[str]]:
    return parse_qs(urlsplit(request.path).query)


def _header(request: Logged, name: str) -> str | None:
    for key, value in request.headers.items():
        if key.lower() == name.lower():
            return value
    return None


def is_lock_write(request: Logged) -> bool:
    """A PUT (S3) or an upload (GCS) of a lock object."""
    if request.method == "PUT":
        return "/locks/" in _path(request)
    return request.method == "POST" and "/upload/" in request.path and b"/locks/" in request.body


def is_lock_delete(request: Logged) -> bool:
    return request.method == "DELETE" and "/locks/" in _path(request)


def carries_precondition(request: Logged) -> bool:
    if "ifGenerationMatch" in _query(request):  # GCS uploads and deletes
        return True
    if request.method == "PUT" and (
        _header(request, "If-None-Match") == "*" or _header(request, "If-Match")
    ):
        return True
    return request.method == "DELETE" and bool(_header(request, "If-Match"))


def through(
    server: Server,
    proxy: HTTPProxy,  # noqa: F811
    prefix: str,
    options: str = "",
    **kwargs: Any,
) -> ObjectStoreBackend:
    """A backend on ``server`` whose requests go through ``proxy``."""
    backend = backend_from_url(server.url(prefix, proxy.endpoint) + options, **kwargs)
    assert isinstance(backend, ObjectStoreBackend)
    return backend


# -- answers lost after the server acted ------------------------------------------------------


@pytest.mark.parametrize("write", ["create", "swap", "release"])
def test_a_write_whose_answer_was_lost_is_settled_by_reading_back(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
    write: str,
) -> None:
    prefix = unique_prefix()
    backend = through(object_server, proxy, prefix)
    direct = backend_from_url(object_server.url(prefix))
    if write != "create":  # the key exists and is free: acquiring it is a swap
        first = backend.try_acquire("job:lost", holder(), None)
        assert first is not None and backend.release(first, Outcome.SUCCEEDED) is not None
    lease = None
    if write == "release":
        lease = backend.try_acquire("job:lost", holder(), None)
        assert lease is not None
    fault = proxy.add(Fault(match=is_lock_write, drop=True))
    start = proxy.count()

    if write == "release":
        assert lease is not None
        record = backend.release(lease, Outcome.SUCCEEDED)
        assert record is not None and record.lease.token == lease.token
        assert direct.get("job:lost") is None
    else:
        lease = backend.try_acquire("job:lost", holder(), None)
        assert lease is not None
        held = direct.get("job:lost")
        assert held == lease

    assert len(fault.hits) == 1
    writes = [r.status for r in proxy.since(start) if is_lock_write(r)]
    # Ours landed (its answer was dropped); the library's retry of it was refused.
    assert writes == [200, 412], writes


@pytest.mark.parametrize("meanwhile", ["taken", "taken and released"])
def test_a_release_whose_answer_was_lost_while_the_key_changed_hands_returns_its_record(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
    meanwhile: str,
) -> None:
    # The release lands, its answer is lost, and before the client library's retry (which
    # gets 412) another holder takes the key (and releases it: the first record then moves
    # from the lock object to history/). The release still returns its record, so Lock
    # never records the lease 'lost' beside its 'succeeded'.
    prefix = unique_prefix()
    backend = through(object_server, proxy, prefix)
    direct = backend_from_url(object_server.url(prefix))
    lease = backend.try_acquire("job:handed", holder(), None)
    assert lease is not None
    others: list[Lease] = []

    def next_holder() -> None:
        other = direct.try_acquire("job:handed", holder(), None)
        assert other is not None
        if meanwhile == "taken and released":
            assert direct.release(other, Outcome.SUCCEEDED) is not None
        others.append(other)

    proxy.add(Fault(match=is_lock_write, drop=True))
    proxy.add(Fault(match=is_lock_write, before=next_holder))
    record = backend.release(lease, Outcome.SUCCEEDED)
    assert len(others) == 1  # the retry came after the other holder's turn
    assert record is not None and record.lease.token == lease.token
    assert record.outcome is Outcome.SUCCEEDED
    found = [(r.lease.token, r.outcome) for r in direct.history(key="job:handed")]
    assert (lease.token, Outcome.SUCCEEDED) in found
    assert [token for token, _ in found].count(lease.token) == 1
    assert backend.release(lease, Outcome.SUCCEEDED) is None  # a second call is not a retry


def test_a_reset_write_with_no_retry_is_settled_by_reading_back(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
) -> None:
    if object_server.kind == "fake-gcs":
        pytest.skip("not applicable: google-cloud-storage always retries (see the test above)")
    prefix = unique_prefix()
    backend = through(object_server, proxy, prefix, "&max_attempts=1")
    landed = proxy.add(Fault(match=is_lock_write, drop=True))
    lease = backend.try_acquire("job:reset", holder(), None)
    assert lease is not None and len(landed.hits) == 1
    held = backend_from_url(object_server.url(prefix)).get("job:reset")
    assert held is not None and held.token == lease.token

    assert backend.release(lease, Outcome.SUCCEEDED) is not None
    lost = proxy.add(Fault(match=is_lock_write, drop=True, forward=False))
    with pytest.raises(BackendError, match="may still take effect"):
        backend.try_acquire("job:reset", holder(), None)
    assert len(lost.hits) == 1
    assert backend_from_url(object_server.url(prefix)).get("job:reset") is None


def test_a_release_that_landed_unconfirmed_returns_its_record_when_tried_again(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
) -> None:
    if object_server.kind == "fake-gcs":
        pytest.skip("not applicable: google-cloud-storage always retries (see the test above)")
    # The release's swap lands, its answer is lost and so is the read that would settle it:
    # the release raises (it may still take effect). Tried again, as Lock does for a
    # success, it finds its own record in the lock object instead of reporting it lost.
    prefix = unique_prefix()
    backend = through(object_server, proxy, prefix, "&max_attempts=1")
    lease = backend.try_acquire("job:unconfirmed", holder(), None)
    assert lease is not None
    landed = proxy.add(Fault(match=is_lock_write, drop=True))
    unread = proxy.add(
        Fault(match=lambda r: r.method == "GET" and "/locks/" in _path(r), drop=True, forward=False)
    )
    with pytest.raises(BackendError):
        backend.release(lease, Outcome.SUCCEEDED)
    assert (len(landed.hits), len(unread.hits)) == (1, 1)
    direct = backend_from_url(object_server.url(prefix))
    assert direct.get("job:unconfirmed") is None  # it landed
    record = backend.release(lease, Outcome.SUCCEEDED)
    assert record is not None and record.lease.token == lease.token
    assert [(r.lease.token, r.outcome) for r in direct.history(key="job:unconfirmed")] == [
        (lease.token, Outcome.SUCCEEDED)
    ]


CONFLICT = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ConditionalRequestConflict</Code>'
    b"<Message>A conflicting conditional operation is in progress.</Message></Error>"
)


def test_s3_conditional_request_conflict_409_is_retried(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
) -> None:
    if object_server.kind == "fake-gcs":
        pytest.skip("not applicable: 409 ConditionalRequestConflict is S3's")
    # No local server answers 409 (AWS does under contention): the proxy answers it once,
    # without forwarding, for the adapter to retry.
    prefix = unique_prefix()
    backend = through(object_server, proxy, prefix)
    fault = proxy.add(Fault(match=is_lock_write, status=409, body=CONFLICT))
    start = proxy.count()
    lease = backend.try_acquire("job:conflict", holder(), None)
    assert lease is not None and len(fault.hits) == 1
    assert [r.status for r in proxy.since(start) if is_lock_write(r)] == [409, 200]
    held = backend_from_url(object_server.url(prefix)).get("job:conflict")
    assert held is not None and held.token == lease.token


# -- what goes on the wire --------------------------------------------------------------------


def test_every_lock_object_write_and_delete_on_the_wire_carries_a_precondition(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
) -> None:
    backend = through(object_server, proxy, unique_prefix(), "&gc_after=0")
    workload(backend)
    writes = [r for r in proxy.log if is_lock_write(r) or is_lock_delete(r)]
    assert any(is_lock_delete(r) for r in writes)  # garbage collection happened
    assert len(writes) > 10
    unconditional = [(r.method, r.path) for r in writes if not carries_precondition(r)]
    assert unconditional == []


def test_wait_only_reads_and_backs_off(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
) -> None:
    prefix = unique_prefix()
    holding = backend_from_url(object_server.url(prefix))
    assert holding.try_acquire("job:waited", holder(), None) is not None
    waiter = through(object_server, proxy, prefix)
    waiter.get("job:waited")
    start = proxy.count()
    waiter.wait("job:waited", 2.0)  # held throughout: returns at its timeout
    requests = proxy.since(start)
    assert {r.method for r in requests} == {"GET"}
    # Pauses of 50 ms doubling to 1 s: about 6 reads in 2 s, never a busy loop.
    assert 3 <= len(requests) <= 10, len(requests)


# -- the local clock steps ---------------------------------------------------------------------


class SteppedClock:
    """A local clock a test can step, by ``offset`` seconds."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def step(self, seconds: float) -> None:
        self.offset += seconds


@pytest.mark.parametrize("step", [3600.0, -3600.0])
def test_a_clock_stepped_mid_request_neither_steals_nor_keeps_a_lease(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
    step: float,
) -> None:
    prefix = unique_prefix()
    steady = backend_from_url(object_server.url(prefix))
    clock = SteppedClock()
    stepped = through(object_server, proxy, prefix, clock=clock)
    live = steady.try_acquire("job:live", holder(), 30)
    assert live is not None
    assert stepped.get("job:live") is not None  # stepped learns the server's clock

    def reads_live(request: Logged) -> bool:
        return request.method == "GET" and "job:live" in _path(request)

    fault = proxy.add(Fault(match=reads_live, before=lambda: clock.step(step)))
    assert stepped.try_acquire("job:live", holder(), None) is None
    assert len(fault.hits) == 1
    assert stepped.reap() == []
    held = steady.get("job:live")
    assert held is not None and held.token == live.token

    # A lease of the stepped client ends by the server's clock, not by the stepped one.
    mine = stepped.try_acquire("job:mine", holder(), 1.0)
    assert mine is not None and mine.expires_at is not None
    assert abs(mine.expires_at - (time.time() + 1.0)) < 3.0
    taken = eventually(lambda: steady.try_acquire("job:mine", holder(), 60), "takeover")
    assert stepped.renew(mine, 60) is None
    assert stepped.release(mine, Outcome.SUCCEEDED) is None
    current = steady.get("job:mine")
    assert current is not None and current.token == taken.token
