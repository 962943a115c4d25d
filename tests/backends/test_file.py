"""File backend promises beyond the contract: safe names, permissions, GC with fence floor,
day segments, corruption, kernel wakeups, fork."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import BackendError, ConfigurationError, Holder, Outcome, Record, backend_from_url
from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.file.wakeups import Inotify
from celery_dlock.backends.naming import file_name
from celery_dlock.testing import FakeClock
from tests.backends.test_contract import KEYS
from tests.support import unavailable


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def backend(tmp_path: Path, clock: FakeClock) -> FileBackend:
    return FileBackend(str(tmp_path / "locks"), clock=clock)


def test_names_are_safe_unique_and_short() -> None:
    names = {file_name(key) for key in KEYS}
    assert len(names) == len(KEYS)
    for name in names:
        assert "/" not in name and name not in (".", "..") and not name.startswith(".")
        assert len(name.encode()) <= 255
        assert name.isascii()


def test_long_names_never_collide_with_short_ones() -> None:
    long_key = "job:" + "a" * 500
    assert "~" in file_name(long_key)
    assert "~" not in file_name("job:~")  # "~" is encoded in short names
    assert file_name(long_key) != file_name(long_key + "b")


def test_directories_are_private_and_files_owner_only(backend: FileBackend, tmp_path: Path) -> None:
    lease = backend.try_acquire("job:perm", Holder.current(task_name="t"), None)
    assert lease is not None
    backend.release(lease, Outcome.SUCCEEDED, result="kept for once")
    root = tmp_path / "locks"
    for directory in (root, root / "locks", root / "history", root / "success"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == 3  # state, history day, kept result
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_the_state_file_is_readable_json(backend: FileBackend, tmp_path: Path) -> None:
    lease = backend.try_acquire("job:inspect", Holder.current(), None)
    assert lease is not None
    state = json.loads((tmp_path / "locks" / "locks" / file_name("job:inspect")).read_bytes())
    assert state["key"] == "job:inspect"
    assert state["fence"] == lease.fence
    assert state["lease"]["token"] == lease.token
    assert state["lease"]["holder"]["pid"] == os.getpid()


def test_gc_deletes_long_free_files_and_fences_continue_above(
    backend: FileBackend, clock: FakeClock, tmp_path: Path
) -> None:
    for _ in range(3):
        lease = backend.try_acquire("job:gc", Holder.current(), None)
        assert lease is not None
        backend.release(lease, Outcome.SUCCEEDED)
    last_fence = lease.fence
    path = tmp_path / "locks" / "locks" / file_name("job:gc")
    backend.reap()
    assert path.exists()  # free, but not for long enough
    clock.advance(backend.gc_after + 1)
    assert backend.reap() == []
    assert not path.exists()
    assert int((tmp_path / "locks" / "fence-floor").read_text()) == last_fence
    again = backend.try_acquire("job:gc", Holder.current(), None)
    assert again is not None and again.fence > last_fence


def test_gc_keeps_recent_and_held_files(
    backend: FileBackend, clock: FakeClock, tmp_path: Path
) -> None:
    held = backend.try_acquire("job:held", Holder.current(), None)
    assert held is not None
    clock.advance(backend.gc_after + 1)
    backend.reap()
    assert (tmp_path / "locks" / "locks" / file_name("job:held")).exists()
    current = backend.get("job:held")
    assert current is not None and current.token == held.token


def test_another_client_that_opened_a_collected_file_reopens_it(
    backend: FileBackend, clock: FakeClock, tmp_path: Path
) -> None:
    other = FileBackend(str(tmp_path / "locks"), clock=clock)
    lease = other.try_acquire("job:reopen", Holder.current(), None)
    assert lease is not None
    other.release(lease, Outcome.SUCCEEDED)  # `other` keeps the file open in its cache
    clock.advance(backend.gc_after + 1)
    backend.reap()
    again = other.try_acquire("job:reopen", Holder.current(), None)
    assert again is not None and again.fence > lease.fence
    assert backend.try_acquire("job:reopen", Holder.current(), None) is None


def test_history_is_kept_in_day_files_and_pruned_by_day(
    backend: FileBackend, clock: FakeClock, tmp_path: Path
) -> None:
    for _ in range(3):
        lease = backend.try_acquire("job:days", Holder.current(), None)
        assert lease is not None
        backend.release(lease, Outcome.SUCCEEDED)
        clock.advance(86400)
    days = sorted(p.name for p in (tmp_path / "locks" / "history").iterdir())
    assert len(days) == 3 and all(d.endswith(".jsonl") for d in days)
    newest = backend.history(key="job:days")[0]
    assert backend.prune_history(newest.released_at) == 2
    assert backend.history(key="job:days") == [newest]


def test_a_corrupt_state_file_is_reported_and_left_alone(
    backend: FileBackend, tmp_path: Path
) -> None:
    path = tmp_path / "locks" / "locks" / file_name("job:corrupt")
    path.write_bytes(b'{"key": "job:corrupt", "fen')
    with pytest.raises(BackendError, match="corrupt"):
        backend.try_acquire("job:corrupt", Holder.current(), None)
    assert path.read_bytes() == b'{"key": "job:corrupt", "fen'


def test_a_holder_on_another_host_is_never_taken_over(backend: FileBackend) -> None:
    elsewhere = dataclasses.replace(Holder.current(), host="other", host_id="x/pid:[1]", pid=1)
    lease = backend.try_acquire("job:remote", elsewhere, None)
    assert lease is not None
    assert backend.try_acquire("job:remote", Holder.current(), None) is None
    assert backend.reap() == []


def test_a_recycled_pid_is_taken_over_as_disconnected(backend: FileBackend) -> None:
    me = Holder.current()
    assert me.started is not None
    ghost = dataclasses.replace(me, started=me.started - 10)  # our pid, another process
    old = backend.try_acquire("job:recycled", ghost, None)
    assert old is not None
    new = backend.try_acquire("job:recycled", me, None)
    assert new is not None and new.fence > old.fence
    [record] = backend.history(key="job:recycled")
    assert record.outcome is Outcome.DISCONNECTED and record.lease.token == old.token


def test_wait_is_a_kernel_wakeup_here(tmp_path: Path) -> None:
    path = tmp_path / "watched"
    path.write_text("x")
    fd = Inotify.watch(str(path))
    assert fd is not None, "inotify is not available on this machine"
    os.close(fd)
    assert FileBackend.capabilities.push_wait


def test_a_forked_child_uses_its_own_files(backend: FileBackend) -> None:
    held = backend.try_acquire("job:fork", Holder.current(), None)
    assert held is not None
    pid = os.fork()
    if pid == 0:  # child: the parent holds the key; the child must be refused, then work
        code = 0
        try:
            if backend.try_acquire("job:fork", Holder.current(), None) is not None:
                code = 3
            elif backend.try_acquire("job:fork-child", Holder.current(), None) is None:
                code = 4
        except BaseException:
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    current = backend.get("job:fork")
    assert current is not None and current.token == held.token


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a disk that fills up (found by the torture harness's diskfull chaos)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_never_acknowledges_a_release_whose_record_it_lost(small_disk: Path) -> None:
    """The torture harness found it: a history append cut short by a full disk was taken for
    a whole one (the release acknowledged, its record torn), and the next record was glued
    to the torn line, so both were lost."""
    backend = FileBackend(str(small_disk / "locks"))
    first = backend.try_acquire("job:full:warm", Holder.current(), None)
    assert first is not None and backend.release(first, Outcome.SUCCEEDED) is not None
    torn = backend.try_acquire("job:full:a", Holder.current(), None)
    assert torn is not None
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:  # fill the disk to the last page
            f.write(b"x" * 4096)
    with open(filler, "r+b") as f:  # then give back one page: room for part of a record
        f.truncate(filler.stat().st_size - 4096)
    acknowledged: list[Record] = []
    with contextlib.suppress(BackendError):  # refusing is right; acknowledging is a promise
        record = backend.release(torn, Outcome.FAILED, "Boom", "d" * 12000)
        assert record is not None
        acknowledged.append(record)
    filler.unlink()  # room again
    after = backend.try_acquire("job:full:b", Holder.current(), None)
    assert after is not None
    record = backend.release(after, Outcome.SUCCEEDED)
    assert record is not None
    acknowledged.append(record)
    kept = {(r.key, r.lease.token) for r in backend.history(limit=None)}
    missing = [(r.key, r.lease.token) for r in acknowledged if (r.key, r.lease.token) not in kept]
    assert missing == []
    backend.close()


def test_a_record_glued_to_a_torn_line_by_another_process_is_still_read(tmp_path: Path) -> None:
    """A process whose append a full disk cut short cannot end the line for the others:
    the next record may follow on the same line, and the reader finds it there."""
    backend = FileBackend(str(tmp_path / "locks"))
    lease = backend.try_acquire("job:glued", Holder.current(), None)
    assert lease is not None
    record = backend.release(lease, Outcome.SUCCEEDED)
    assert record is not None
    [segment] = list((tmp_path / "locks" / "history").iterdir())
    line = segment.read_bytes()
    segment.write_bytes(line[: len(line) // 2] + line)  # a torn half, the record glued to it
    assert [r.lease.token for r in backend.history(key="job:glued")] == [lease.token]
    backend.close()


@pytest.mark.parametrize("key", ["job:plain", "job:ü€😀", 'job:"quoted"\\back'])
def test_history_by_key_and_outcome_finds_exactly_its_records_however_encoded(
    backend: FileBackend, tmp_path: Path, key: str
) -> None:
    """``history(key=, outcome=)`` searches each line for the key before parsing it: a
    line written ASCII-escaped (``json.dumps``'s default) is found as well as the UTF-8
    ones this store writes, and a record that only mentions the key is not returned."""
    mine, others = [], []
    for n in range(6):
        lease = backend.try_acquire(key if n % 2 == 0 else "job:other", Holder.current(), None)
        assert lease is not None
        outcome = Outcome.FAILED if n % 3 == 0 else Outcome.SUCCEEDED
        record = backend.release(lease, outcome, "ValueError", f"about {key}")
        assert record is not None
        (mine if n % 2 == 0 else others).append(record)
    [segment] = list((tmp_path / "locks" / "history").iterdir())
    escaped = Record(mine[0].lease, mine[0].released_at + 1, Outcome.FAILED, "escaped", None)
    with segment.open("ab") as f:
        f.write(json.dumps(escaped.to_dict()).encode() + b"\n")
    mine.append(escaped)

    def tokens(records: list[Record]) -> set[str]:
        return {r.lease.token + r.outcome.value + str(r.problem) for r in records}

    assert tokens(backend.history(key=key, limit=None)) == tokens(mine)
    failed = [r for r in mine if r.outcome is Outcome.FAILED]
    assert tokens(backend.history(key=key, outcome=Outcome.FAILED, limit=None)) == tokens(failed)
    assert tokens(backend.history(key="job:other", limit=None)) == tokens(others)
    assert len(backend.history(limit=None)) == 7


def test_history_reads_only_what_a_query_needs_and_answers_as_a_full_read_would(
    backend: FileBackend, clock: FakeClock
) -> None:
    """``history`` parses a day's lines by a bound on their release time; the answers are
    those of sorting every record (newest first, the later written first among equal
    times): with the clock stepped back and forth, times repeated, and metadata and
    results that hold a ``released_at`` of their own, above and below the record's."""
    written: list[Record] = []
    steps = [0.0, 5.0, -3.0, 0.0, 0.0, 2.0, -10.0, 7.0, 0.0, -1.0, 4.0, 0.0]
    for n, step in enumerate(steps * 3):
        clock.advance(step)
        metadata = {"released_at": clock() + (1000 if n % 4 == 0 else -1000)}
        holder = dataclasses.replace(Holder.current(), metadata=metadata)
        key = f"job:mixed:{n % 3}"
        lease = backend.try_acquire(key, holder, None)
        assert lease is not None
        outcome = Outcome.FAILED if n % 5 == 0 else Outcome.SUCCEEDED
        result = {"released_at": 1e12} if n % 7 == 0 else None
        record = backend.release(lease, outcome, result=result)
        assert record is not None
        written.append(record)
    order = {id(record): n for n, record in enumerate(written)}

    def expected(**query: Any) -> list[str]:
        since, key, outcome = query.get("since"), query.get("key"), query.get("outcome")
        chosen = [
            r
            for r in written
            if (since is None or r.released_at >= since)
            and (key is None or r.key == key)
            and (outcome is None or r.outcome == outcome)
        ]
        chosen.sort(key=lambda r: (r.released_at, order[id(r)]), reverse=True)
        limit = query.get("limit", 100)
        return [r.lease.token for r in chosen[:limit]]

    middle = sorted(r.released_at for r in written)[len(written) // 2]
    for limit in (1, 2, 3, 5, 8, 13, 35, 36, 100, None):
        for query in ({}, {"key": "job:mixed:1"}, {"outcome": Outcome.FAILED}, {"since": middle}):
            found = [r.lease.token for r in backend.history(limit=limit, **query)]  # type: ignore[arg-type]
            assert found == expected(limit=limit, **query), (limit, query)


# -- where there is no /proc, and where there is no flock -------------------------------------


def test_windows_gets_an_error_naming_the_stores_it_can_use(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import celery_dlock.backends

    monkeypatch.setattr(celery_dlock.backends.sys, "platform", "win32")
    with pytest.raises(ConfigurationError, match="Windows") as info:
        backend_from_url(f"file://{tmp_path}/locks")
    for scheme in ("memory://", "redis://", "postgresql://", "s3://", "gs://"):
        assert scheme in str(info.value)


def test_without_proc_the_portable_mode_is_the_default_and_identifies_by_psutil(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from celery_dlock import identity

    pytest.importorskip("psutil")
    monkeypatch.setenv("CELERY_DLOCK_PORTABLE", "1")  # as on macOS: no /proc, inotify, pidfd
    identity.identity.cache_clear()
    try:
        backend = FileBackend(str(tmp_path / "locks"))
        assert backend.portable
        me = Holder.current()
        assert me.host_id.startswith(identity.PORTABLE) and me.started is not None
        assert not me.is_gone()
        lease = backend.try_acquire("job:portable", me, None)
        assert lease is not None and lease.holder == me
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        gone = dataclasses.replace(me, pid=int(dead.stdout))
        assert gone.is_gone()  # that pid's process has exited
        assert dataclasses.replace(me, started=me.started - 5).is_gone()  # a recycled pid
        backend.release(lease, Outcome.SUCCEEDED)
    finally:
        identity.identity.cache_clear()


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte; the file that did it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):  # ENOSPC: full
        while True:
            os.write(fd, b"x" * 4096)
    os.close(fd)
    return filler


def test_a_full_disk_refuses_with_backend_errors_and_loses_nothing(small_disk: Path) -> None:
    backend = FileBackend.from_url(f"file://{small_disk}/store")
    me = Holder.current()
    held = backend.try_acquire("job:held", me, 30)
    assert held is not None
    filler = fill(small_disk)

    with pytest.raises(BackendError, match="No space left"):
        backend.try_acquire("job:new", me, 30)  # refused, not granted unrecorded
    with pytest.raises(BackendError, match="No space left"):
        backend.release(held, Outcome.SUCCEEDED)  # its record cannot be written...
    still = backend.get("job:held")
    assert still is not None and still.token == held.token  # ...so the lease stays held

    filler.unlink()
    record = backend.release(held, Outcome.SUCCEEDED)
    assert record is not None
    assert [r.outcome for r in backend.history(key="job:held")] == [Outcome.SUCCEEDED]
    assert backend.try_acquire("job:new", me, 30) is not None
    backend.close()


def test_a_success_the_full_disk_cannot_keep_is_refused_before_any_record(
    small_disk: Path,
) -> None:
    # The history's page has room for a record; the success file ``once`` replays needs a
    # new one. The release is refused with a BackendError (Lock tries a success again), the
    # lease stays held and nothing is recorded: before, the record was appended first and a
    # bare OSError left it beside the lease, which then ended a second time.
    backend = FileBackend.from_url(f"file://{small_disk}/store")
    me = Holder.current(task_name="tasks.charge")
    warm = backend.try_acquire("job:kept", me, 30)
    assert warm is not None and backend.release(warm, Outcome.FAILED, "Boom", "d") is not None
    held = backend.try_acquire("job:kept", me, 30)
    assert held is not None
    filler = fill(small_disk)
    with pytest.raises(BackendError, match="No space left"):
        backend.release(held, Outcome.SUCCEEDED, result={"charged": 42})
    still = backend.get("job:kept")
    assert still is not None and still.token == held.token
    assert [r.lease.token for r in backend.history(key="job:kept")] == [warm.token]
    assert not [p.name for p in small_disk.rglob("*.tmp")]  # no partial file left behind
    filler.unlink()
    record = backend.release(held, Outcome.SUCCEEDED, result={"charged": 42})
    assert record is not None
    outcomes = [(r.lease.token, r.outcome) for r in backend.history(key="job:kept")]
    assert outcomes == [(held.token, Outcome.SUCCEEDED), (warm.token, Outcome.FAILED)]
    kept = backend.last_success("job:kept", "tasks.charge")
    assert kept is not None and kept.result == {"charged": 42}
    backend.close()


def test_a_client_that_kept_a_collected_file_open_takes_its_key_in_the_new_file(
    backend: FileBackend, clock: FakeClock, tmp_path: Path
) -> None:
    other = FileBackend(str(tmp_path / "locks"), clock=clock)
    assert other.get("job:kept-open") is None  # `other` opens the file and keeps it open
    clock.advance(backend.gc_after + 1)
    assert backend.reap() == []
    assert not (tmp_path / "locks" / "locks" / file_name("job:kept-open")).exists()
    taken = other.try_acquire("job:kept-open", Holder.current(), None)
    assert taken is not None
    by_path = FileBackend(str(tmp_path / "locks"), clock=clock).get("job:kept-open")
    assert by_path is not None and by_path.token == taken.token


def test_a_client_that_kept_a_file_deleted_by_hand_open_sees_the_new_holder(
    backend: FileBackend, clock: FakeClock, tmp_path: Path
) -> None:
    """Found in review: a lock file deleted by hand (an operator, a /tmp cleaner) while a
    process kept it open; the process went on with the deleted file, whose flock no one
    else takes, and granted the key held in the new file (two holders at once)."""
    lease = backend.try_acquire("job:by-hand", Holder.current(), None)
    assert lease is not None
    backend.release(lease, Outcome.SUCCEEDED)  # `backend` keeps the file open
    (tmp_path / "locks" / "locks" / file_name("job:by-hand")).unlink()
    other = FileBackend(str(tmp_path / "locks"), clock=clock)
    held = other.try_acquire("job:by-hand", Holder.current(), None)
    assert held is not None
    assert backend.try_acquire("job:by-hand", Holder.current(), None) is None
    assert backend.get("job:by-hand") == held


def test_a_file_whose_collector_died_before_the_unlink_is_free_and_keeps_its_fence(
    backend: FileBackend, clock: FakeClock, tmp_path: Path
) -> None:
    lease = backend.try_acquire("job:half-collected", Holder.current(), None)
    assert lease is not None
    backend.release(lease, Outcome.SUCCEEDED)
    path = tmp_path / "locks" / "locks" / file_name("job:half-collected")
    # What reap() leaves when killed between marking the file collected and unlinking it.
    mark = {"key": "job:half-collected", "fence": lease.fence, "collected": True}
    path.write_text(json.dumps(mark))
    other = FileBackend(str(tmp_path / "locks"), clock=clock)  # nothing cached
    again = other.try_acquire("job:half-collected", Holder.current(), None)
    assert again is not None and again.fence == lease.fence + 1
    assert backend.try_acquire("job:half-collected", Holder.current(), None) is None


def test_a_forked_child_never_takes_a_token_its_parent_takes(backend: FileBackend) -> None:
    first = backend.try_acquire("job:token-parent", Holder.current(), None)
    assert first is not None
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report the token of its next lease
        code = 0
        try:
            lease = backend.try_acquire("job:token-child", Holder.current(), None)
            os.write(writer, b"" if lease is None else lease.token.encode())
        except BaseException:
            code = 5
        os._exit(code)
    os.close(writer)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with os.fdopen(reader, "rb") as child:
        child_token = child.read().decode()
    mine = backend.try_acquire("job:token-parent-2", Holder.current(), None)
    assert mine is not None and len(child_token) == 32
    assert child_token != mine.token


def test_a_descriptor_in_use_is_never_closed_by_another_threads_eviction(tmp_path: Path) -> None:
    # A clock that holds the first acquire of job:slow inside its step (its file locked and
    # in use) while another thread opens more keys than the descriptor cache keeps.
    inside, go_on = threading.Event(), threading.Event()
    slow = threading.current_thread()

    def clock() -> float:
        if threading.current_thread() is slow and not inside.is_set():
            inside.set()
            go_on.wait(30)
        return time.time()

    backend = FileBackend(str(tmp_path / "locks"), clock=clock)
    busy = backend._files.get().stripe("job:slow")  # its keys would wait for job:slow

    def others() -> None:
        inside.wait(30)
        keys = [f"job:other-{n}" for n in range(2000)]
        for key in [k for k in keys if backend._files.get().stripe(k) is not busy][:600]:
            lease = backend.try_acquire(key, Holder.current(), None)
            assert lease is not None
            backend.release(lease, Outcome.SUCCEEDED)
        go_on.set()

    thread = threading.Thread(target=others)
    thread.start()
    try:
        lease = backend.try_acquire("job:slow", Holder.current(), None)
    finally:
        go_on.set()
        thread.join()
    assert lease is not None
    fresh = FileBackend(str(tmp_path / "locks"))  # nothing cached
    try:
        current = fresh.get("job:slow")
        assert current is not None and current.token == lease.token
        assert all(fresh.get(f"job:other-{n}") is None for n in range(2000))
    finally:
        fresh.close()
        backend.close()  # the descriptors it keeps (256)
