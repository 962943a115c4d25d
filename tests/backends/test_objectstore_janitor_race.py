"""The janitor racing a holder on S3 and GCS: a lease whose renewal lands between the
janitor's read (which found it expired) and the janitor's swap is alive again, and the
janitor must judge it anew instead of freeing it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from celery_dlock import Holder, Outcome
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.objectstore import ObjectStoreBackend, Written
from celery_dlock.backends.objectstore.clock import verdict
from celery_dlock.backends.objectstore.layout import us
from tests.support import eventually
from tests.support.objectstore_servers import (  # noqa: F401 - fixtures
    Recording,
    object_server,
    object_url,
)


@pytest.fixture
def pair(object_url: str) -> Iterator[tuple[ObjectStoreBackend, ObjectStoreBackend]]:  # noqa: F811
    """Two clients of one prefix: the holder's and the janitor's."""
    made = [backend_from_url(object_url), backend_from_url(object_url)]
    yield made[0], made[1]  # type: ignore[misc]
    for backend in made:
        backend.close()


class RenewalLandsFirst(Recording):
    """The janitor's store: before its first swap of ``name``, the holder's renewal (sent
    before the lease expired, delayed on the way) lands."""

    def __init__(self, janitor: ObjectStoreBackend, renew: object, name: str) -> None:
        super().__init__(janitor.store())
        self.renew = renew
        self.name = name
        self.fired = False

    def swap(self, name: str, body: bytes, version: str) -> Written:
        if name == self.name and not self.fired:
            self.fired = True
            self.renew()  # type: ignore[operator]
        return super().swap(name, body, version)


def test_reap_never_frees_a_lease_renewed_after_it_read_it_expired(
    pair: tuple[ObjectStoreBackend, ObjectStoreBackend],
) -> None:
    holder_backend, janitor = pair
    key = "job:janitor-race"
    name = janitor.layout.lock(key)
    lease = holder_backend.try_acquire(key, Holder.current(), 1.0)
    assert lease is not None
    state = holder_backend._ours(lease)
    assert state is not None and state.lease is not None

    def janitor_sees_it_expired() -> bool:
        found = janitor.objects.read(name)
        return verdict(lease, janitor.objects.now(), found.stamp.date) == "expired"

    eventually(janitor_sees_it_expired, "the lease expired by the server's clock")
    renewed: list[object] = []

    def renewal_lands() -> None:
        # What the holder's renew writes: the same token, a later expiry, conditional on
        # the version the janitor read (the renewal was decided before the lease expired).
        later = replace(state.lease, expires_at=us(holder_backend.objects.now().high + 60))
        written, _ = holder_backend.objects.write_state(name, state, state.key, state.fence, later)
        assert written is not None
        renewed.append(written.lease)

    recording = RenewalLandsFirst(janitor, renewal_lands, name)
    janitor.objects.store = lambda: recording  # every read and write goes through it

    assert janitor.reap() == []
    assert recording.fired and renewed
    current = holder_backend.get(key)
    assert current is not None and current.token == lease.token
    assert current == renewed[0]
    assert [r for r in janitor.history(key=key) if r.outcome == Outcome.EXPIRED] == []
    # The holder still holds it: its next renewal succeeds, and a taker is refused.
    assert holder_backend.renew(current, 30.0) is not None
    assert janitor.try_acquire(key, Holder.current(), 30.0) is None
