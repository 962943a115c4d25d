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
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

from celery_dlock import critical
from celery_dlock.backends.file.history import Segment, open_private
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


class CorruptFile(BackendError):
    """A key's lock file that cannot be read as its state (left as it is)."""


class Local:
    """One backend's open files in one process, made by ``ProcessLocal``: the descriptor
    cache of lock files, the stripe mutexes, the parse memo and the history segment."""

    __slots__ = (
        "evicted",
        "fds",
        "locks_dir",
        "memo",
        "mutex",
        "pid",
        "segment",
        "stripes",
        "url",
    )

    def __init__(self, locks_dir: str, url: str, segment: Segment) -> None:
        self.pid = os.getpid()
        self.locks_dir = locks_dir
        self.url = url
        self.segment = segment
        self.mutex = threading.Lock()
        # flock belongs to an open file description, which all our threads share through
        # the descriptor cache: a second thread's flock would succeed at once. One mutex
        # per stripe of keys keeps our own threads apart; flock keeps processes apart.
        # Reentrant for its owner check: see Locked.__enter__.
        self.stripes = [threading.RLock() for _ in range(_STRIPES)]
        self.fds: OrderedDict[str, int] = OrderedDict()
        #: Descriptors evicted from ``fds`` while their stripe was held: closed later.
        self.evicted: list[tuple[str, int]] = []
        self.memo: dict[str, Memo] = {}

    def stripe(self, key: str) -> Any:
        return self.stripes[hash(key) % _STRIPES]

    def open(self, key: str) -> int:
        """An open descriptor of ``key``'s lock file, cached, created if absent; the caller
        holds the key's stripe mutex while it uses the descriptor.

        Only eviction closes a cached descriptor, and never one of a key whose stripe is
        held: it may be in use (a key of the stripe takes its descriptor with the stripe
        held, under ``mutex``, so one taken after the check finds it evicted).
        """
        fd = self.fds.get(key)
        if fd is not None:  # without ``mutex``: each step is atomic, and the stripe is held
            try:  # noqa: SIM105 - contextlib.suppress costs a call on the hot path
                self.fds.move_to_end(key)
            except KeyError:  # evicted meanwhile: closed only once the stripe is free
                pass
            return fd
        with self.mutex:
            fd = self.fds.get(key)
            if fd is not None:
                return fd
            path = os.path.join(self.locks_dir, file_name(key))
            try:
                fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
            except OSError as exc:
                raise BackendError(f"cannot open lock file {path}: {exc}", self.url) from exc
            self.fds[key] = fd
            if len(self.fds) > _OPEN_FILES:
                self.evicted.append(self.fds.popitem(last=False))
                self._close_evicted()
            return fd

    def _close_evicted(self) -> None:
        kept = []
        for key, fd in self.evicted:
            stripe = self.stripe(key)
            if not stripe.acquire(blocking=False):  # another thread's: it may use ``fd``
                kept.append((key, fd))
                continue
            try:  # free, or this thread's, which is at another key: ``fd`` is unused
                os.close(fd)
            finally:
                stripe.release()
        self.evicted = kept

    def drop(self, key: str, fd: int) -> None:
        """Close ``fd``, ``key``'s, whose file was deleted (the caller holds its stripe)."""
        with self.mutex:
            if self.fds.get(key) == fd:
                del self.fds[key]
            elif (key, fd) in self.evicted:  # evicted while in use: not to be closed twice
                self.evicted.remove((key, fd))
            os.close(fd)

    def close(self) -> None:
        """Close the descriptors no thread is using, and the history segment."""
        with self.mutex:
            while self.fds:  # evicted first, then closed unless in use: see ``open``
                self.evicted.append(self.fds.popitem(last=False))
            self._close_evicted()
        self.segment.close()

    def __del__(self) -> None:
        # A backend dropped unclosed: its descriptors go with it (a process that made and
        # dropped backends kept hundreds open), in the process that opened them only: a
        # forked child closed its copies at the fork, and their numbers may be reused.
        if self.pid == os.getpid() and not sys.is_finalizing():
            self.close()

    def close_inherited(self) -> None:
        """In a forked child, close the copies of the parent's descriptors.

        The child shares the parent's open file descriptions, and with them the flocks: a
        copy left open would keep a flock held after the parent dies. A close never unlocks
        while the parent keeps its own descriptor open.
        """
        segment = [self.segment.fd] if self.segment.fd >= 0 else []
        for fd in [*self.fds.values(), *(fd for _, fd in self.evicted), *segment]:
            with contextlib.suppress(OSError):
                os.close(fd)


class Locked:
    """A key's lock file under its stripe mutex and ``flock`` for a ``with`` block, and its
    state as read there (``with backend._locked(key) as state``); changes go through
    :meth:`write`, and the records of a change are appended to ``segment`` under the same
    flock. One object, entered with one method: this is the hot path.

    The parse of the bytes this process last wrote is remembered (``Local.memo``): the
    usual release follows our own acquire and then needs no JSON decoding. The memo is
    keyed by the exact bytes, so it can never disagree with a fresh parse.

    A file that ``reap()`` collects is first marked collected (:meth:`mark_collected`)
    under its flock, then unlinked; every step also checks that its file is still linked
    (one ``fstat``), so a file deleted by hand is noticed too.
    """

    __slots__ = (
        "fd", "fence", "floor", "key", "lease", "lease_json", "local", "mutex", "operation",
        "segment", "size", "spill",
    )  # fmt: skip

    def __init__(self, local: Local, key: str, operation: int, floor: Callable[[], int]) -> None:
        self.local = local
        self.key = key
        self.operation = operation
        self.floor = floor
        self.mutex = local.stripes[hash(key) % _STRIPES]  # local.stripe(key), inline
        self.segment = local.segment
        self.fd = -1

    def __enter__(self) -> Locked:
        # A soft time limit held back until __exit__ has let go (a cut on its way in would
        # leave the flock held) and the change and its records are both written.
        critical.enter()
        local, key, mutex = self.local, self.key, self.mutex
        try:
            mutex.acquire()
            while True:
                fd = self.fd = local.open(key)
                try:
                    fcntl.flock(fd, self.operation)
                except OSError as exc:
                    message = f"cannot lock the file of {key!r}: {exc}"
                    raise BackendError(message, local.url) from exc
                # Deleted since we opened it, by reap() or by hand (a /tmp cleaner, an
                # operator): its flock is no one else's, so the new file must be used.
                if os.fstat(fd).st_nlink > 0:
                    data = os.pread(fd, PAGE, 0)
                    self.size = len(data)
                    memo = local.memo.get(key)
                    if memo is not None and memo[0] == data:  # the usual case, inline
                        _, self.fence, self.lease, self.lease_json, self.spill = memo
                        return self
                    if self._read(data):
                        return self
                # Deleted after we opened it (or marked collected): open the new one.
                fcntl.flock(fd, fcntl.LOCK_UN)
                self.fd = -1
                local.drop(key, fd)
        except BaseException:
            # An exception can come between any two steps (a signal's handler raises it: a
            # Celery soft time limit), after the stripe or the flock was taken and before
            # the next statement: what this thread holds is known by the stripe's owner.
            if mutex._is_owned():  # type: ignore[attr-defined]  # the C RLock's (Condition uses it)
                if self.fd >= 0:  # a flock not taken yet: unlocking it changes nothing
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
                mutex.release()
            critical.leave()
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.mutex.release()
            critical.leave()

    def _read(self, data: bytes) -> bool:
        """Take the state from ``data``, the file's first page, which is not the state this
        process last wrote; False if the file was collected (deleted)."""
        self.lease = None
        self.lease_json = None
        self.spill = 0  # the spill area the state is in (0: none, it is in the first page)
        if not data.strip():
            self.fence = self.floor()
            return True
        try:
            return self._parse(json.loads(data))
        except (ValueError, KeyError, TypeError) as exc:
            if self._deleted():  # a corrupt file deleted by hand: open the new one
                return False
            path = os.path.join(self.local.locks_dir, file_name(self.key))
            raise CorruptFile(
                f"the lock file {path} of {self.key!r} is corrupt ({type(exc).__name__}: "
                f"{exc}); it was not changed: restore it, or delete it if no process holds "
                "the key",
                self.local.url,
            ) from exc

    def _parse(self, state: dict[str, Any]) -> bool:
        if "spill" in state:
            self.spill, length = (int(n) for n in state["spill"])
            if self.spill not in (PAGE, PAGE + SPILL) or not 0 < length <= SPILL:
                raise ValueError(f"bad spill area {state['spill']!r}")
            state = json.loads(os.pread(self.fd, length, self.spill))
        if state["key"] != self.key:
            raise ValueError(f"it holds the state of the key {state['key']!r}")
        self.fence = int(state["fence"])
        if state.get("collected"):
            # Still linked: the collector died between the mark and the unlink. A free
            # state, its fence kept (the fence floor holds it too).
            return not self._deleted()
        if state["lease"] is not None:
            self.lease = Lease.from_dict(state["lease"])
            if self.lease.key != self.key:
                raise ValueError(f"it holds a lease on the key {self.lease.key!r}")
        return True

    def _deleted(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def write(self, fence: int, lease: Lease | None) -> None:
        lease_json = None if lease is None else lease.to_json(ensure_ascii=False)
        key = _encode_key(self.key)
        text = f'{{"key":{key},"fence":{fence},"lease":{lease_json or "null"}}}'
        data = text.encode("utf-8", "surrogatepass")
        spill = 0
        if len(data) > PAGE:
            if len(data) > SPILL:
                raise BackendError(
                    f"the state of {self.key!r} takes {len(data)} bytes, over {SPILL}",
                    self.local.url,
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
        memo = self.local.memo
        if len(memo) >= _OPEN_FILES:
            memo.clear()
        memo[self.key] = (data, fence, lease, lease_json, spill)
        self.spill = spill
        self.size = len(data)
        self.fence = fence
        self.lease = lease
        self.lease_json = lease_json

    def mark_collected(self) -> None:
        """Mark the file collected, just before ``reap()`` unlinks it: a process that has it
        open then opens the new file (see the class docstring). Never remembered in the
        memo: a process never takes the mark for a state it wrote."""
        text = f'{{"key":{_encode_key(self.key)},"fence":{self.fence},"collected":true}}'
        self._pwrite(text.encode("utf-8", "surrogatepass").ljust(self.size), 0, "lock file")
        self.local.memo.pop(self.key, None)

    def _pwrite(self, data: bytes, offset: int, what: str) -> None:
        try:
            written = os.pwrite(self.fd, data, offset)
        except OSError as exc:  # ENOSPC, EIO...: nothing was written, the old state stands
            message = f"cannot write the {what} of {self.key!r}: {exc}"
            raise BackendError(message, self.local.url) from exc
        if written != len(data):
            raise BackendError(
                f"the {what} of {self.key!r} took {written} of {len(data)} bytes (is the "
                "disk full?): "
                + ("the old state stands" if offset else "it may be corrupt until rewritten"),
                self.local.url,
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
    fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        floor = int(os.pread(fd, 64, 0) or b"0")
        if fence > floor:
            os.pwrite(fd, str(fence).encode().ljust(20), 0)
            os.fsync(fd)
    finally:
        os.close(fd)


def keys_in(locks_dir: str) -> Iterator[str]:
    """Keys of every state file in ``locks_dir`` (read from long, hashed names)."""
    for name in os.listdir(locks_dir):
        if "~" not in name:
            yield unquote(name)
            continue
        try:
            with open(os.path.join(locks_dir, name), "rb") as f:
                key = str(json.loads(f.read(PAGE))["key"])
        except (FileNotFoundError, ValueError, KeyError):
            continue  # deleted by reap(), or an empty file not yet written
        yield key
