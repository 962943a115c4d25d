"""A soft time limit that comes once the body has ended waits until its lock is released.

Celery's prefork pool ends a task at its soft time limit by a SIGUSR1 to the child, whose
handler (billiard's) raises ``SoftTimeLimitExceeded`` wherever the child's main thread is.
Once the body has returned or raised, its time is over; a limit that comes while its lock
is being released and the outcome recorded (a store slow to answer at the limit, or the
limit Celery sends again at a warm shutdown to a job whose result it has not read yet)
would cut that release: a lease left held with its holder alive, a ``once`` success not
kept, a dedupe mark not ended. From the body's end until the task's call returns, a soft
limit is held back: logged, not raised, since the body ended before it.

In a pool child (its SIGUSR1 handler is billiard's), the first task's start puts a handler
in front of billiard's that passes the signal on unless it is held back; holding and
letting go then cost a flag each, for every task (a child does not know whether the
worker gives its jobs a soft limit: ``--soft-time-limit`` is the parent's). It also holds
a limit that comes inside a store's step that must not be cut (``celery_dlock.critical``)
back until that step ends, and raises it there; and one that comes inside a release
(``Lock.release`` or ``__exit__``, in a plain task's ``with lock:``) or a ``__del__`` (any
object's, called by the garbage collector wherever the main thread is, where Python would
only print the exception) is sent again a few milliseconds later, until it lands outside
them, while the task it came for still runs. Anywhere else (another pool, a direct call,
a thread) nothing changes.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from billiard.pool import soft_timeout_sighandler
from celery._state import _task_stack

from celery_dlock import critical
from celery_dlock.events import fields
from celery_dlock.lock import Lock
from celery_dlock.locks import Locks

__all__ = ["lift", "ready", "run_body"]

logger = logging.getLogger("celery_dlock.task")

_SIGNAL = getattr(signal, "SIGUSR1", None)
#: A limit that came inside a finalizer or a release is sent again this many seconds later,
#: when it has returned (or sent again, if it still runs then).
_AGAIN = 0.005
#: Releases a soft limit must not cut, whoever calls them (a plain task's ``with lock:``):
#: cut, the lease would stay held, and renewed, for as long as the exception is kept.
_SHIELDED = {
    function.__code__ for function in (Lock.release, Lock.__exit__, Locks.release, Locks.__exit__)
}


class _Guard:
    """This process's guard: whether it is in front of billiard's handler (None: not
    looked yet; False: not a pool child's main thread, nothing to do), and what it holds."""

    def __init__(self) -> None:
        self.installed: bool | None = None
        self.main = threading.main_thread().ident
        self.task: Any = None  # the task whose soft limit is held back, while it is
        self.came = 0
        self.again: tuple[Any, Any] | None = None  # the run whose limit is to be sent again

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        again, self.again = self.again, None
        if self.task is not None:
            self.came += 1
            return
        if again is not None and not _same(again, _running()):
            _dropped("sent again after its task had ended")
            return
        regions = critical.state
        if regions.depth:  # inside a step that must not be cut: raised as it ends
            regions.pending = functools.partial(self.after_region, signum)
            return
        if _shielded(frame):  # a release, or a finalizer (whose exception Python drops)
            self.again = _running()
            if self.again is None:
                _dropped("came inside a release or a finalizer, outside any task")
            else:  # the task gets its limit once out of there
                threading.Timer(_AGAIN, os.kill, (os.getpid(), signum)).start()
            return
        soft_timeout_sighandler(signum, frame)  # raises SoftTimeLimitExceeded

    def after_region(self, signum: int) -> None:
        """A limit held back in a store's step, as the step ends: raised there, unless the
        step was part of a release (then sent again after it, as one that came there)."""
        self(signum, sys._getframe(1))

    def install(self) -> bool:
        """Put this guard in front of billiard's handler, in a pool child's main thread."""
        self.installed = (
            _SIGNAL is not None
            and threading.get_ident() == self.main
            and signal.getsignal(_SIGNAL) is soft_timeout_sighandler
        )
        if self.installed:
            signal.signal(_SIGNAL, self)  # type: ignore[arg-type]  # installed: _SIGNAL set
            critical.state.guarded = True
        return bool(self.installed)


def _shielded(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a release (:data:`_SHIELDED`: cut, its lease stays
    held) or a ``__del__`` (the garbage collector's call of one, at any point of the main
    thread: Python only prints an exception raised there)."""
    while frame is not None:
        code = frame.f_code
        if code in _SHIELDED or code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _dropped(where: str) -> None:
    message = "a soft time limit %s: dropped"
    logger.warning(message, where, extra=fields("soft_limit_dropped"))


def _running() -> tuple[Any, Any] | None:
    """The task this thread runs and its request, or None."""
    task = _task_stack.top
    return None if task is None else (task, task.request)


def _same(one: tuple[Any, Any], other: tuple[Any, Any] | None) -> bool:
    return other is not None and one[0] is other[0] and one[1] is other[1]


_guard = _Guard()


def _forked() -> None:
    global _guard
    _guard = _Guard()  # a pool child looks again: billiard installs its handler after the fork


os.register_at_fork(after_in_child=_forked)


def ready() -> None:
    """At a task's start: in a pool child, the guard in front of billiard's handler (from
    the first task on, so that the store's regions are guarded: ``celery_dlock.critical``).
    No store step is open as a task starts: the count of open regions starts again from
    none (one left open by an exception that was not a soft limit, an interrupt right after
    a region began, would otherwise hold back every later limit of the child)."""
    if _guard.installed is None:
        _guard.install()
    regions = critical.state
    regions.depth, regions.pending = 0, None


def run_body(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], raising: Any) -> Any:
    """``task.run(*args, **kwargs)`` (inside ``raising``, an ``Interrupter``, if given); as it
    ends, however it ends, a soft time limit is held back until :func:`lift`."""
    try:
        if raising is None:
            return task.run(*args, **kwargs)
        with raising:
            return task.run(*args, **kwargs)
    finally:  # held from here (inline: this runs for every task)
        guard = _guard
        installed = guard.install() if guard.installed is None else guard.installed
        if installed and guard.task is None and threading.get_ident() == guard.main:
            guard.task = task


def lift() -> None:
    """Let a soft limit through again; one that came while held back is logged."""
    guard = _guard
    if guard.task is None or threading.get_ident() != guard.main:
        return
    task, came = guard.task, guard.came
    guard.task, guard.came = None, 0
    if came:
        task_id = getattr(task.request, "id", None)
        logger.warning(
            "the soft time limit of %s[%s] came after its body had ended, while its lock was "
            "released: held back, not raised",
            task.name,
            task_id,
            extra=fields("soft_limit_held", task_id=task_id),
        )
