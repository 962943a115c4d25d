"""An exception raised by a signal wherever the main thread is, as billiard's handler raises
``SoftTimeLimitExceeded`` at a Celery task's soft time limit: for tests of code cut by one.
SIGUSR2, sent by another thread (pytest-timeout owns SIGALRM)."""

from __future__ import annotations

import os
import signal
import sys
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


def arm_cut(function: Callable[..., Any], signum: int | None = None) -> list[str]:
    """In the calling thread (a worker's, from a ``task_prerun`` handler), the first call of
    ``function`` raises :class:`Cut` as it starts, where a signal's handler raises on the
    way into a function: a cut at a chosen point between two steps, deterministic where a
    timed signal is not. Through the profile hook, whose exception goes into the called
    frame (the trace hook is coverage's), set until the thread calls
    ``sys.setprofile(None)``. With ``signum``, that signal is sent to this process instead,
    whose handler runs there, in the called frame (a soft limit's SIGUSR1, to a guarded
    handler). Returns a list that holds the function's name once cut."""
    code = getattr(function, "__code__", None)
    if code is None:
        raise TypeError(f"{function!r} is not a Python function")
    fired: list[str] = []
    previous = sys.getprofile()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code and not fired:
            fired.append(code.co_qualname)
            sys.setprofile(previous)
            if signum is not None:
                os.kill(os.getpid(), signum)
                return
            raise Cut

    sys.setprofile(profile)
    return fired


def signal_on_entry(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, signum: int = CUT_SIGNAL
) -> list[str]:
    """Until the test ends, as the first call of ``owner.name`` starts, send this process
    ``signum`` (:data:`CUT_SIGNAL`: inside a :func:`cutting` block), whose handler runs at
    once, before the function's first statement, as a signal that comes there: it raises on
    the way in, or, if it holds the signal back, the function runs. Returns a list that
    holds ``name`` once sent."""
    function, sent = getattr(owner, name), []

    def entry(*args: Any, **kwargs: Any) -> Any:
        if not sent:
            sent.append(name)
            os.kill(os.getpid(), signum)
        return function(*args, **kwargs)

    monkeypatch.setattr(owner, name, entry)
    return sent
