"""What a store module in ``tests/backends/stores/`` hands the contract suite."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from celery_dlock.backends.base import LockBackend
from celery_dlock.testing import FakeClock


@dataclass
class StoreCase:
    """One store under test.

    Attributes:
        backend: the backend the tests drive.
        url: a URL that reaches the same store from another process, or None where the
            store lives in one process (memory).
        clock: the clock the backend judges expiry by, when the test may move it; None
            where expiry is judged by the server's own clock.
        second: makes another client of the same store in this process (its own
            connections), for tests of two holders.
    """

    backend: LockBackend
    url: str | None
    clock: FakeClock | None
    second: Callable[[], LockBackend]
