"""A soft time limit that comes once the body has ended waits until its lock is released.

Celery's prefork pool ends a task at its soft time limit by a SIGUSR1 to the child, whose
handler (billiard's) raises ``SoftTimeLimitExceeded`` wherever the child's main thread is.
Once the body has returned or raised, its time is over; a limit that comes while its lock
is being released and the outcome recorded (a store slow to answer at the limit, or the
limit Celery sends again at a warm shutdown to a job whose result it has not read yet)
would cut that release: a lease left held with its holder alive, a ``once`` success not
kept, a dedupe mark not ended. From the body's end until the task's call returns, a soft
limit is held back: logged, not raised, since the body ended before it.

Only in the main thread of a pool child whose SIGUSR1 handler is billiard's, and only for a
task with a soft time limit (the message's, the task's, or the worker's): two
``signal.signal`` calls per such task, none for the others.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from billiard.pool import soft_timeout_sighandler

from celery_dlock.events import fields

__all__ = ["lift", "run_body"]

logger = logging.getLogger("celery_dlock.task")

_SIGNAL = getattr(signal, "SIGUSR1", None)


class _Held:
    """SIGUSR1 held back for ``task``: the times it came while held."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.came = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.came += 1


_held: list[_Held] = []  # at most one: a process runs one task body at a time


def run_body(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], raising: Any) -> Any:
    """``task.run(*args, **kwargs)`` (inside ``raising``, an ``Interrupter``, if given); as it
    ends, however it ends, a soft time limit is held back until :func:`lift`."""
    try:
        if raising is None:
            return task.run(*args, **kwargs)
        with raising:
            return task.run(*args, **kwargs)
    finally:
        _hold(task)


def _hold(task: Any) -> None:
    if _held or _SIGNAL is None or not _soft_limited(task):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(_SIGNAL) is not soft_timeout_sighandler:
        return  # not a pool child of billiard's, or a handler of the user's own
    held = _Held(task)
    signal.signal(_SIGNAL, held)
    _held.append(held)


def _soft_limited(task: Any) -> bool:
    """Whether ``task``'s request runs under a soft time limit, as the worker gives it: the
    message's, else the task's, else the worker's (``task_soft_time_limit``)."""
    limits = getattr(task.request, "timelimit", None)
    soft = limits[1] if isinstance(limits, (tuple, list)) and len(limits) == 2 else None
    return bool(soft or task.soft_time_limit or task.app.conf.task_soft_time_limit)


def lift() -> None:
    """Give SIGUSR1 back to billiard's handler; a soft limit that came while held is logged."""
    if not _held:
        return
    held = _held.pop()
    restore: Callable[..., Any] = soft_timeout_sighandler
    signal.signal(_SIGNAL, restore)  # type: ignore[arg-type]  # _held: _SIGNAL is set
    if held.came:
        request = held.task.request
        logger.warning(
            "the soft time limit of %s[%s] came after its body had ended, while its lock was "
            "released: held back, not raised",
            held.task.name,
            getattr(request, "id", None),
            extra=fields("soft_limit_held", task_id=getattr(request, "id", None)),
        )
