"""Support shared by the test modules: how a test says a real server is missing, and how it
waits for a condition that something real decides."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import pytest

from celery_dlock.backends.base import LockBackend
from celery_dlock.records import Outcome, Record

REQUIRE_ALL = os.environ.get("DLOCK_REQUIRE_ALL") == "1"
T = TypeVar("T")


def unavailable(what: str) -> NoReturn:
    """Skip for a missing server or package, visibly; fail under ``DLOCK_REQUIRE_ALL=1``."""
    if REQUIRE_ALL:
        pytest.fail(f"{what} (DLOCK_REQUIRE_ALL=1 turns this skip into a failure)")
    pytest.skip(what)


def eventually(attempt: Callable[[], T | None], what: str, timeout: float = 30.0) -> T:
    """Call ``attempt`` until it returns something truthy, and return that.

    For conditions a real server, process or clock decides (an expiry, a worker's event):
    polls every 20 ms, and fails naming ``what`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = attempt()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def force_release(backend: LockBackend, key: str, reason: str) -> Record | None:
    """Release whatever lease is on ``key`` now, recorded ``forced`` with ``reason``, as
    ``celery dlock release --force`` does: read the lease, release it by its token."""
    lease = backend.get(key)
    return None if lease is None else backend.release(lease, Outcome.FORCED, "forced", reason)
