"""An exception raised by a signal wherever the main thread is, as billiard's handler raises
``SoftTimeLimitExceeded`` at a Celery task's soft time limit: for tests of code cut by one.
SIGUSR2, sent by another thread (pytest-timeout owns SIGALRM)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

#: The signal that cuts.
CUT_SIGNAL = signal.SIGUSR2


class Cut(Exception):
    """What the signal raises."""


def _raise(signum: int, frame: Any) -> None:
    raise Cut


@contextmanager
def cutting() -> Iterator[None]:
    """Inside the block, :data:`CUT_SIGNAL` raises :class:`Cut` in the main thread."""
    previous = signal.signal(CUT_SIGNAL, _raise)
    try:
        yield
    finally:
        signal.signal(CUT_SIGNAL, previous)


def cut_me() -> None:
    """Send this process :data:`CUT_SIGNAL` (from any thread)."""
    os.kill(os.getpid(), CUT_SIGNAL)


def cut_after(seconds: float, call: Callable[[], Any]) -> Cut:
    """Run ``call``, cut by :class:`Cut` after ``seconds`` (from a timer thread); it must be
    cut. Returns the exception (with its traceback, as Celery keeps a failed task's)."""
    timer = threading.Timer(seconds, cut_me)
    with cutting():
        try:
            timer.start()
            with pytest.raises(Cut) as cut:
                call()
        finally:
            timer.cancel()
    return cut.value
