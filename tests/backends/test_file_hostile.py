"""The file store under hostile local conditions, through the public ``Lock`` API."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from celery_dlock import BackendError, Holder, Lock
from celery_dlock.backends.file import FileBackend, history

#: The user the children run as when the tests run as root (root ignores file modes).
NOBODY = 65534


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A directory both children can use: owned by ``NOBODY`` when the tests run as root,
    outside pytest's tmp_path (its parents are private to root)."""
    directory = tempfile.mkdtemp(prefix="dlock-umask-")
    if os.geteuid() == 0:
        os.chown(directory, NOBODY, NOBODY)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def _in_child(umask: int, action: Callable[[], None]) -> int:
    """Run ``action`` in a forked child with ``umask`` as an unprivileged user; its exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            if os.geteuid() == 0:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            os.umask(umask)
            action()
            code = 0
        except BaseException as exc:
            print(f"child with umask {umask:o}: {type(exc).__name__}: {exc}", flush=True)
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_key_created_under_a_strict_umask_stays_usable_by_other_processes(
    shared_dir: str,
) -> None:
    url = f"file://{shared_dir}/store"

    def hold() -> None:
        with Lock(url, "report:daily"):
            pass

    assert _in_child(0o277, hold) == 0
    assert _in_child(0o022, hold) == 0

    backend = FileBackend(f"{shared_dir}/store")
    lock_file = os.path.join(shared_dir, "store", "locks", "report:daily")
    assert stat.S_IMODE(os.stat(lock_file).st_mode) == 0o600
    records = backend.history("report:daily")
    assert len(records) == 2
    assert records[0].lease.fence == 2
    backend.close()


def test_an_unreadable_success_is_a_backend_error_naming_it(tmp_path: Path) -> None:
    """Found by the task probe: where the success file of a key should be there was a
    directory, and ``last_success`` raised ``IsADirectoryError``, not a ``BackendError``:
    a ``once`` task then failed where a store failure re-queues it. A corrupt one too."""
    backend = FileBackend(str(tmp_path / "store"))
    lease = backend.try_acquire("job:pay:1", Holder.current(task_name="t.pay"), None)
    assert lease is not None
    path = Path(history.success_path(str(tmp_path / "store" / "success"), "job:pay:1", "t.pay"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    with pytest.raises(BackendError, match=r"cannot read the success of 'job:pay:1'"):
        backend.last_success("job:pay:1", "t.pay")
    path.rmdir()
    path.write_text("{not json")
    with pytest.raises(BackendError, match=r"cannot read the success of 'job:pay:1'"):
        backend.last_success("job:pay:1", "t.pay")
