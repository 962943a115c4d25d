"""The file store in its portable mode (what macOS and the BSDs get: no /proc, inotify or
pidfd), run on Linux with those forced off (``CELERY_DLOCK_PORTABLE=1``, inherited by the
holder processes the tests start): holders identified through psutil, waits poll."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_dlock import identity
from celery_dlock.backends.file import FileBackend
from celery_dlock.records import Holder
from celery_dlock.testing import FakeClock
from tests.backends.storecase import StoreCase

NAME = "file-portable"
UNREACHABLE = "file:///proc/dlock-cannot-be-made?portable=1"


@contextmanager
def open_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    pytest.importorskip("psutil", reason="the portable file store needs psutil")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("CELERY_DLOCK_PORTABLE", "1")
    identity.identity.cache_clear()
    # This host's id in portable mode has its boot time in it (the wall clock less the
    # uptime): read again now, not kept from an earlier test of this process, so that a
    # step of the VM's wall clock since then does not set it apart from the holders this
    # test starts (they would read as another host's: never gone).
    identity._portable_host_id.cache_clear()
    assert Holder.current().host_id.startswith(identity.PORTABLE)
    clock = FakeClock()
    directory = tmp_path / "locks"
    backend = FileBackend(str(directory), clock=clock, portable=True)
    assert backend.portable
    try:
        yield StoreCase(
            backend=backend,
            url=f"file://{directory}?portable=1",
            clock=clock,
            second=lambda: FileBackend(str(directory), clock=clock, portable=True),
        )
    finally:
        monkeypatch.undo()
        identity.identity.cache_clear()
