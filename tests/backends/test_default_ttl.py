"""A ``Lock`` given no ttl on a store whose leases live by their ttl alone (Redis, S3, GCS,
Postgres ``liveness=ttl``): it gets the store's ``ttl`` option and is renewed, so a holder
killed without a release frees its key when that ttl runs out. Found by trying the package
as a new user: on Redis, S3 and GCS such a lease never expired, and a killed holder's key
stayed held for good, with nothing to reap it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from celery_dlock import Lock, Outcome, backend_from_url
from celery_dlock.errors import ConfigurationError
from tests.backends.storecase import StoreCase
from tests.support import eventually
from tests.support.services import with_options

#: Takes ``sys.argv[2]`` with a ``Lock`` given no ttl, says so, and is SIGKILLed.
_KILLED_HOLDER = """
import os, signal, sys
from celery_dlock import Lock
lock = Lock(sys.argv[1], sys.argv[2])
lease = lock.acquire()
print(lease.fence, lease.expires_at is not None, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def lease_store(store: StoreCase) -> str:
    if store.backend.capabilities.liveness != "lease" or store.url is None:
        pytest.skip(f"not applicable: the {store.backend.name} store's leases outlive no holder")
    return store.url


def with_ttl(url: str, ttl: object) -> str:
    """``url`` with its ``ttl`` option (any it had replaced: Postgres ``liveness=ttl``)."""
    base, _, query = url.partition("?")
    kept = [option for option in query.split("&") if option and not option.startswith("ttl=")]
    return with_options(f"{base}?{'&'.join(kept)}" if kept else base, ttl=ttl)


def test_a_lock_without_a_ttl_gets_the_stores_and_is_renewed(store: StoreCase) -> None:
    url = with_ttl(lease_store(store), 1.5)
    backend = backend_from_url(url)
    assert backend.default_ttl == 1.5
    lock = Lock(backend, "job:default-ttl:renewed")
    lease = lock.acquire()
    try:
        assert lease.expires_at is not None and lease.expires_at - lease.acquired_at < 5
        time.sleep(3)  # two ttls: alive only if renewed
        assert not lock.lost
        current = backend.get(lease.key)
        assert current is not None and current.token == lease.token
    finally:
        assert lock.release() is not None
    backend.close()


def test_a_killed_holder_of_a_lock_without_a_ttl_frees_its_key(store: StoreCase) -> None:
    url = with_ttl(lease_store(store), 1)
    key = "job:default-ttl:killed"
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_HOLDER, url, key],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    fence, expires = done.stdout.split()
    assert expires == "True", done.stderr
    backend = backend_from_url(url)
    lock = Lock(backend, key)
    taken = eventually(lock.attempt, "the dead holder's key is free")
    assert taken.fence > int(fence)
    dead = [r for r in backend.history(key=key, limit=None) if r.fence == int(fence)]
    assert [r.outcome for r in dead] == [Outcome.EXPIRED]
    assert lock.release() is not None
    backend.close()


@pytest.mark.parametrize("ttl", ["0", "-1", "nan"])
def test_a_bad_ttl_option_is_refused_naming_it(store: StoreCase, ttl: str) -> None:
    url = lease_store(store)
    with pytest.raises(ConfigurationError, match="ttl"):
        backend_from_url(with_ttl(url, ttl))
