"""The exceptions of celery-dlock: one tree, rooted at :class:`DLockError`.

::

    DLockError
     ├─ LockNotAcquiredError          key held by someone else
     │   └─ LockTimeoutError          still held after waiting (also a TimeoutError)
     ├─ LockLostError                 our lease was taken over or expired
     ├─ AlreadySucceededError         a once task's success is kept already (first wins)
     ├─ DuplicateTaskError            a dedupe task with this key is queued already
     ├─ BackendError                  the store failed; the driver's exception is __cause__
     └─ ConfigurationError            (also a ValueError)
         ├─ LockKeyError              template/argument problems, bad keys
         ├─ UnknownBackendError       no backend for a URL scheme
         └─ MissingDependencyError    the backend's extra is not installed

Every class passes all its constructor arguments to ``super().__init__`` and builds its
message in ``__str__``: Celery rebuilds exceptions as ``cls(*args)`` (pickle does the same),
so an error raised in a worker arrives whole in the caller. All arguments are plain
JSON types for the same reason.
"""

from __future__ import annotations

__all__ = [
    "AlreadySucceededError",
    "BackendError",
    "ConfigurationError",
    "DLockError",
    "DuplicateTaskError",
    "LockKeyError",
    "LockLostError",
    "LockNotAcquiredError",
    "LockTimeoutError",
    "MissingDependencyError",
    "UnknownBackendError",
]


class DLockError(Exception):
    """Base class of every error raised by celery-dlock."""


class LockNotAcquiredError(DLockError):
    """The key is held by someone else.

    Args:
        key: the key that was busy.
        holder: a short description of the current holder, when known.
    """

    def __init__(self, key: str, holder: str | None = None) -> None:
        super().__init__(key, holder)
        self.key = key
        self.holder = holder

    def __str__(self) -> str:
        held = f" by {self.holder}" if self.holder else ""
        return f"lock {self.key!r} is held{held}"


class LockTimeoutError(LockNotAcquiredError, TimeoutError):
    """The key was still held after waiting ``wait`` seconds."""

    def __init__(self, key: str, wait: float, holder: str | None = None) -> None:
        DLockError.__init__(self, key, wait, holder)
        self.key = key
        self.wait = wait
        self.holder = holder

    def __str__(self) -> str:
        held = f" by {self.holder}" if self.holder else ""
        return f"lock {self.key!r} still held{held} after waiting {self.wait:g} s"


class LockLostError(DLockError):
    """Our lease is no longer ours: it expired, was taken over, or was force-released.

    Args:
        key: the key of the lost lease.
        fence: the fence of the lost lease.
        reason: what was being done when the loss was seen (``renew``, ``release``...).
    """

    def __init__(self, key: str = "", fence: int = -1, reason: str = "") -> None:
        # Defaults: raised by class alone when injected into a running task's thread.
        super().__init__(key, fence, reason)
        self.key = key
        self.fence = fence
        self.reason = reason

    def __str__(self) -> str:
        during = f" (seen on {self.reason})" if self.reason else ""
        return f"lease on {self.key!r} with fence {self.fence} was lost{during}"


class AlreadySucceededError(DLockError):
    """A ``once`` success of this task on this key is kept already: the first success wins,
    and a second one is refused (raised by ``record_success`` inside the caller's own
    transaction, which must then roll back).

    Args:
        key: the key.
        task_name: the task whose success is kept.
        fence: the fence of the lease whose success is kept.
        task_id: the task id of that success, when known.
    """

    def __init__(self, key: str, task_name: str, fence: int, task_id: str | None = None) -> None:
        super().__init__(key, task_name, fence, task_id)
        self.key = key
        self.task_name = task_name
        self.fence = fence
        self.task_id = task_id

    def __str__(self) -> str:
        by = f" by task {self.task_id}" if self.task_id else ""
        return (
            f"{self.task_name} already succeeded on {self.key!r} (fence {self.fence}{by}): "
            "the first success wins"
        )


class DuplicateTaskError(DLockError):
    """A task with ``dedupe`` was not sent: a message of the same task and key is queued
    (or running, with ``until_finished``) already.

    Args:
        key: the key of the dedupe mark (``<lock key>#queued:<task name>``).
        task_id: the id of the queued task (its ``AsyncResult``), when known.
    """

    def __init__(self, key: str, task_id: str | None = None) -> None:
        super().__init__(key, task_id)
        self.key = key
        self.task_id = task_id

    def __str__(self) -> str:
        queued = f" as task {self.task_id}" if self.task_id else ""
        return f"not sent: {self.key!r} is queued already{queued}"


class BackendError(DLockError):
    """The lock store failed or could not be reached; the driver's exception is ``__cause__``.

    Args:
        message: what failed, in words.
        backend: the backend's URL with its password masked, when known.
    """

    def __init__(self, message: str, backend: str | None = None) -> None:
        super().__init__(message, backend)
        self.message = message
        self.backend = backend

    def __str__(self) -> str:
        where = f" [{self.backend}]" if self.backend else ""
        return f"{self.message}{where}"


class ConfigurationError(DLockError, ValueError):
    """Bad configuration or arguments: fix the call, retrying will not help."""


class LockKeyError(ConfigurationError):
    """A key template, its arguments, or a rendered key is invalid; the message names it."""


class UnknownBackendError(ConfigurationError):
    """No backend is registered for a URL scheme.

    Args:
        scheme: the scheme that was asked for.
        suggestion: the closest known scheme, if any.
    """

    def __init__(self, scheme: str, suggestion: str | None = None) -> None:
        super().__init__(scheme, suggestion)
        self.scheme = scheme
        self.suggestion = suggestion

    def __str__(self) -> str:
        hint = f"; did you mean {self.suggestion!r}?" if self.suggestion else ""
        return f"no lock backend for URL scheme {self.scheme!r}{hint}"


class MissingDependencyError(ConfigurationError, ImportError):
    """The driver a backend needs is not installed.

    Args:
        backend: the backend's name (``postgres``, ``redis``...).
        module: the module that failed to import.
        extra: the package extra that installs it.
    """

    def __init__(self, backend: str, module: str, extra: str) -> None:
        ConfigurationError.__init__(self, backend, module, extra)
        self.backend = backend
        self.module = module
        self.extra = extra

    def __str__(self) -> str:
        return (
            f"the {self.backend} backend needs the {self.module!r} module, which is not "
            f"installed: pip install 'celery-dlock[{self.extra}]'"
        )
