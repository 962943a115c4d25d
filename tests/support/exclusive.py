"""Tests that must run alone while the others run in parallel (pytest-xdist).

A test marked ``exclusive`` does something to a server every test shares: it restarts the
local PostgreSQL, which cuts every connection to it. It runs while no other test of this
run does, in any worker process; the others run side by side.

A readers-writer lock over two ``flock`` files, preferring the writer: every test passes a
turnstile (``EX``, at once let go) and holds the gate ``SH``; an exclusive test keeps the
turnstile while it takes the gate ``EX``, so no new test starts while it waits for the running
ones to end. The files are per checkout (or at ``DLOCK_TEST_GATE``, a path prefix); without
xdist nothing ever waits. A plugin: ``tests/conftest.py`` loads it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["MARKER", "pytest_runtest_protocol", "running"]

MARKER = "exclusive"
_CHECKOUT = hashlib.sha256(str(Path(__file__).resolve()).encode()).hexdigest()[:12]
_BASE = os.environ.get("DLOCK_TEST_GATE") or str(
    Path(tempfile.gettempdir()) / f"celery-dlock-tests-{_CHECKOUT}"
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Run a test marked ``exclusive`` alone, the others side by side."""
    with running(item.get_closest_marker(MARKER) is not None):
        return (yield)


@contextlib.contextmanager
def running(exclusive: bool) -> Iterator[None]:
    """Hold the gate for one test: shared, or alone if ``exclusive``."""
    with _opened("turnstile") as turnstile, _opened("gate") as gate:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # closing the files lets go of both locks


@contextlib.contextmanager
def _opened(name: str) -> Iterator[int]:
    fd = os.open(f"{_BASE}.{name}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)
