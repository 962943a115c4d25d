"""The per-key lock file of the file backend: its state record, read and written under
``flock``, and this process's cache of open lock files.

A key's file holds ``{"key", "fence", "lease"}`` as JSON. Every change happens under an
exclusive ``flock`` on that file and is one ``pwrite`` of less than a page at offset 0,
padded with spaces, so a killed writer leaves the old state or the new one, never a torn one.

A state longer than a page (a long key with large lease metadata) is written first to
whichever of two spill areas after the first page the current state does not use, then
the first page is rewritten to point at it (``{"key", "fence", "spill": [offset, length],
"write"}``): a writer killed mid-way (a kill can cut a write of several pages short)
leaves the first page, and so the old state, whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable

from celery_dlock.backends.file.history import Segment
from celery_dlock.backends.naming import file_name
from celery_dlock.errors import BackendError
from celery_dlock.records import Lease, new_token

PAGE = 4096
#: The longest state a spill area holds (a key of 1 KiB and metadata of 4 KiB fit).
SPILL = 16384
#: A key as a JSON string, as ``history.encode`` gives it (UTF-8, not escaped).
_encode_key = json.encoder.encode_basestring
_OPEN_FILES = 256
_STRIPES = 64

#: The last state bytes this process wrote for a key, with their parse.
Memo = tuple[bytes, int, Lease | None, str | None, int]


class Local:
    """One backend's open files in one process, made by ``ProcessLocal``: the descriptor
    cache of lock files, the stripe mutexes, the parse memo and the history segment."""

    __slots__ = ("busy", "fds", "locks_dir", "memo", "mutex", "segment", "stripes", "url")

    def __init__(self, locks_dir: str, url: str, segment: Segment) -> None:
        self.locks_dir = locks_dir
        self.url = url
        self.segment = segment
        self.mutex = threading.Lock()
        # flock belongs to an open file description, which all our threads share through
        # the descriptor cache: a second thread's flock would succeed at once. One mutex
        # per stripe of keys keeps our own threads apart; flock keeps processes apart.
        self.stripes = [threading.Lock() for _ in range(_STRIPES)]
        self.fds: OrderedDict[str, int] = OrderedDict()
        self.busy: dict[int, int] = {}
        self.memo: dict[str, Memo] = {}

    def open(self, key: str) -> int:
        """An open descriptor of ``key``'s lock file, cached, created if absent.

        ``busy`` counts users so that eviction never closes a descriptor in use.
        """
        with self.mutex:
            fd = self.fds.get(key)
            if fd is not None:
                self.fds.move_to_end(key)
            else:
                path = os.path.join(self.locks_dir, file_name(key))
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                except OSError as exc:
                    raise BackendError(f"cannot open lock file {path}: {exc}", self.url) from exc
                self.fds[key] = fd
                while len(self.fds) > _OPEN_FILES:
                    _, old = self.fds.popitem(last=False)
                    if not self.busy.get(old):
                        os.close(old)
            self.busy[fd] = self.busy.get(fd, 0) + 1
            return fd

    def done(self, key: str, fd: int, *, drop: bool = False) -> None:
        """Stop using ``fd``; ``drop`` forgets it (its file was deleted)."""
        with self.mutex:
            count = self.busy.pop(fd, 1) - 1
            if count > 0:
                self.busy[fd] = count
            if drop and self.fds.get(key) == fd:
                del self.fds[key]
            if count <= 0 and self.fds.get(key) != fd:
                os.close(fd)

    def close(self) -> None:
        """Close the descriptors no thread is using, and the history segment."""
        with self.mutex:
            for key, fd in list(self.fds.items()):
                if not self.busy.get(fd):
                    del self.fds[key]
                    os.close(fd)
        self.segment.close()

    def close_inherited(self) -> None:
        """In a forked child, close the copies of the parent's descriptors.

        The child shares the parent's open file descriptions, and with them the flocks: a
        copy left open would keep a flock held after the parent dies. A close never unlocks
        while the parent keeps its own descriptor open.
        """
        segment = [self.segment.fd] if self.segment.fd >= 0 else []
        for fd in [*self.fds.values(), *segment]:
            with contextlib.suppress(OSError):
                os.close(fd)


class Locked:
    """Holds a key's stripe mutex and file lock for a ``with`` block (a class: this is the
    hot path, and a generator-based context manager costs twice as much)."""

    __slots__ = ("fd", "floor", "key", "local", "mutex", "operation")

    def __init__(self, local: Local, key: str, operation: int, floor: Callable[[], int]) -> None:
        self.local = local
        self.key = key
        self.operation = operation
        self.floor = floor
        self.mutex = local.stripes[hash(key) % _STRIPES]
        self.fd = -1

    def __enter__(self) -> State:
        # One method, not two: this is the hot path (see the class docstring).
        local, key = self.local, self.key
        self.mutex.acquire()
        try:
            while True:
                fd = local.open(key)
                try:
                    fcntl.flock(fd, self.operation)
                except OSError as exc:
                    local.done(key, fd)
                    message = f"cannot lock the file of {key!r}: {exc}"
                    raise BackendError(message, local.url) from exc
                if os.fstat(fd).st_nlink > 0:
                    break
                # reap() deleted this file after we opened it: open the new one.
                fcntl.flock(fd, fcntl.LOCK_UN)
                local.done(key, fd, drop=True)
            self.fd = fd
            try:
                return State(fd, key, local, self.floor)
            except BaseException:
                self._unlock()
                raise
        except BaseException:
            self.mutex.release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._unlock()
        finally:
            self.mutex.release()

    def _unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.local.done(self.key, self.fd)


class State:
    """A key's lock file as read under its flock, with this process's history segment
    (records of the change are appended to it under the same flock).

    The parse of the bytes this process last wrote is remembered (``Local.memo``): the
    usual release follows our own acquire and then needs no JSON decoding. The memo is
    keyed by the exact bytes, so it can never disagree with a fresh parse.
    """

    __slots__ = (
        "fd", "fence", "key", "lease", "lease_json", "memo", "segment", "size", "spill", "url",
    )  # fmt: skip

    def __init__(self, fd: int, key: str, local: Local, floor: Callable[[], int]) -> None:
        self.fd = fd
        self.key = key
        self.memo = local.memo
        self.segment = local.segment
        data = os.pread(fd, PAGE, 0)
        self.size = len(data)
        self.lease: Lease | None = None
        self.lease_json: str | None = None
        self.url = local.url
        self.spill = 0  # the spill area the state is in (0: none, it is in the first page)
        memo = self.memo.get(key)
        if memo is not None and memo[0] == data:
            _, self.fence, self.lease, self.lease_json, self.spill = memo
            return
        if not data.strip():
            self.fence = floor()
            return
        try:
            state = json.loads(data)
            if "spill" in state:
                self.spill, length = (int(n) for n in state["spill"])
                if self.spill not in (PAGE, PAGE + SPILL) or not 0 < length <= SPILL:
                    raise ValueError(f"bad spill area {state['spill']!r}")
                state = json.loads(os.pread(fd, length, self.spill))
            if state["key"] != key:
                raise ValueError(f"it holds the state of the key {state['key']!r}")
            self.fence = int(state["fence"])
            if state["lease"] is not None:
                self.lease = Lease.from_dict(state["lease"])
                if self.lease.key != key:
                    raise ValueError(f"it holds a lease on the key {self.lease.key!r}")
        except (ValueError, KeyError, TypeError) as exc:
            path = os.path.join(local.locks_dir, file_name(key))
            raise BackendError(
                f"the lock file {path} of {key!r} is corrupt ({type(exc).__name__}: {exc}); "
                "it was not changed: restore it, or delete it if no process holds the key",
                local.url,
            ) from exc

    def write(self, fence: int, lease: Lease | None) -> None:
        lease_json = None if lease is None else lease.to_json(ensure_ascii=False)
        key = _encode_key(self.key)
        text = f'{{"key":{key},"fence":{fence},"lease":{lease_json or "null"}}}'
        data = text.encode("utf-8", "surrogatepass")
        spill = 0
        if len(data) > PAGE:
            if len(data) > SPILL:
                raise BackendError(
                    f"the state of {self.key!r} takes {len(data)} bytes, over {SPILL}", self.url
                )
            spill = PAGE + SPILL if self.spill == PAGE else PAGE
            self._pwrite(data, spill, "spill area of the lock file")
            # A fresh nonce: the first page never repeats, so the memo keyed by it is exact.
            header = f'"spill":[{spill},{len(data)}],"write":"{new_token()}"'
            data = f'{{"key":{key},"fence":{fence},{header}}}'.encode("utf-8", "surrogatepass")
            self.size = PAGE  # the whole first page: what lies after it is not JSON
        # Pad to the old length: the write then replaces every old byte in one pwrite.
        data = data.ljust(self.size)
        self._pwrite(data, 0, "lock file")
        if len(self.memo) >= _OPEN_FILES:
            self.memo.clear()
        self.memo[self.key] = (data, fence, lease, lease_json, spill)
        self.spill = spill
        self.size = len(data)
        self.fence = fence
        self.lease = lease
        self.lease_json = lease_json

    def _pwrite(self, data: bytes, offset: int, what: str) -> None:
        try:
            written = os.pwrite(self.fd, data, offset)
        except OSError as exc:  # ENOSPC, EIO...: nothing was written, the old state stands
            raise BackendError(f"cannot write the {what} of {self.key!r}: {exc}", self.url) from exc
        if written != len(data):
            raise BackendError(
                f"the {what} of {self.key!r} took {written} of {len(data)} bytes (is the "
                "disk full?): "
                + ("the old state stands" if offset else "it may be corrupt until rewritten"),
                self.url,
            )


def read_floor(path: str) -> int:
    """The fence floor in ``path``: the highest fence of any key whose file was collected."""
    try:
        with open(path, "rb") as f:
            return int(f.read() or b"0")
    except FileNotFoundError:
        return 0


def raise_floor(path: str, fence: int) -> None:
    """Raise the fence floor in ``path`` to ``fence`` (never lower it), durably."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        floor = int(os.pread(fd, 64, 0) or b"0")
        if fence > floor:
            os.pwrite(fd, str(fence).encode().ljust(20), 0)
            os.fsync(fd)
    finally:
        os.close(fd)
