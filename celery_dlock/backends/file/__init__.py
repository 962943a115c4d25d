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
    state or the new one, never a torn one (a longer state goes first to a spill area after
    that page, which the page then points at: see ``file.state``). ``<name>`` is the key
    percent-encoded (only ``A-Z a-z 0-9 _ : -`` stay), so ``/``, ``..`` and ``%`` cannot
    escape or collide; a name over 200 bytes keeps a prefix and adds the key's SHA-256.
    ``reap()`` writes ``{"key", "fence", "collected": true}`` to a file before it deletes
    it, so a process that has it open reads that and opens the new file (``file.state``).
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
    wait: woken by the kernel (inotify on the key's file, pidfd on the holder's process;
    for the slots of a ``limit``, on every slot's file and holder at once).

Portable mode (``?portable=1``; the default where there is no ``/proc``: macOS, the BSDs)
    the same files and ``flock``; a holder's process is identified through psutil (its
    start time by ``create_time``), and waits look at the key every 20-50 ms. Without
    psutil a crashed holder is never judged gone: only its ``ttl`` frees the key.

Install
    nothing on Linux; ``psutil`` elsewhere (a dependency of the package off Linux). Not on
    Windows (no ``flock``): ``backend_from_url`` says which stores to use there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import logging
import math
import os
import random
import select
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

from celery_dlock.backends.base import (
    Capabilities,
    LockBackend,
    Place,
    WallClock,
    hand_over_ttl,
    handed_expiry,
    remembered,
    success_task,
    validate_ttl,
)
from celery_dlock.backends.common import (
    ProcessLocal,
    expired,
    expiry,
    flag,
    retried,
    taken_over,
    url_options,
)
from celery_dlock.backends.file import history
from celery_dlock.backends.file.history import DAY, Segment
from celery_dlock.backends.file.state import (
    CorruptFile,
    Local,
    Locked,
    keys_in,
    raise_floor,
    read_floor,
)
from celery_dlock.backends.file.wakeups import Inotify, watch_holder
from celery_dlock.backends.naming import file_name
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.events import fields
from celery_dlock.identity import portable_forced
from celery_dlock.records import Holder, Lease, Outcome, Record, new_token

__all__ = ["FileBackend"]

logger = logging.getLogger("celery_dlock.file")


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
        gc_after: float = DAY,
        clock: WallClock | None = None,
        portable: bool | None = None,
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
        if not math.isfinite(self.gc_after) or self.gc_after < 0:
            raise ConfigurationError(f"gc_after must be a number of seconds >= 0, not {gc_after!r}")
        #: No inotify or pidfd: waits poll (holders are identified through psutil where
        #: there is no /proc: see ``Holder.current``).
        self.portable = (not _LINUX or portable_forced()) if portable is None else portable
        if not Holder.current().host_id:
            logger.warning(
                "the file store at %s cannot tell a crashed holder here (no /proc, no psutil): "
                "its keys are freed only by their ttl (pip install psutil)",
                self.directory,
                extra=fields("no_liveness", backend=self.url),
            )
        self._clock: WallClock = clock or time.time  # wall_clock, without its frame
        self._locks_dir = os.path.join(self.directory, "locks")
        self._history_dir = os.path.join(self.directory, "history")
        self._success_dir = os.path.join(self.directory, "success")
        self._floor_path = os.path.join(self.directory, "fence-floor")
        self._read_floor = functools.partial(read_floor, self._floor_path)
        for path in (self.directory, self._locks_dir, self._history_dir, self._success_dir):
            _make_private_dir(path)
        # A forked child closes its copies of the parent's files at once (see close_inherited).
        self._files = ProcessLocal(self._new_local, forget=Local.close_inherited)

    def _new_local(self) -> Local:
        """This process's open files."""
        return Local(self._locks_dir, self.url, Segment(self._history_dir, self.fsync, self.url))

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
        known: dict[str, Callable[[str], Any]] = {
            "fsync": flag,
            "gc_after": float,
            "portable": flag,
        }
        return cls(path, clock=clock, **url_options("file", parts.query, known, options))

    def _locked(self, key: str, operation: int = fcntl.LOCK_EX) -> Locked:
        """``with self._locked(key) as state``: the state of ``key`` under a flock of
        ``operation``; changes go through ``state.write`` inside the block."""
        return Locked(self._files.get(), key, operation, self._read_floor)

    def _append(self, record: Record, segment: Segment, lease_json: str | None = None) -> None:
        """Keep ``record`` as its key's last success if it is one (``once``) and none of
        another lease is kept (the first wins), then append it to the history through
        ``segment`` (``state.segment`` under a key's flock): a failure of either leaves no
        record of a release that did not happen."""
        task_name = remembered(record.outcome, record.result, record.lease.holder.task_name)
        if task_name is not None:
            self._keep(record, task_name)
        segment.append(record, lease_json)

    def _keep(self, record: Record, task_name: str, *, durable: bool = False) -> bool:
        """Keep ``record`` as the success of its key and ``task_name`` unless another lease's
        is kept (the first to create the file wins; the lease's own is rewritten)."""
        if self._write_success(record, task_name, first=True, durable=durable):
            return True
        kept = self.last_success(record.key, task_name)
        if kept is None or kept.lease.token != record.lease.token:
            return False
        self._write_success(record, task_name, durable=durable)
        return True

    def _write_success(
        self, record: Record, task_name: str, *, first: bool = False, durable: bool = False
    ) -> bool:
        path = history.success_path(self._success_dir, record.key, task_name)
        try:
            fsync = durable or self.fsync
            return history.write_success(path, record, fsync=fsync, first=first)
        except OSError as exc:
            raise BackendError(
                f"cannot keep the success of {record.key!r}: {exc}", self.url
            ) from exc

    def try_acquire(
        self,
        key: str,
        holder: Holder,
        ttl: float | None,
        replace: str | None = None,
        place: Place | None = None,
    ) -> Lease | None:
        if ttl is not None:
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
                self._append(ended, state.segment, state.lease_json)
                taken_over(ended.outcome)
            expires = None if ttl is None else now + ttl
            lease = Lease(key, new_token(), state.fence + 1, holder, now, expires)
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
            current, now = self._ours(state, lease)
            if current is None:
                return None
            outcome = outcome if type(outcome) is Outcome else Outcome(outcome)
            record = Record(current, now, outcome, problem, details, result)
            self._append(record, state.segment, state.lease_json)
            state.write(state.fence, None)
            return record

    def _ours(self, state: Locked, lease: Lease) -> tuple[Lease | None, float]:
        """The stored lease if it is ``lease`` and alive, and the time judged by; an expired
        one is cleared and recorded as ``expired`` (the caller holds the key's lock)."""
        current = state.lease
        now = self._clock()
        if current is None or current.token != lease.token:
            return None, now
        if expired(current, now):
            self._append(Record(current, now, Outcome.EXPIRED, "expired"), state.segment)
            state.write(state.fence, None)
            return None, now
        return current, now

    def add_record(self, record: Record) -> None:
        self._append(record, self._files.get().segment)

    def remember(self, record: Record) -> bool:
        return self._keep(record, success_task(record), durable=True)

    def renew(self, lease: Lease, ttl: float | None) -> Lease | None:
        ttl = validate_ttl(ttl)
        with self._locked(lease.key) as state:
            current, now = self._ours(state, lease)
            if current is None:
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

    def hand_over(self, lease: Lease, ttl: float, if_unchanged: bool = False) -> Lease | None:
        """Keep ``lease`` alive by its ttl alone, never shortened: its holder no longer names
        a process that could be judged gone (an empty host id), so it outlives this one."""
        seconds = hand_over_ttl(ttl)
        with self._locked(lease.key) as state:
            current, now = self._ours(state, lease)
            if current is None:
                return None
            holder = dataclasses.replace(current.holder, host_id="")
            handed = Lease(
                current.key, current.token, current.fence, holder, current.acquired_at,
                handed_expiry(current.expires_at, now + seconds, lease.expires_at, if_unchanged),
            )  # fmt: skip
            state.write(state.fence, handed)
            return handed

    def get(self, key: str) -> Lease | None:
        with self._locked(key, fcntl.LOCK_SH) as state:
            return state.lease

    def leases(self, prefix: str = "") -> list[Lease]:
        found = []
        for key in sorted(keys_in(self._locks_dir)):
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
        return history.query(self._history_dir, key, outcome, since, limit)

    def last_success(self, key: str, task_name: str) -> Record | None:
        path = history.success_path(self._success_dir, key, task_name)
        try:
            return history.read_success(path)
        except (OSError, ValueError) as exc:  # unreadable or corrupt: no answer to replay
            message = f"cannot read the success of {key!r} in {path}: {exc}"
            raise BackendError(message, self.url) from exc

    def forget_success(self, key: str, task_name: str, token: str) -> bool:
        path = history.success_path(self._success_dir, key, task_name)
        try:
            kept = history.read_success(path)
            if kept is None or kept.lease.token != token:
                return False
            # The key's flock, as releases and forgets take it: no other forget and new
            # success can come between the read that found ours and the unlink.
            with self._locked(key):
                return history.forget_success(path, token)
        except (OSError, ValueError) as exc:
            raise BackendError(f"cannot forget the success of {key!r}: {exc}", self.url) from exc

    def reap(self, limit: int = 100) -> list[Record]:
        reaped: list[Record] = []
        for key in keys_in(self._locks_dir):
            if len(reaped) >= limit:
                break
            try:
                with self._locked(key) as state:
                    current = state.lease
                    now = self._clock()
                    if current is None:
                        self._collect(state, now)
                        continue
                    ended = _ended(current, now)
                    if ended is not None:
                        self._append(ended, state.segment)
                        state.write(state.fence, None)
                        reaped.append(ended)
            except CorruptFile as exc:  # not the other keys' janitor too: each run says so
                logger.error(
                    "janitor skipped %r: %s", key, exc, extra=fields("reap_skipped", key=key)
                )
        return reaped

    def _collect(self, state: Locked, now: float) -> None:
        """Delete the free state file of a key unused for ``gc_after`` seconds, raising
        ``fence-floor`` to its fence first so a new file for the key continues above it."""
        if now - os.fstat(state.fd).st_mtime < self.gc_after:
            return
        raise_floor(self._floor_path, state.fence)
        state.mark_collected()
        os.unlink(os.path.join(self._locks_dir, file_name(state.key)))

    def prune_history(self, before: float) -> int:
        return history.prune(self._history_dir, before)

    def wait(self, key: str, timeout: float, place: Place | None = None) -> Place | None:
        """Sleep until ``key``'s file changes or its holder's process exits, at most
        ``timeout`` seconds (see :meth:`wait_any`)."""
        self.wait_any((key,), timeout)
        return None  # no queue: nothing to keep

    def wait_any(self, keys: Sequence[str], timeout: float) -> None:
        """Sleep until the file of any of ``keys`` changes or one of their holders'
        processes exits, at most ``timeout`` seconds: one inotify fd watches every file.
        The watch is armed before the states are read, so a release between the two is
        not missed."""
        if self.portable:
            self._poll(keys, timeout)
            return
        watch = Inotify.watch(*(os.path.join(self._locks_dir, file_name(key)) for key in keys))
        waits: list[int] = [] if watch is None else [watch]
        try:
            for key in keys:
                lease = self.get(key)
                if lease is None or _ended(lease, self._clock()) is not None:
                    return
                if lease.expires_at is not None:
                    timeout = max(0.0, min(timeout, lease.expires_at - self._clock()))
                process = watch_holder(lease.holder)
                if process is not None:
                    waits.append(process)
            if not waits:
                time.sleep(timeout)
                return
            # poll, not select: select refuses a descriptor past 1023, which a busy worker
            # (its connections, its open files) reaches ("filedescriptor out of range").
            poller = select.poll()
            for fd in waits:
                poller.register(fd, select.POLLIN)
            with contextlib.suppress(InterruptedError):
                poller.poll(math.ceil(timeout * 1000))
        finally:
            for fd in waits:
                os.close(fd)

    def _poll(self, keys: Sequence[str], timeout: float) -> None:
        """``wait_any`` without kernel wakeups: look at the keys every few tens of ms."""
        deadline = time.monotonic() + timeout
        while True:
            for key in keys:
                lease = self.get(key)
                if lease is None or _ended(lease, self._clock()) is not None:
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, random.uniform(*_POLL)))

    def close(self) -> None:
        self._files.get().close()


#: Seconds between looks at a busy key in portable mode (jittered).
_POLL = (0.02, 0.05)
#: Where /proc, inotify and pidfd are (Linux); elsewhere the portable mode is the default.
_LINUX = sys.platform.startswith("linux") and os.path.exists("/proc/self/stat")


def _ended(lease: Lease, now: float) -> Record | None:
    """The record that ends ``lease`` if its holder is gone or its time ran out, else None."""
    if lease.holder.is_gone():
        details = f"holder {lease.holder.describe()} is gone"
        return Record(lease, now, Outcome.DISCONNECTED, "disconnected", details)
    if expired(lease, now):
        return Record(lease, now, Outcome.EXPIRED, "expired")
    return None


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
