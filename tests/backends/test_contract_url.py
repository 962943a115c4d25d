"""Checks every store passes that need no server: ``from_url`` parses without I/O (a Celery
app imports its lock store before any server is up, and forks after), a store that cannot be
reached fails at its first use with a ``BackendError`` that keeps the driver's error, and a
password in the URL shows nowhere."""

from __future__ import annotations

import pytest

from celery_dlock import BackendError, ConfigurationError
from celery_dlock.backends import backend_from_url
from tests.backends.conftest import STORES

SECRET = "s3cret"


@pytest.mark.parametrize("name", sorted(STORES))
def test_from_url_does_no_io_and_first_use_fails_naming_the_store(name: str) -> None:
    url = STORES[name].UNREACHABLE
    if url is None:
        pytest.skip(f"not applicable: the {name} store has no URL of its own to reach")
    if url.startswith("file:"):  # a local directory is made at once, not at first use
        with pytest.raises(ConfigurationError, match="cannot create lock directory /proc/"):
            backend_from_url(url)
        return
    backend = backend_from_url(url)  # nothing listens there: any I/O here would fail
    try:
        if SECRET in url:
            assert SECRET not in backend.url and "***" in backend.url
            assert SECRET not in repr(backend)
        with pytest.raises(BackendError) as raised:
            backend.get("job:x")
    finally:
        backend.close()
    assert raised.value.__cause__ is not None, "the driver's error is kept as the cause"
    message = str(raised.value)
    assert backend.name.lower() in message.lower() and "failed" in message  # says what failed
    assert SECRET not in str(raised.value)
