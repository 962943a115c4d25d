"""A process with more than 1,024 descriptors open (a busy worker: its connections, its
files) waits on the file store like any other. The wait used ``select``, which refuses a
descriptor past 1023: ``acquire(wait=...)`` failed with "filedescriptor out of range in
select()" (seen in a full CI run, whose test process had grown past it). How it grew: a
``FileBackend`` dropped without ``close()`` kept its cached descriptors (up to 256) open for
the life of the process."""

from __future__ import annotations

import gc
import os
import resource
import threading
from pathlib import Path

import pytest

from celery_dlock import Holder, Lock, Outcome
from celery_dlock.backends.file import FileBackend
from tests.support.holders import kill, spawn_holder

DESCRIPTORS = 1100


def test_a_waiter_with_descriptors_past_1023_is_woken_when_the_holder_dies(
    tmp_path: Path,
) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < DESCRIPTORS + 100:
        pytest.skip(f"not applicable: this process may open {soft} descriptors only")
    url = f"file://{tmp_path}/locks"
    process, held = spawn_holder(url, "job:crowded")
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(DESCRIPTORS)]
    backend = FileBackend(str(tmp_path / "locks"))
    try:
        assert max(filler) > 1023
        threading.Timer(0.3, kill, (process,)).start()  # the wait watches the holder's pid
        lock = Lock(backend, "job:crowded", wait=30)
        lease = lock.acquire()
        assert lease.fence > held.fence
        assert backend.get("job:crowded") == lease
        assert lock.release() is not None
    finally:
        for fd in filler:
            os.close(fd)
        backend.close()
        kill(process)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _use_keys(backend: FileBackend, count: int) -> None:
    for n in range(count):
        lease = backend.try_acquire(f"job:many:{n}", Holder.current(), None)
        assert lease is not None
        backend.release(lease, Outcome.SUCCEEDED)


def test_a_backend_dropped_unclosed_closes_its_descriptors_once_collected(
    tmp_path: Path,
) -> None:
    gc.collect()
    before = _open_descriptors()
    backend = FileBackend(str(tmp_path / "locks"))
    _use_keys(backend, 300)
    assert _open_descriptors() > before + 200  # the descriptor cache (256 files)
    del backend
    gc.collect()
    assert _open_descriptors() == before


def test_a_forked_child_dropping_its_copy_closes_none_of_its_own_descriptors(
    tmp_path: Path,
) -> None:
    backend = FileBackend(str(tmp_path / "locks"))
    _use_keys(backend, 50)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports by its exit code
        code = 1
        try:
            # The parent's copies were closed at the fork: their numbers are reused here.
            mine = [os.open(os.devnull, os.O_RDONLY) for _ in range(60)]
            backend.get("job:many:0")  # the child's own files: the parent's copy dropped
            del backend
            gc.collect()
            for fd in mine:
                os.fstat(fd)  # raises if the dropped copy closed it
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert backend.get("job:many:0") is None  # the parent's descriptors still work
    backend.close()
