"""Calling a task option that is a callable (``on_locked``, ``on_duplicate``,
``on_lock_lost``) the one way the README documents: with the task first; and
``on_lock_lost="raise"``'s way into the body (:class:`Interrupter`)."""

from __future__ import annotations

import ctypes
import inspect
import threading
from types import TracebackType
from typing import Any

from celery_dlock.errors import LockLostError

__all__ = ["Interrupter", "call_policy"]


def call_policy(task: Any, name: str, *args: Any) -> Any:
    """Call ``task``'s option ``name`` as ``(task, *args)``, whatever kind of callable it
    is: a function set on the task class (which reading it from the task would bind), a
    ``staticmethod``, a callable object or a ``functools.partial``."""
    raw = inspect.getattr_static(task, name)
    if isinstance(raw, staticmethod):
        raw = raw.__func__
    return raw(task, *args)


class Interrupter:
    """``on_lock_lost="raise"``: a LockLostError raised in the task's thread while its body
    runs (``with interrupter: body()``), and never once it has ended: a loss reported while
    the task releases its lease would land inside the release (nothing recorded, the lease
    left in the process's registry), in the tracer or in the child's next task. A loss
    reported after the body is the task's to see (``Lock.lost``).

    The exception is set for the thread by ``PyThreadState_SetAsyncExc`` and raised at the
    thread's next check of the interpreter's eval breaker (a call's start, a loop's jump),
    which also clears the breaker. It is never cleared by that function with NULL: CPython
    then leaves the breaker set for the life of the process (3.11 and 3.12 do, by their
    code), so that every later call goes through it, and, on 3.11 under a trace or profile
    function (coverage, a debugger, a profiler), the next call of a Python function spins
    for ever."""

    __slots__ = ("_mutex", "_thread")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._thread: int | None = None  # the task's thread, while its body runs

    def __enter__(self) -> Interrupter:
        self._thread = threading.get_ident()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._mutex:
            self._thread = None
        # From here no loss is reported to this thread. One reported as the body ended and
        # not raised in it yet is raised here, at this call's start: from the with block,
        # never later (in the release, the tracer).
        _checkpoint()

    def interrupt(self) -> None:
        """Raise LockLostError in the body's thread at its next Python instruction, once;
        nothing when the body is not running."""
        with self._mutex:
            if self._thread is not None:
                _raise_in(self._thread, LockLostError)
                self._thread = None


def _raise_in(thread: int, kind: type[BaseException]) -> None:
    """Set ``kind`` as the exception pending for ``thread``."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(kind))


def _checkpoint() -> None:
    """A call: the eval breaker is checked at its start."""
