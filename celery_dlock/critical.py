"""Steps that an exception raised by a signal's handler must not cut in the middle.

A Celery soft time limit is such an exception: billiard's SIGUSR1 handler raises
``SoftTimeLimitExceeded`` wherever a pool child's main thread is, between any two
statements and on the way into any function. Most steps survive it: what they hold is
given back or dropped by the exception (a Lock's grant, a Postgres session, a Redis
connection). A few do not: the file store holds a key's stripe mutex and its ``flock``
from a ``with`` block's ``__enter__`` to its ``__exit__``, a Python function that a cut on
its way in never runs (the key then stayed blocked for every other process, for as long
as the process lived), and writes a change and its records in two steps.

Such a region is marked with :func:`enter` and :func:`leave`. Where the soft limit's handler
is guarded (a pool child that ran a LockedTask: ``celery_dlock.celery.softlimit`` sets
``state.guarded``), a soft limit that comes inside a region is held back until the
outermost region ends, and raised there. Elsewhere the marks count nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

__all__ = ["enter", "leave", "state"]


class _State:
    """This process's regions (of its main thread, where signals' handlers run)."""

    __slots__ = ("depth", "guarded", "main", "pending")

    def __init__(self) -> None:
        self.guarded = False
        self.depth = 0
        self.pending: Callable[[], object] | None = None
        self.main = threading.main_thread().ident


state = _State()
_get_ident = threading.get_ident


def enter() -> None:
    """A region begins (regions nest)."""
    if state.guarded and _get_ident() == state.main:
        state.depth += 1


def leave() -> None:
    """A region ends; at the end of the outermost, what came meanwhile is raised."""
    if state.depth and _get_ident() == state.main:
        state.depth -= 1
        if not state.depth and state.pending is not None:
            pending, state.pending = state.pending, None
            pending()


def _forked() -> None:
    global state
    state = _State()  # the child's main thread, no region, not guarded until it says so


os.register_at_fork(after_in_child=_forked)
