"""``once`` on the object stores: the first success kept wins when a ``remember`` (the
success of a lost lease) races a release's success, or another ``remember``; and what a
release of a task's first success on a key costs in requests.

Each race is made exact by a loopback proxy in front of the real server (moto, SeaweedFS,
fake-gcs-server): it holds the first write of one client until the other client, going
straight to the server, has kept its success. Before, the release had listed ``success/``
(empty) and then swapped its own success into the lock object over the one kept meanwhile,
and two ``remember`` calls each created an object of their own fence: both were told
"kept", and ``last_success`` answered with the later one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import pytest

from celery_dlock import Lock, Outcome, Record
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.objectstore import ObjectStoreBackend
from tests.backends.test_contract import REAL_TTL, holder
from tests.backends.test_contract_success import TASK, success_of
from tests.support import eventually
from tests.support.objectstore_servers import (  # noqa: F401 - fixtures
    Fault,
    HTTPProxy,
    Logged,
    Server,
    any_object_server,
    unique_prefix,
)


@pytest.fixture
def server_and_proxy(any_object_server: Server) -> Iterator[tuple[Server, HTTPProxy]]:  # noqa: F811
    """Every object-store server in turn, with a proxy in front of it."""
    with HTTPProxy(any_object_server.endpoint) as proxy:
        yield any_object_server, proxy


def backend_at(url: str) -> ObjectStoreBackend:
    backend = backend_from_url(url)
    assert isinstance(backend, ObjectStoreBackend)
    return backend


def is_write(request: Logged) -> bool:
    """An S3 PUT or a GCS upload (of any object)."""
    return request.method == "PUT" or (request.method == "POST" and "/upload/" in request.path)


def is_listing(request: Logged) -> bool:
    """An S3 ListObjectsV2 or a GCS objects.list (both carry a ``prefix`` parameter)."""
    return request.method == "GET" and "prefix" in parse_qs(urlsplit(request.path).query)


def requests_per_release(
    backend: ObjectStoreBackend, proxy: HTTPProxy, key: str, results: list[str]
) -> list[int]:
    """Take ``key`` and release it with a success of each of ``results`` in turn: how many
    requests each release made through ``proxy`` (none of them a listing)."""
    counts = []
    for result in results:
        lease = backend.try_acquire(key, holder(TASK), None)
        assert lease is not None
        start = proxy.count()
        assert backend.release(lease, Outcome.SUCCEEDED, result=result) is not None
        made = proxy.since(start)
        assert not [r.path for r in made if is_listing(r)]
        counts.append(len(made))
    return counts


def assert_kept(url: str, key: str, token: str, result: object) -> None:
    """A new client (no state of its own) finds the success of ``token`` kept."""
    fresh = backend_at(url)
    kept = fresh.last_success(key, TASK)
    assert kept is not None and kept.lease.token == token and kept.result == result
    fresh.close()


def test_a_success_remembered_while_a_release_was_under_way_stays_the_first(
    server_and_proxy: tuple[Server, HTTPProxy],
) -> None:
    """A's lease expired and B took the key. B releases with a success; before its first
    write reaches the server, A's body ends normally: its release finds the lease lost and
    keeps its success (``remember``, told it is kept). B's success must not replace it."""
    server, proxy = server_and_proxy
    prefix = unique_prefix()
    direct, through = backend_at(server.url(prefix)), backend_at(server.url(prefix, proxy.endpoint))
    mine = Lock(direct, "job:raced", REAL_TTL, holder=holder(TASK), renew=False)
    first = mine.acquire()
    assert first.expires_at is not None
    time.sleep(max(0.0, first.expires_at - time.time()) + 0.3)
    taken = eventually(
        lambda: through.try_acquire("job:raced", holder(TASK), None), "B takes the key", 10
    )
    lost: list[Record | None] = []
    fault = proxy.add(
        Fault(match=is_write, before=lambda: lost.append(mine.release(Outcome.SUCCEEDED, result=1)))
    )

    second = through.release(taken, Outcome.SUCCEEDED, result=2)

    assert len(fault.hits) == 1 and lost == [None]  # A's release ran in between: lease lost
    [lost_record] = direct.history(key="job:raced", outcome=Outcome.LOST)
    assert lost_record.details is not None and "its success is kept for once" in lost_record.details
    for client in (direct, through):
        kept = client.last_success("job:raced", TASK)
        assert kept is not None and kept.lease.token == first.token and kept.result == 1
    assert_kept(server.url(prefix), "job:raced", first.token, 1)
    assert second is not None and second.outcome is Outcome.SUCCEEDED and second.result == 2
    [recorded] = direct.history(key="job:raced", outcome=Outcome.SUCCEEDED)
    assert recorded.lease.token == taken.token  # B's success is in the history all the same
    direct.close()
    through.close()


def test_of_two_racing_remembers_one_is_kept_and_told_so(
    server_and_proxy: tuple[Server, HTTPProxy],
) -> None:
    server, proxy = server_and_proxy
    prefix = unique_prefix()
    direct, through = backend_at(server.url(prefix)), backend_at(server.url(prefix, proxy.endpoint))
    one = success_of(direct, "job:twice", "one")
    other = success_of(direct, "job:twice", "other")
    answers: list[bool] = []
    proxy.add(Fault(match=is_write, before=lambda: answers.append(direct.remember(other))))

    answers.append(through.remember(one))

    assert answers == [True, False]  # ``other`` reached the server first
    assert_kept(server.url(prefix), "job:twice", other.lease.token, "other")
    direct.close()
    through.close()


def test_a_first_success_release_makes_no_listing(
    server_and_proxy: tuple[Server, HTTPProxy],
) -> None:
    """The release of a task's first success on a key: create its ``success/`` object,
    swap the lock object, create the history object: three requests, no listing (there
    were four: a listing of ``success/`` first). A repeat makes two."""
    server, proxy = server_and_proxy
    backend = backend_at(server.url(unique_prefix(), proxy.endpoint))
    assert requests_per_release(backend, proxy, "job:counted", ["first", "again"]) == [3, 2]
    kept = backend.last_success("job:counted", TASK)
    assert kept is not None and kept.result == "first"
    backend.close()


def test_a_success_kept_apart_costs_one_release_a_create_and_a_read_then_nothing(
    server_and_proxy: tuple[Server, HTTPProxy],
) -> None:
    """After a ``remember`` (kept under ``success/`` only), the next success release finds
    it (its create refused, one read) and puts it in the lock object, so later releases
    make no request for it (before, each listed ``success/`` and read it: two more)."""
    server, proxy = server_and_proxy
    backend = backend_at(server.url(unique_prefix(), proxy.endpoint))
    remembered = success_of(backend, "job:apart", "remembered")
    assert backend.remember(remembered) is True
    assert requests_per_release(backend, proxy, "job:apart", ["later", "later still"]) == [4, 2]
    kept = backend.last_success("job:apart", TASK)
    assert kept is not None and kept.lease.token == remembered.lease.token
    backend.close()
