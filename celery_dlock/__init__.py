"""celery-dlock: per-resource distributed locks for Celery tasks.

The public API, and nothing else (a test checks ``__all__`` against this module)::

    from celery_dlock import LockedTask

    @app.task(base=LockedTask, lock_key="order:{order_id}", once=True)
    def charge(order_id, amount): ...

    with celery_dlock.lock("job:report:daily", backend="postgresql://...", ttl=60, wait=5) as lease:
        ...
"""

from __future__ import annotations

import importlib

from celery_dlock.backends import backend_from_url, mask_url
from celery_dlock.backends.base import Capabilities, LockBackend
from celery_dlock.errors import (
    AlreadySucceededError,
    BackendError,
    ConfigurationError,
    DLockError,
    DuplicateTaskError,
    LockKeyError,
    LockLostError,
    LockNotAcquiredError,
    LockTimeoutError,
    MissingDependencyError,
    UnknownBackendError,
)
from celery_dlock.forgetting import forget
from celery_dlock.keys import KeyTemplate, validate_key
from celery_dlock.lock import Lock
from celery_dlock.locks import Locks, lock
from celery_dlock.process import release_all
from celery_dlock.records import Holder, Lease, Outcome, Record

__version__ = "0.1.0"

#: Names imported on first use, so that ``import celery_dlock`` imports neither Celery nor
#: asyncio.
_LAZY_NAMES = {
    "LockedTask": "celery_dlock.celery",
    "install": "celery_dlock.celery",
    "AsyncLock": "celery_dlock.aio",
    "AsyncLocks": "celery_dlock.alocks",
    "alock": "celery_dlock.alocks",
}


def __getattr__(name: str) -> object:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_dlock' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != "celery":
            raise
        raise ModuleNotFoundError(
            f"celery_dlock.{name} needs Celery, which is not installed: "
            "pip install 'celery-dlock[celery]'",
            name=exc.name,
        ) from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES))


__all__ = [
    "AlreadySucceededError",
    "AsyncLock",
    "AsyncLocks",
    "BackendError",
    "Capabilities",
    "ConfigurationError",
    "DLockError",
    "DuplicateTaskError",
    "Holder",
    "KeyTemplate",
    "Lease",
    "Lock",
    "LockBackend",
    "LockKeyError",
    "LockLostError",
    "LockNotAcquiredError",
    "LockTimeoutError",
    "LockedTask",
    "Locks",
    "MissingDependencyError",
    "Outcome",
    "Record",
    "UnknownBackendError",
    "__version__",
    "alock",
    "backend_from_url",
    "forget",
    "install",
    "lock",
    "mask_url",
    "release_all",
    "validate_key",
]
