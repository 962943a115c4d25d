"""S3 and GCS under slow answers: a write whose answer comes back after the lease it
writes has expired (a slow network, or the client library's retries) grants nothing.
Its caller is told so (no lease, or a lost one), the key is free for a taker at once, and
the history has the lease that expired."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_dlock import Holder, Outcome
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.objectstore import ObjectStoreBackend
from tests.backends.test_objectstore_faults import is_lock_write
from tests.support.objectstore_servers import (  # noqa: F401 - fixtures
    Fault,
    HTTPProxy,
    Server,
    object_server,
    proxy,
    unique_prefix,
)

TTL = 1.0
#: The pause of the slow request: past the ttl and the server clock's window (≤ 1 s of a
#: ``Date``'s resolution plus the round trip), so the answer comes after the expiry.
PAUSE = TTL + 3.0


@pytest.fixture
def pair(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
) -> Iterator[tuple[ObjectStoreBackend, ObjectStoreBackend]]:
    """The holder's client (through the proxy) and a taker's (straight to the server)."""
    prefix = unique_prefix()
    slow = backend_from_url(object_server.url(prefix, proxy.endpoint))
    taker = backend_from_url(object_server.url(prefix))
    assert isinstance(slow, ObjectStoreBackend) and isinstance(taker, ObjectStoreBackend)
    yield slow, taker
    slow.close()
    taker.close()


def slow_down_next_lock_write(proxy: HTTPProxy) -> Fault:  # noqa: F811
    return proxy.add(Fault(is_lock_write, before=lambda: time.sleep(PAUSE)))


def test_a_renewal_answered_after_its_expiry_is_a_lost_lease_not_a_renewed_one(
    pair: tuple[ObjectStoreBackend, ObjectStoreBackend],
    proxy: HTTPProxy,  # noqa: F811
) -> None:
    slow, taker = pair
    key = "job:slow-renew"
    lease = slow.try_acquire(key, Holder.current(), 30.0)
    assert lease is not None
    fault = slow_down_next_lock_write(proxy)
    renewed = slow.renew(lease, TTL)
    assert fault.hits  # the renewal's write was the slow one
    # Told lost, as a taker may already hold the key...
    assert renewed is None
    # ...which one can, at once: the lease that expired is recorded expired.
    taken = taker.try_acquire(key, Holder.current(), 30.0)
    assert taken is not None and taken.fence > lease.fence
    expired = taker.history(key=key, outcome=Outcome.EXPIRED)
    assert [record.lease.token for record in expired] == [lease.token]


def test_an_acquisition_answered_after_its_expiry_grants_nothing(
    pair: tuple[ObjectStoreBackend, ObjectStoreBackend],
    proxy: HTTPProxy,  # noqa: F811
) -> None:
    slow, taker = pair
    key = "job:slow-acquire"
    fault = slow_down_next_lock_write(proxy)
    lease = slow.try_acquire(key, Holder.current(), TTL)
    assert fault.hits
    assert lease is None
    taken = taker.try_acquire(key, Holder.current(), 30.0)
    assert taken is not None
    assert taker.get(key) == taken
    expired = taker.history(key=key, outcome=Outcome.EXPIRED)
    assert len(expired) == 1 and expired[0].lease.fence < taken.fence
