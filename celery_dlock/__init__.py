"""celery-dlock: per-resource distributed locks for Celery tasks.

The public API, and nothing else (a test checks ``__all__`` against this module)::

    from celery_dlock import LockedTask

    @app.task(base=LockedTask, lock_key="order:{order_id}", once=True)
    def charge(order_id, amount): ...

    with celery_dlock.lock("job:report:daily", backend="postgresql://...", ttl=60, wait=5) as lease:
        ...
"""

from __future__ import annotations

from celery_dlock.backends import backend_from_url, mask_url
from celery_dlock.backends.base import Capabilities, LockBackend
from celery_dlock.errors import (
    BackendError,
    ConfigurationError,
    DLockError,
    LockKeyError,
    LockLostError,
    LockNotAcquiredError,
    LockTimeoutError,
    MissingDependencyError,
    UnknownBackendError,
)
from celery_dlock.keys import KeyTemplate, validate_key
from celery_dlock.lock import Lock, lock
from celery_dlock.records import Holder, Lease, Outcome, Record

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "Capabilities",
    "ConfigurationError",
    "DLockError",
    "Holder",
    "KeyTemplate",
    "Lease",
    "Lock",
    "LockBackend",
    "LockKeyError",
    "LockLostError",
    "LockNotAcquiredError",
    "LockTimeoutError",
    "MissingDependencyError",
    "Outcome",
    "Record",
    "UnknownBackendError",
    "__version__",
    "backend_from_url",
    "lock",
    "mask_url",
    "validate_key",
]
