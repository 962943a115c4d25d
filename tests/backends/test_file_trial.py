"""The file store tried as a demanding user would, on real files: a lock file corrupted by
hand, and the largest lease the API allows (a 1 KiB key with 4 KiB of metadata)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from celery_dlock import BackendError, ConfigurationError, Holder, Outcome, backend_from_url
from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.file.state import PAGE
from celery_dlock.backends.naming import file_name
from celery_dlock.records import METADATA_LIMIT

KEY = "job:hand"


def _lock_file(directory: Path, key: str) -> Path:
    return directory / "locks" / file_name(key)


def _truncated(text: str) -> str:
    return text[: len(text) // 2]


def _other_key(text: str) -> str:
    return text.replace(json.dumps(KEY), json.dumps("job:other"))


def _other_lease(text: str) -> str:
    state = json.loads(text)
    state["lease"]["key"] = "job:other"
    return json.dumps(state)


@pytest.mark.parametrize(
    "corrupt",
    [_truncated, _other_key, _other_lease, lambda text: "\0" * len(text)],
    ids=["truncated", "another key's state", "another key's lease", "zeroed"],
)
def test_a_lock_file_corrupted_by_hand_is_an_error_naming_the_file(
    tmp_path: Path, corrupt: Callable[[str], str]
) -> None:
    # Before: the message named the key, not the file; a state of another key (a file
    # copied by hand) was read as this key's, and a second holder was granted.
    holder = FileBackend(str(tmp_path))
    lease = holder.try_acquire(KEY, Holder.current(), None)
    assert lease is not None
    path = _lock_file(tmp_path, KEY)
    spoilt = corrupt(path.read_text()).encode()
    path.write_bytes(spoilt)
    other = FileBackend(str(tmp_path))  # another process's view: nothing cached
    for attempt in (
        lambda: other.try_acquire(KEY, Holder.current(), None),
        lambda: other.get(KEY),
        lambda: other.release(lease, Outcome.SUCCEEDED),
    ):
        with pytest.raises(BackendError, match=f"lock file {path} of 'job:hand' is corrupt"):
            attempt()
    assert path.read_bytes() == spoilt  # left alone
    assert other.history(key=KEY) == []


def _largest_holder(n: int) -> Holder:
    """A holder with the most metadata a lease may carry (``METADATA_LIMIT`` bytes)."""
    filler = METADATA_LIMIT - len(json.dumps({"n": n, "x": ""}, separators=(",", ":")))
    return Holder.current(task_name="tasks.big", metadata={"n": n, "x": "m" * filler})


def test_the_largest_lease_the_api_allows_is_kept_read_and_recorded(tmp_path: Path) -> None:
    # Before: a state over one page was refused ("does not fit in one page"): metadata
    # of ~4 KiB, or ~1.8 KiB with a 1 KiB key, could never be locked on the file store.
    key = "ü" * 512  # 1024 bytes of UTF-8, twice in the state
    backend = FileBackend(str(tmp_path))
    other = FileBackend(str(tmp_path))  # another process's view: nothing cached
    path = _lock_file(tmp_path, key)
    records = []
    for n in range(3):  # big, small, big: the spill area alternates and is left behind
        holder = _largest_holder(n) if n != 1 else Holder.current(task_name="tasks.big")
        lease = backend.try_acquire(key, holder, 60.0)
        assert lease is not None and lease.fence == n + 1
        assert other.get(key) == lease
        assert other.try_acquire(key, Holder.current(), None) is None
        renewed = other.renew(lease, 120.0)
        assert renewed is not None and backend.get(key) == renewed
        record = backend.release(renewed, Outcome.SUCCEEDED)
        assert record is not None and record.lease == renewed
        records.append(record)
        assert other.get(key) is None
    assert path.stat().st_size > PAGE
    assert other.history(key=key, limit=None) == records[::-1]
    assert records[2].lease.holder.metadata == _largest_holder(2).metadata


def test_a_spilled_state_stands_whatever_the_unused_spill_area_holds(tmp_path: Path) -> None:
    # A writer killed while writing a spill area leaves that area half written; the first
    # page still points at the other one.
    key = "job:spill"
    backend = FileBackend(str(tmp_path))
    lease = backend.try_acquire(key, _largest_holder(0), None)
    assert lease is not None
    path = _lock_file(tmp_path, key)
    header = json.loads(path.read_bytes()[:PAGE])
    used, length = header["spill"]
    unused = PAGE + (PAGE + 16384) - used
    with open(path, "r+b") as f:
        f.seek(unused)
        f.write(b'{"key": "torn' + b"x" * 9000)
    other = FileBackend(str(tmp_path))
    assert other.get(key) == lease
    with open(path, "r+b") as f:  # the area in use, spoilt by hand: an error, not a grant
        f.seek(used + length // 2)
        f.write(b"\0" * 16)
    third = FileBackend(str(tmp_path))
    with pytest.raises(BackendError, match=f"lock file {path} of 'job:spill' is corrupt"):
        third.try_acquire(key, Holder.current(), None)
    assert os.path.getsize(path) >= used + length


@pytest.mark.parametrize("gc_after", ["-1", "nan", "inf"])
def test_a_bad_gc_after_is_refused_when_the_url_is_read(tmp_path: Path, gc_after: str) -> None:
    """A negative or non-finite ``gc_after`` was taken (-1 collected every free file at once,
    nan none): it is refused, naming the option."""
    with pytest.raises(ConfigurationError, match="gc_after"):
        backend_from_url(f"file://{tmp_path}/locks?gc_after={gc_after}")


def test_the_janitor_reaps_the_other_keys_past_a_corrupt_lock_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the first corrupt file the janitor met failed the whole run, every run, and
    # the dead leases of every other key stayed held until the file was repaired.
    backend = FileBackend(str(tmp_path))
    keys = [f"job:dead:{n}" for n in range(5)]
    dead = [backend.try_acquire(key, Holder.current(), 0.05) for key in keys]
    assert all(dead) and backend.try_acquire(KEY, Holder.current(), None) is not None
    path = _lock_file(tmp_path, KEY)
    spoilt = _truncated(path.read_text()).encode()
    path.write_bytes(spoilt)
    # Another process's view (nothing cached), a minute later: the dead leases' ttl ran out.
    janitor = FileBackend(str(tmp_path), clock=lambda: time.time() + 60)
    with caplog.at_level("ERROR", logger="celery_dlock.file"):
        cleared = janitor.reap(limit=100)
    assert sorted(record.key for record in cleared) == keys
    for lease in dead:
        assert lease is not None and janitor.get(lease.key) is None
        assert [r.outcome for r in janitor.history(key=lease.key)] == [Outcome.EXPIRED]
    said = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "reap_skipped"]
    assert len(said) == 1 and str(path) in said[0] and "corrupt" in said[0]
    assert path.read_bytes() == spoilt  # left alone
