"""An acquire on S3/GCS whose write landed with its answer lost and its read-back lost too
raises BackendError; its lease, held by no one, is ended by token at this process's next
call that reaches the store (recorded ``disconnected``), not left until its ttl. One that
did not land leaves nothing, and a lease of another token is never ended."""

from __future__ import annotations

import pytest

from celery_dlock import BackendError, Holder, Lease, Outcome
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.objectstore import ObjectStoreBackend
from tests.backends.test_objectstore_faults import _path, is_lock_write, through
from tests.support.objectstore_servers import (  # noqa: F401 - fixtures
    Fault,
    HTTPProxy,
    Logged,
    Server,
    object_server,
    proxy,
    unique_prefix,
)

TTL = 60.0


def holder() -> Holder:
    return Holder.current()


def touches_a_lock(request: Logged) -> bool:
    """A write or a read of a lock object."""
    return is_lock_write(request) or (request.method == "GET" and "/locks/" in _path(request))


def lossy(
    server: Server,
    proxy: HTTPProxy,  # noqa: F811
    prefix: str,
) -> ObjectStoreBackend:
    # S3: no retry of its own. GCS: google-cloud-storage always retries, for at most three
    # times the timeout: a short one keeps the outage short.
    options = "&timeout=0.5" if server.kind == "fake-gcs" else "&max_attempts=1"
    return through(server, proxy, prefix, options)


def acquire_unsettled(
    backend: ObjectStoreBackend,
    proxy: HTTPProxy,  # noqa: F811
    key: str,
    lands: bool,
) -> None:
    """``backend.try_acquire(key)`` whose write lands (or not) without an answer, while
    every later request on a lock object (the library's retries, the read-back) is cut."""
    first = proxy.add(Fault(match=is_lock_write, drop=True, forward=lands))
    cut = proxy.add(
        Fault(
            match=lambda r: bool(first.hits) and touches_a_lock(r),
            drop=True,
            forward=False,
            times=10_000,
        )
    )
    try:
        # A request before the write (GCS's timeout is 0.5 s here) can time out on a loaded
        # machine, which ends the attempt before its write: try again until one writes.
        for _ in range(5):
            with pytest.raises(BackendError):
                backend.try_acquire(key, holder(), TTL)
            if first.hits:
                break
    finally:
        cut.times = 0
    assert len(first.hits) == 1 and len(cut.hits) >= 1


def next_call(backend: ObjectStoreBackend, call: str, mine: Lease) -> None:
    if call == "acquire":
        assert backend.try_acquire("job:next", holder(), TTL) is not None
    elif call == "release":
        assert backend.release(mine, Outcome.SUCCEEDED) is not None
    else:
        renewed = backend.renew(mine, TTL)
        assert renewed is not None and renewed.token == mine.token


@pytest.mark.parametrize("call", ["acquire", "release", "renew"])
def test_a_landed_acquire_whose_answer_was_lost_is_ended_by_the_next_call(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
    call: str,
) -> None:
    prefix = unique_prefix()
    backend = lossy(object_server, proxy, prefix)
    direct = backend_from_url(object_server.url(prefix))
    mine = backend.try_acquire("job:mine", holder(), TTL)
    assert mine is not None
    acquire_unsettled(backend, proxy, "job:orphan", lands=True)
    orphan = direct.get("job:orphan")
    assert orphan is not None  # it landed: held under a token nobody has
    assert direct.try_acquire("job:orphan", holder(), TTL) is None

    next_call(backend, call, mine)

    assert direct.get("job:orphan") is None  # free at once, not after the ttl
    [record] = direct.history(key="job:orphan")
    assert record.lease.token == orphan.token
    assert (record.outcome, record.problem) == (Outcome.DISCONNECTED, "disconnected")
    taken = direct.try_acquire("job:orphan", holder(), TTL)
    assert taken is not None
    assert backend.try_acquire("job:later", holder(), TTL) is not None  # settled once
    held = direct.get("job:orphan")
    assert held is not None and held.token == taken.token
    assert len(direct.history(key="job:orphan")) == 1


@pytest.mark.parametrize("meanwhile", ["nothing", "taken by another"])
def test_an_acquire_that_did_not_land_leaves_nothing_and_ends_no_other_lease(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
    meanwhile: str,
) -> None:
    prefix = unique_prefix()
    backend = lossy(object_server, proxy, prefix)
    direct = backend_from_url(object_server.url(prefix))
    acquire_unsettled(backend, proxy, "job:orphan", lands=False)
    assert direct.get("job:orphan") is None
    other = None
    if meanwhile == "taken by another":
        other = direct.try_acquire("job:orphan", holder(), TTL)
        assert other is not None

    assert backend.try_acquire("job:next", holder(), TTL) is not None

    held = direct.get("job:orphan")
    assert (held and held.token) == (other and other.token)
    assert direct.history(key="job:orphan") == []
