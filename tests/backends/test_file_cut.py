"""The file store's step cut by an exception that a signal's handler raises (a Celery soft
time limit) while it holds a key's stripe mutex and ``flock``. Found by sweeping a soft
limit over every call of a LockedTask's run: a cut on the way into ``Locked.__exit__`` (a
Python function: the interpreter looks for signals on the way into every one) left both
held, so every later call of the process on a key of that stripe waited forever, and every
other process on that key. In a pool child, a soft limit inside such a step is now held back
until the step has let go, and raised then (``celery_dlock.critical``). And a cut right
after the stripe mutex was taken, before the statement that frees it on an error, now
finds it by its owner."""

from __future__ import annotations

import gc
import inspect
import signal
import subprocess
import sys
import threading
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from celery_dlock import Holder, Outcome, critical
from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.file.state import Locked
from celery_dlock.celery import softlimit
from tests.support import eventually
from tests.support.cuts import CUT_SIGNAL, Cut, cutting, signal_on_entry
from tests.support.poolchild import pool_child

WAIT = 10.0


def _in_a_thread(call: Callable[[], object]) -> list[object]:
    """``[call()]`` from another thread, or ``[]`` if it did not return within ``WAIT``."""
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(call()), daemon=True)
    thread.start()
    thread.join(WAIT)
    return done


def _read_elsewhere(url: str, key: str) -> str:
    """The key read by another process (a shared flock): its holder's token, or None."""
    code = (
        "import sys; from celery_dlock.backends.file import FileBackend as B; "
        "lease = B.from_url(sys.argv[1]).get(sys.argv[2]); print(lease and lease.token)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, url, key],
        check=True,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    return done.stdout.strip()


__all__ = ["pool_child"]  # the fixture guarded_child builds on


@pytest.fixture
def guarded_child(pool_child: None) -> None:
    """A pool child's main thread once it ran a task: the guard in place."""
    softlimit.ready()
    assert critical.state.guarded


@pytest.mark.usefixtures("guarded_child")
@pytest.mark.parametrize("step", ["try_acquire", "release"])
def test_a_soft_limit_as_a_step_lets_go_of_its_key_is_raised_after_it(
    tmp_path: Path, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}"
    backend = FileBackend.from_url(url)
    key = f"job:cut-{uuid.uuid4().hex[:6]}"
    try:
        lease = None if step == "try_acquire" else backend.try_acquire(key, Holder.current(), 30)
        sent = signal_on_entry(monkeypatch, Locked, "__exit__", signal.SIGUSR1)
        with pytest.raises(SoftTimeLimitExceeded):
            if lease is None:
                backend.try_acquire(key, Holder.current(), 30)
            else:
                backend.release(lease, Outcome.SUCCEEDED)
        assert sent == ["__exit__"]
        assert critical.state.depth == 0
        read = _in_a_thread(lambda: backend.get(key))
        assert read, "the stripe is still held"
        [now] = read
        if step == "try_acquire":  # the step was done whole: granted, then the limit raised
            assert now is not None
            assert _read_elsewhere(url, key) == now.token  # the flock free
            assert backend.release(now, Outcome.ABANDONED) is not None
        else:  # released, and recorded
            assert now is None
            assert _read_elsewhere(url, key) == "None"
            [record] = backend.history(key=key)
            assert record.outcome is Outcome.SUCCEEDED
    finally:
        backend.close()


def test_a_cut_right_after_the_stripe_mutex_was_taken_frees_it(tmp_path: Path) -> None:
    """The signal's handler runs in the main thread where it next looks, which is just after
    the stripe mutex's ``acquire`` returns: the signal is sent while the main thread waits
    for that mutex (held by another thread), with the main thread blocking it, so that the
    other thread takes it and the handler's look comes only once the wait is over."""
    url = f"file://{tmp_path}"
    backend = FileBackend.from_url(url)
    key = f"job:cut-{uuid.uuid4().hex[:6]}"
    stripe = backend._files.get().stripe(key)
    taken = threading.Event()
    main = threading.main_thread()

    def hold_the_stripe() -> None:
        with stripe:
            taken.set()
            # Once the main thread waits for the stripe (had it not got there yet, its
            # acquire would find the stripe free, take it without waiting, and look for the
            # signal only at its next system call: a later point of the step).
            eventually(lambda: _waits_for_the_stripe(main), "the main thread waiting")
            # To this thread, whose C handler has then run when the call returns. Sent to the
            # process, the signal may go to any thread that does not block it (an xdist
            # worker's execnet thread) and trip only once that thread runs, which on a loaded
            # machine can be after the main thread took the GIL back and passed the step;
            # CPython 3.11 on Linux has the main thread look for a signal another thread
            # received only when it next takes the GIL. Seen in CI on 2026-11-29: the cut
            # came at the pthread_sigmask after the step.
            signal.pthread_kill(threading.get_ident(), CUT_SIGNAL)

    other = threading.Thread(target=hold_the_stripe, daemon=True)
    try:
        with cutting():
            other.start()  # before the mask, which a new thread inherits
            assert taken.wait(WAIT)
            signal.pthread_sigmask(signal.SIG_BLOCK, {CUT_SIGNAL})
            try:
                with pytest.raises(Cut) as cut:
                    backend.try_acquire(key, Holder.current(), 30)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {CUT_SIGNAL})
        # Raised just after the acquire, or a little later (a specialized call instruction
        # may not look): inside the step, with the stripe held, either way.
        assert "__enter__" in _frames(cut.value)
        other.join(WAIT)
        assert _in_a_thread(lambda: backend.get(key)) == [None], "the stripe is still held"
        assert _read_elsewhere(url, key) == "None"
    finally:
        backend.close()


def _acquire_line() -> int:
    """The line of ``Locked.__enter__`` that takes the stripe mutex."""
    lines, first = inspect.getsourcelines(Locked.__enter__)
    return first + next(n for n, line in enumerate(lines) if "mutex.acquire()" in line)


def _waits_for_the_stripe(thread: threading.Thread) -> bool:
    """Whether ``thread`` is asleep in the stripe mutex's ``acquire`` (its frame on that
    line, and the kernel's state of the thread ``S``)."""
    collecting = gc.isenabled()
    gc.disable()  # CPython 3.11: a collection inside sys._current_frames() can deadlock it
    try:  # (it allocates while it holds the runtime's lock: python/cpython#106883, seen here)
        frame = sys._current_frames().get(thread.ident or 0)
    finally:
        if collecting:
            gc.enable()
    if (
        frame is None
        or frame.f_code is not Locked.__enter__.__code__
        or frame.f_lineno != _acquire_line()
    ):
        return False
    stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "S"


def _frames(exc: BaseException) -> list[str]:
    """The functions ``exc`` went through, innermost last."""
    return [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
