"""A process with more than 1,024 descriptors open (a busy worker: its connections, its
files) waits on the file store like any other. The wait used ``select``, which refuses a
descriptor past 1023: ``acquire(wait=...)`` failed with "filedescriptor out of range in
select()" (seen in a full CI run, whose test process had grown past it)."""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path

import pytest

from celery_dlock import Lock
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
