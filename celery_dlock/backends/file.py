"""Locks in a local directory: the default when no backend is configured.

URL
    ``file:///var/lib/dlock`` (an absolute path; created with mode 0700 if missing).

Options
    ``fsync`` (bool, default false): fsync each history record before the release returns.
    ``gc_after`` (seconds, default 86400): ``reap()`` deletes the files of keys free for that
    long, keeping their fences in ``fence-floor`` so fences still only increase.
    ``FileBackend(..., clock=...)`` takes the clock that judges ``ttl`` expiry (tests).

Layout
    ``locks/<name>``: one file per key, its state as JSON ``{"key", "fence", "lease"}``.
    Every change happens under an exclusive ``flock`` on that file and is one ``pwrite``
    of less than a page at offset 0, padded with spaces, so a killed writer leaves the old
    state or the new one, never a torn one. ``<name>`` is the key percent-encoded (only
    ``A-Z a-z 0-9 _ : -`` stay), so ``/``, ``..`` and ``%`` cannot escape or collide; a
    name over 200 bytes keeps a prefix and adds the key's SHA-256.
    ``history/<YYYY-MM-DD>.jsonl``: records, one JSON line each, appended by release day
    (UTC); pruning deletes whole days.
    ``success/<name>``: the last success of each (key, task name), for ``once``.

Guarantees
    crash: a holder killed on this host is provably gone once its pid is free or belongs
    to a process with another start time (``/proc``); the next acquire takes the key over
    and records ``disconnected``. A holder on another host, or in another pid namespace,
    is never judged gone: only its ``ttl`` (if it set one) frees the key. Never by file age.
    clock skew: ``ttl`` expiry uses this host's clock; processes of one host share it.
    partition: not for network filesystems; locks are not shared across hosts.
    durability: state and history survive process crashes; after a power loss the last
    writes may be missing unless ``fsync`` is on (history only; lock state dies with its
    holders anyway).
    wait: woken by the kernel (inotify on the key's file, pidfd on the holder's process).

Install
    nothing: Linux (or any POSIX with ``/proc`` and ``flock``); no driver.
"""

from __future__ import annotations

import calendar
import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import select
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

from celery_dlock.backends.base import (
    Capabilities,
    Clock,
    LockBackend,
    expired,
    expiry,
    flag,
    remembered,
    retried,
    url_options,
    validate_ttl,
    wall_clock,
)
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token

__all__ = ["FileBackend", "file_name"]

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_:-")
_NAME_LIMIT = 200
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_OPEN_FILES = 256
_STRIPES = 64
_PAGE = 4096
_DAY = 86400.0


def file_name(text: str) -> str:
    """A file name for ``text`` that is safe and unique: percent-encoded, or for long
    text a prefix, ``~`` (which encoding never produces) and the SHA-256 of the text."""
    raw = text.encode("utf-8")
    name = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(name) <= _NAME_LIMIT:
        return name
    return f"{name[:120]}~{hashlib.sha256(raw).hexdigest()}"


class FileBackend(LockBackend):
    """Locks as files in one local directory; liveness is the holder's process."""

    name = "file"
    capabilities: ClassVar[Capabilities] = Capabilities(
        liveness="process",
        push_wait=True,
        cross_process=True,
        cross_host=False,
        durable_history=True,
        server_clock=False,
    )

    def __init__(
        self,
        directory: str,
        *,
        fsync: bool = False,
        gc_after: float = _DAY,
        clock: Clock | None = None,
    ) -> None:
        if not os.path.isabs(directory):
            raise ConfigurationError(
                f"the file backend needs an absolute directory, got {directory!r} "
                "(a URL looks like file:///var/lib/dlock)"
            )
        self.directory = os.path.normpath(directory)
        self.url = f"file://{self.directory}"
        self.fsync = fsync
        self.gc_after = float(gc_after)
        self._clock: Clock = clock or wall_clock
        self._locks_dir = os.path.join(self.directory, "locks")
        self._history_dir = os.path.join(self.directory, "history")
        self._success_dir = os.path.join(self.directory, "success")
        for path in (self.directory, self._locks_dir, self._history_dir, self._success_dir):
            _make_private_dir(path)
        self._reset()
        _INSTANCES.add(self)

    def _reset(self) -> None:
        """Fresh in-process state; also run in a forked child (``_after_fork``)."""
        self._mutex = threading.Lock()
        # flock belongs to an open file description, which all our threads share through
        # the descriptor cache: a second thread's flock would succeed at once. One mutex
        # per stripe of keys keeps our own threads apart; flock keeps processes apart.
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._busy: dict[int, int] = {}
        self._segment: tuple[int, int] | None = None
        self._memo: dict[str, tuple[bytes, int, Lease | None, str | None]] = {}

    def _after_fork(self) -> None:
        # The child shares the parent's open file descriptions, and with them the flocks:
        # close its copies (a close never unlocks while the parent keeps its own open).
        for fd in [*self._fds.values(), *([self._segment[1]] if self._segment else [])]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._reset()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> FileBackend:
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ConfigurationError(
                f"file backend URL {url!r} has a host part {parts.netloc!r}: use three "
                "slashes and an absolute path, file:///var/lib/dlock"
            )
        path = unquote(parts.path)
        if not path or path == "/":
            raise ConfigurationError(f"file backend URL {url!r} names no directory")
        clock = options.pop("clock", None)
        known: dict[str, Callable[[str], Any]] = {"fsync": flag, "gc_after": float}
        return cls(path, clock=clock, **url_options("file", parts.query, known, options))

    # -- files -----------------------------------------------------------------------

    def _fd(self, key: str) -> int:
        """An open descriptor of ``key``'s state file, cached, created if absent.

        ``_busy`` counts users so that eviction never closes a descriptor in use.
        """
        with self._mutex:
            fd = self._fds.get(key)
            if fd is not None:
                self._fds.move_to_end(key)
            else:
                path = os.path.join(self._locks_dir, file_name(key))
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                except OSError as exc:
                    raise BackendError(f"cannot open lock file {path}: {exc}", self.url) from exc
                self._fds[key] = fd
                while len(self._fds) > _OPEN_FILES:
                    _, old = self._fds.popitem(last=False)
                    if not self._busy.get(old):
                        os.close(old)
            self._busy[fd] = self._busy.get(fd, 0) + 1
            return fd

    def _done(self, key: str, fd: int, *, drop: bool = False) -> None:
        """Stop using ``fd``; ``drop`` forgets it (its file was deleted)."""
        with self._mutex:
            count = self._busy.pop(fd, 1) - 1
            if count > 0:
                self._busy[fd] = count
            if drop and self._fds.get(key) == fd:
                del self._fds[key]
            if count <= 0 and self._fds.get(key) != fd:
                os.close(fd)

    def _locked(self, key: str, operation: int = fcntl.LOCK_EX) -> _Locked:
        """``with self._locked(key) as state``: the state of ``key`` under a flock of
        ``operation``; changes go through ``state.write`` inside the block."""
        return _Locked(self, key, operation)

    def _floor(self) -> int:
        """The highest fence of any key whose file ``reap()`` deleted."""
        try:
            with open(os.path.join(self.directory, "fence-floor"), "rb") as f:
                return int(f.read() or b"0")
        except FileNotFoundError:
            return 0

    # -- history -----------------------------------------------------------------------

    def _append(self, record: Record, lease_json: str | None = None) -> None:
        """Append ``record`` to its day's history file: one ``write`` of one line, which
        ``O_APPEND`` keeps whole and in order among processes."""
        day = int(record.released_at // _DAY)
        data = _record_line(record, lease_json)
        try:
            with self._mutex:
                if self._segment is None or self._segment[0] != day:
                    if self._segment is not None:
                        os.close(self._segment[1])
                        self._segment = None
                    name = time.strftime("%Y-%m-%d.jsonl", time.gmtime(day * _DAY))
                    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                    fd = os.open(os.path.join(self._history_dir, name), flags, 0o600)
                    self._segment = (day, fd)
                os.write(self._segment[1], data)
                if self.fsync:
                    os.fsync(self._segment[1])
        except OSError as exc:
            raise BackendError(f"cannot append to the history: {exc}", self.url) from exc
        task_name = remembered(record.outcome, record.result, record.lease.holder.task_name)
        if task_name is not None:
            self._write_success(record, task_name)

    def _write_success(self, record: Record, task_name: str) -> None:
        path = os.path.join(self._success_dir, file_name(f"{record.key}\0{task_name}"))
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        data = json.dumps(record.to_dict(), ensure_ascii=False).encode("utf-8", "surrogatepass")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)

    def _segments(self) -> list[str]:
        names = [n for n in os.listdir(self._history_dir) if n.endswith(".jsonl")]
        return sorted(names, reverse=True)

    # -- the contract ----------------------------------------------------------------

    def try_acquire(
        self, key: str, holder: Holder, ttl: float | None, replace: str | None = None
    ) -> Lease | None:
        ttl = validate_ttl(ttl)
        with self._locked(key) as state:
            now = self._clock()
            current = state.lease
            if current is not None:
                if replace is not None and current.token == replace:
                    ended: Record | None = retried(current, holder, now)
                else:
                    ended = _ended(current, now)
                if ended is None:
                    return None
                self._append(ended, state.lease_json)
            lease = Lease(key, new_token(), state.fence + 1, holder, now, expiry(now, ttl))
            state.write(lease.fence, lease)
            return lease

    def release(
        self,
        lease: Lease,
        outcome: Outcome,
        problem: str | None = None,
        details: str | None = None,
        result: Any = None,
    ) -> Record | None:
        with self._locked(lease.key) as state:
            current = state.lease
            if current is None or current.token != lease.token:
                return None
            now = self._clock()
            if expired(current, now):
                self._append(Record(current, now, Outcome.EXPIRED, "expired"))
                state.write(state.fence, None)
                return None
            record = Record(current, now, Outcome(outcome), problem, details, result)
            self._append(record, state.lease_json)
            state.write(state.fence, None)
            return record

    def add_record(self, record: Record) -> None:
        self._append(record)

    def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        ttl = validate_ttl(ttl)
        with self._locked(lease.key) as state:
            current = state.lease
            if current is None or current.token != lease.token:
                return None
            now = self._clock()
            if expired(current, now):
                self._append(Record(current, now, Outcome.EXPIRED, "expired"))
                state.write(state.fence, None)
                return None
            renewed = Lease(
                current.key,
                current.token,
                current.fence,
                current.holder,
                current.acquired_at,
                expiry(now, ttl),
            )
            state.write(state.fence, renewed)
            return renewed

    def get(self, key: str) -> Lease | None:
        with self._locked(key, fcntl.LOCK_SH) as state:
            return state.lease

    def _keys(self) -> Iterator[str]:
        """Keys of every state file (the key is read from long, hashed names)."""
        for name in os.listdir(self._locks_dir):
            if "~" not in name:
                yield unquote(name)
                continue
            try:
                with open(os.path.join(self._locks_dir, name), "rb") as f:
                    key = str(json.loads(f.read(_PAGE))["key"])
            except (FileNotFoundError, ValueError, KeyError):
                continue  # deleted by reap(), or an empty file not yet written
            yield key

    def leases(self, prefix: str = "") -> list[Lease]:
        found = []
        for key in sorted(self._keys()):
            if key.startswith(prefix):
                lease = self.get(key)
                if lease is not None:
                    found.append(lease)
        return found

    def history(
        self,
        key: str | None = None,
        outcome: Outcome | None = None,
        since: float | None = None,
        limit: int | None = 100,
    ) -> list[Record]:
        first_day = None if since is None else time.strftime("%Y-%m-%d", time.gmtime(since))
        found: list[Record] = []
        for segment in self._segments():
            if first_day is not None and segment[:10] < first_day:
                break
            for record in reversed(self._read_segment(segment)):
                if since is not None and record.released_at < since:
                    continue
                if key is not None and record.key != key:
                    continue
                if outcome is not None and record.outcome != outcome:
                    continue
                found.append(record)
            if limit is not None and len(found) >= limit:
                break
        found.sort(key=lambda record: record.released_at, reverse=True)
        return found if limit is None else found[:limit]

    def _read_segment(self, segment: str) -> list[Record]:
        try:
            with open(os.path.join(self._history_dir, segment), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        records = []
        for line in data.split(b"\n"):
            # The last line may be a record whose append is still under way: skip it.
            with contextlib.suppress(ValueError, KeyError, TypeError):
                records.append(Record.from_dict(json.loads(line)))
        return records

    def last_success(self, key: str, task_name: str) -> Record | None:
        path = os.path.join(self._success_dir, file_name(f"{key}\0{task_name}"))
        try:
            with open(path, "rb") as f:
                return Record.from_dict(json.loads(f.read()))
        except FileNotFoundError:
            return None

    def reap(self, limit: int = 100) -> list[Record]:
        reaped: list[Record] = []
        for key in self._keys():
            if len(reaped) >= limit:
                break
            with self._locked(key) as state:
                current = state.lease
                now = self._clock()
                if current is None:
                    self._collect(state, now)
                    continue
                ended = _ended(current, now)
                if ended is not None:
                    self._append(ended)
                    state.write(state.fence, None)
                    reaped.append(ended)
        return reaped

    def _collect(self, state: _State, now: float) -> None:
        """Delete the free state file of a key unused for ``gc_after`` seconds, raising
        ``fence-floor`` to its fence first so a new file for the key continues above it."""
        if now - os.fstat(state.fd).st_mtime < self.gc_after:
            return
        floor_path = os.path.join(self.directory, "fence-floor")
        fd = os.open(floor_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            floor = int(os.pread(fd, 64, 0) or b"0")
            if state.fence > floor:
                os.pwrite(fd, str(state.fence).encode().ljust(20), 0)
                os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(os.path.join(self._locks_dir, file_name(state.key)))

    def force_release(self, key: str, reason: str) -> Record | None:
        with self._locked(key) as state:
            current = state.lease
            if current is None:
                return None
            record = Record(current, self._clock(), Outcome.FORCED, "forced", reason)
            self._append(record)
            state.write(state.fence, None)
            return record

    def prune_history(self, before: float) -> int:
        pruned = 0
        for segment in self._segments():
            day_end = _day_start(segment[:10]) + _DAY
            if day_end > before:
                continue
            path = os.path.join(self._history_dir, segment)
            with contextlib.suppress(FileNotFoundError):
                with open(path, "rb") as f:
                    pruned += f.read().count(b"\n")
                os.unlink(path)
        return pruned

    def wait(self, key: str, timeout: float) -> None:
        """Sleep until ``key``'s file changes or its holder's process exits, at most
        ``timeout`` seconds. The watch is armed before the state is read, so a release
        between the two is not missed."""
        path = os.path.join(self._locks_dir, file_name(key))
        watch = _Inotify.watch(path)
        waits: list[int] = [] if watch is None else [watch]
        try:
            lease = self.get(key)
            if lease is None or _ended(lease, self._clock()) is not None:
                return
            if lease.expires_at is not None:
                timeout = max(0.0, min(timeout, lease.expires_at - self._clock()))
            process = _watch_process(lease.holder)
            if process is not None:
                waits.append(process)
            if not waits:
                time.sleep(timeout)
                return
            with contextlib.suppress(InterruptedError):
                select.select(waits, [], [], timeout)
        finally:
            for fd in waits:
                os.close(fd)

    def close(self) -> None:
        with self._mutex:
            for key, fd in list(self._fds.items()):
                if not self._busy.get(fd):
                    del self._fds[key]
                    os.close(fd)
            if self._segment is not None:
                os.close(self._segment[1])
                self._segment = None


class _Locked:
    """Holds a key's stripe mutex and file lock for a ``with`` block (a class: this is the
    hot path, and a generator-based context manager costs twice as much)."""

    __slots__ = ("backend", "fd", "key", "mutex", "operation")

    def __init__(self, backend: FileBackend, key: str, operation: int) -> None:
        self.backend = backend
        self.key = key
        self.operation = operation
        self.mutex = backend._stripes[hash(key) % _STRIPES]
        self.fd = -1

    def __enter__(self) -> _State:
        backend, key = self.backend, self.key
        self.mutex.acquire()
        try:
            while True:
                fd = backend._fd(key)
                try:
                    fcntl.flock(fd, self.operation)
                except OSError as exc:
                    backend._done(key, fd)
                    raise BackendError(
                        f"cannot lock the file of {key!r}: {exc}", backend.url
                    ) from exc
                if os.fstat(fd).st_nlink > 0:
                    break
                # reap() deleted this file after we opened it: open the new one.
                fcntl.flock(fd, fcntl.LOCK_UN)
                backend._done(key, fd, drop=True)
            self.fd = fd
            try:
                return _State(fd, key, backend)
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
        self.backend._done(self.key, self.fd)


class _State:
    """A key's state file as read under its flock.

    The parse of the bytes this process last wrote is remembered (``FileBackend._memo``):
    the usual release follows our own acquire and then needs no JSON decoding. The memo is
    keyed by the exact bytes, so it can never disagree with a fresh parse.
    """

    __slots__ = ("backend", "fd", "fence", "key", "lease", "lease_json", "size")

    def __init__(self, fd: int, key: str, backend: FileBackend) -> None:
        self.fd = fd
        self.key = key
        self.backend = backend
        data = os.pread(fd, _PAGE, 0)
        self.size = len(data)
        self.lease: Lease | None = None
        self.lease_json: str | None = None
        memo = backend._memo.get(key)
        if memo is not None and memo[0] == data:
            _, self.fence, self.lease, self.lease_json = memo
            return
        if not data.strip():
            self.fence = backend._floor()
            return
        try:
            state = json.loads(data)
            self.fence = int(state["fence"])
            if state["lease"] is not None:
                self.lease = Lease.from_dict(state["lease"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BackendError(
                f"the lock file of {key!r} is corrupt ({exc}); it was not changed",
                backend.url,
            ) from exc

    def write(self, fence: int, lease: Lease | None) -> None:
        lease_json = None if lease is None else _encode(lease.to_dict())
        text = f'{{"key":{_encode(self.key)},"fence":{fence},"lease":{lease_json or "null"}}}'
        data = text.encode("utf-8", "surrogatepass")
        if len(data) > _PAGE:
            raise BackendError(f"the state of {self.key!r} does not fit in one page", None)
        # Pad to the old length: the write then replaces every old byte in one pwrite.
        data = data.ljust(self.size)
        os.pwrite(self.fd, data, 0)
        memo = self.backend._memo
        if len(memo) >= _OPEN_FILES:
            memo.clear()
        memo[self.key] = (data, fence, lease, lease_json)
        self.size = len(data)
        self.fence = fence
        self.lease = lease
        self.lease_json = lease_json


def _record_line(record: Record, lease_json: str | None) -> bytes:
    """``record`` as one JSON line (the form of ``Record.to_dict``), reusing the lease's
    JSON when the state file already had it encoded."""
    if lease_json is None:
        lease_json = _encode(record.lease.to_dict())
    problem = "null" if record.problem is None else _encode(record.problem)
    details = "null" if record.details is None else _encode(record.details)
    result = "null" if record.result is None else _encode(record.result)
    text = (
        f'{{"lease":{lease_json},"released_at":{record.released_at!r},'
        f'"outcome":"{record.outcome.value}","problem":{problem},"details":{details},'
        f'"result":{result}}}\n'
    )
    return text.encode("utf-8", "surrogatepass")


def _ended(lease: Lease, now: float) -> Record | None:
    """The record that ends ``lease`` if its holder is gone or its time ran out, else None."""
    if lease.holder.is_gone():
        details = f"holder {lease.holder.describe()} is gone"
        return Record(lease, now, Outcome.DISCONNECTED, "disconnected", details)
    if expired(lease, now):
        return Record(lease, now, Outcome.EXPIRED, "expired")
    return None


def _day_start(day: str) -> float:
    return float(calendar.timegm(time.strptime(day, "%Y-%m-%d")))


def _watch_process(holder: Holder) -> int | None:
    """A pidfd that becomes readable when ``holder``'s process exits, if it runs here."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None or holder.is_gone() or holder.host_id == "":
        return None
    try:
        fd: int = pidfd_open(holder.pid)
    except OSError:
        return None
    if holder.is_gone():  # the pid was recycled between the check and the open
        os.close(fd)
        return None
    return fd


class _Inotify:
    """inotify through libc, for a kernel wakeup when a lock file changes."""

    _libc: ClassVar[Any] = None
    # IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_DELETE_SELF
    _MASK = 0x002 | 0x004 | 0x008 | 0x400

    @classmethod
    def watch(cls, path: str) -> int | None:
        """An inotify fd watching ``path``, or None where inotify cannot be had (not
        Linux, the file is gone, the watch limit is reached): the caller then polls."""
        if cls._libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            cls._libc = libc if hasattr(libc, "inotify_init1") else False
        if cls._libc is False:
            return None
        fd = int(cls._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            return None
        if cls._libc.inotify_add_watch(fd, os.fsencode(path), cls._MASK) < 0:
            os.close(fd)
            return None
        return fd


_INSTANCES: weakref.WeakSet[FileBackend] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for backend in list(_INSTANCES):
        backend._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _make_private_dir(path: str) -> None:
    try:
        os.makedirs(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise ConfigurationError(f"{path} exists and is not a directory") from None
        return
    except OSError as exc:
        raise ConfigurationError(f"cannot create lock directory {path}: {exc}") from exc
    os.chmod(path, 0o700)
