"""History of the file backend: records as JSON lines in one segment per day (UTC), and
the last success of each (key, task name) for ``once``."""

from __future__ import annotations

import calendar
import contextlib
import errno
import heapq
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable

from celery_dlock.backends.naming import file_name
from celery_dlock.errors import BackendError
from celery_dlock.records import Outcome, Record

DAY = 86400.0
encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class Segment:
    """This process's open history segment (the file of the day it last appended to)."""

    __slots__ = ("day", "directory", "fd", "fsync", "mutex", "torn", "url")

    def __init__(self, directory: str, fsync: bool, url: str) -> None:
        self.directory = directory
        self.fsync = fsync
        self.url = url
        self.mutex = threading.Lock()
        self.day = -1
        self.fd = -1
        #: The last append was cut short: its line has no end yet.
        self.torn = False

    def append(self, record: Record, lease_json: str | None = None) -> None:
        """Append ``record`` to its day's segment: one ``write`` of one line, which
        ``O_APPEND`` keeps whole and in order among processes."""
        day = int(record.released_at // DAY)
        data = record_line(record, lease_json)
        try:
            with self.mutex:
                if self.day == day and os.fstat(self.fd).st_nlink == 0:
                    # Deleted while open (a prune whose cut-off passed today, an operator):
                    # what this process wrote on would be seen by no reader.
                    self._close()
                if self.day != day:
                    self._close()
                    name = time.strftime("%Y-%m-%d.jsonl", time.gmtime(day * DAY))
                    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                    self.fd = open_private(os.path.join(self.directory, name), flags)
                    self.day = day
                if self.torn:  # end the line an earlier short write left unfinished
                    data = b"\n" + data
                written = os.write(self.fd, data)
                self.torn = written < len(data)
                if self.torn:  # a full disk cuts a write short without an error
                    raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes")
                if self.fsync:
                    os.fsync(self.fd)
        except OSError as exc:
            raise BackendError(f"cannot append to the history: {exc}", self.url) from exc

    def close(self) -> None:
        with self.mutex:
            self._close()

    def _close(self) -> None:
        if self.fd >= 0:
            fd, self.fd, self.day = self.fd, -1, -1
            os.close(fd)


def open_private(path: str, flags: int) -> int:
    """Open ``path`` with ``flags`` (``O_CREAT`` among them), mode 0600 whatever the umask.

    A process with a umask such as 0o277 creates files read-only: every other process
    of the user would then be refused (``EACCES``) the ``O_RDWR`` or ``O_WRONLY`` open of
    that key's lock file or that day's history for good. The creator (the owner) widens
    the mode back; another process may be refused in the few syscalls between.
    """
    fd = os.open(path, flags, 0o600)
    try:
        status = os.fstat(fd)
        if status.st_mode & 0o600 != 0o600 and status.st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return fd


#: Each outcome's value (``Outcome.value`` is a property: costly at every release).
_OUTCOMES = {outcome: outcome.value for outcome in Outcome}
#: How every record line begins (``record_line``).
_RECORD_START = b'{"lease":'


def record_line(record: Record, lease_json: str | None) -> bytes:
    """``record`` as one JSON line (the form of ``Record.to_dict``), reusing the lease's
    JSON when the state file already had it encoded."""
    if lease_json is None:
        lease_json = record.lease.to_json(ensure_ascii=False)
    problem = "null" if record.problem is None else encode(record.problem)
    details = "null" if record.details is None else encode(record.details)
    result = "null" if record.result is None else encode(record.result)
    text = (
        f'{{"lease":{lease_json},"released_at":{record.released_at!r},'
        f'"outcome":"{_OUTCOMES[record.outcome]}","problem":{problem},"details":{details},'
        f'"result":{result}}}\n'
    )
    return text.encode("utf-8", "surrogatepass")


def query(
    directory: str,
    key: str | None,
    outcome: Outcome | None,
    since: float | None,
    limit: int | None,
) -> list[Record]:
    """``FileBackend.history``: the newest ``limit`` records of ``key`` with ``outcome``
    released at or after ``since`` (None: any), newest first, from the day segments."""
    first_day = None if since is None else time.strftime("%Y-%m-%d", time.gmtime(since))
    found: list[Record] = []
    wanted = tuple(
        needles(value)
        for value in (key, None if outcome is None else Outcome(outcome).value)
        if value is not None
    )

    def keep(record: Record) -> bool:
        return (
            (since is None or record.released_at >= since)
            and (key is None or record.key == key)
            and (outcome is None or record.outcome == outcome)
        )

    for segment in segments(directory):
        if first_day is not None and segment[:10] < first_day:
            break
        # A segment holds the records released on its day: all newer than the next one's.
        left = None if limit is None else limit - len(found)
        found += newest(directory, segment, left, keep, wanted=wanted, since=since)
        if limit is not None and len(found) >= limit:
            break
    found.sort(key=lambda record: record.released_at, reverse=True)
    return found if limit is None else found[:limit]


def segments(directory: str) -> list[str]:
    """The names of the history segments in ``directory``, newest day first."""
    names = [n for n in os.listdir(directory) if n.endswith(".jsonl")]
    return sorted(names, reverse=True)


#: ``"released_at": number`` anywhere on a line: the record's own release time, and any
#: that a holder's metadata or a result may hold (``_bound``).
_RELEASED_AT = re.compile(rb'"released_at"\s*:\s*(-?[0-9][0-9.eE+-]*)')


def newest(
    directory: str,
    segment: str,
    count: int | None,
    keep: Callable[[Record], bool],
    *,
    wanted: tuple[tuple[bytes, ...], ...] = (),
    since: float | None = None,
) -> list[Record]:
    """The ``count`` newest records of one segment that ``keep`` accepts (all of them with
    None), newest first, the later written first among equal times.

    A line costs some 15 µs to parse and 1 µs to search, so only the lines that may hold
    such a record are parsed: those that contain one byte string of each group of
    ``wanted`` (``needles``), whose bound (``_bound``: at least the release time of their
    record) is at or after ``since``, taken by bound, newest first, until ``count`` records
    are found and the next bound is below the oldest of them."""
    try:
        with open(os.path.join(directory, segment), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    lines = []
    for position, line in enumerate(data.split(b"\n")):
        if wanted and not all(any(n in line for n in group) for group in wanted):
            continue
        bound = _bound(line)
        if bound > -math.inf and (since is None or bound >= since):
            lines.append((bound, position, line))
    lines.sort(key=lambda item: item[:2], reverse=True)
    times: list[float] = []  # the newest ``count`` release times found: a min-heap
    found = []
    for bound, position, line in lines:
        if count is not None and len(times) >= count and bound < times[0]:
            break
        record = _parse(line)
        if record is None or not keep(record):
            continue
        found.append((record.released_at, position, record))
        if count is None:
            continue
        if len(times) < count:
            heapq.heappush(times, record.released_at)
        elif record.released_at > times[0]:
            heapq.heapreplace(times, record.released_at)
    found.sort(key=lambda item: item[:2], reverse=True)
    return [record for _, _, record in found[:count]]


def _bound(line: bytes) -> float:
    """At least the release time of the record on ``line``: the largest ``released_at``
    number on it (+inf if one is no number, -inf if there is none: no record)."""
    bound = -math.inf
    for number in _RELEASED_AT.findall(line):
        try:
            bound = max(bound, float(number))
        except ValueError:
            return math.inf
    return bound


def _parse(line: bytes) -> Record | None:
    """The record on ``line``, or None. The last line may be a record whose append is still
    under way, and a line may start with what is left of an append a full disk cut short
    (another process may have glued its record to it): each line's last record start is
    tried too."""
    for start in dict.fromkeys((0, line.rfind(_RECORD_START))):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return Record.from_dict(json.loads(line[max(start, 0) :]))
    return None


def needles(value: str) -> tuple[bytes, ...]:
    """What a record line holding the JSON string ``value`` contains, whichever way it was
    encoded: as this module writes it (UTF-8) and ASCII-escaped (``json.dumps``)."""
    forms = dict.fromkeys((encode(value), json.dumps(value)))
    return tuple(form.encode("utf-8", "surrogatepass") for form in forms)


def prune(directory: str, before: float) -> int:
    """Delete the segments of days that ended by ``before``; returns how many records went."""
    pruned = 0
    for segment in segments(directory):
        day_end = _day_start(segment[:10]) + DAY
        if day_end > before:
            continue
        path = os.path.join(directory, segment)
        with contextlib.suppress(FileNotFoundError):
            with open(path, "rb") as f:
                pruned += f.read().count(b"\n")
            os.unlink(path)
    return pruned


def _day_start(day: str) -> float:
    return float(calendar.timegm(time.strptime(day, "%Y-%m-%d")))


def success_path(directory: str, key: str, task_name: str) -> str:
    """The file that holds the last success of ``task_name`` on ``key``."""
    return os.path.join(directory, file_name(f"{key}\0{task_name}"))


def write_success(path: str, record: Record, *, fsync: bool, first: bool = False) -> bool:
    """Write ``record`` to the success file ``path``, whole or not at all (flushed to disk
    first with ``fsync``); with ``first``, only if there is none yet (``link`` refuses an
    existing name). Returns whether it was written."""
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    data = json.dumps(record.to_dict(), ensure_ascii=False).encode("utf-8", "surrogatepass")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, f"wrote part of {len(data)} bytes")
        if fsync:
            os.fsync(fd)
    except OSError:
        os.unlink(temporary)
        raise
    finally:
        os.close(fd)
    if not first:
        os.replace(temporary, path)
        return True
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(temporary)
    return True


def forget_success(path: str, token: str) -> bool:
    """Remove the success file ``path`` if the lease with ``token`` kept it; whether it did.
    The caller holds the key's flock, as every forget and release does: the file read is
    the one unlinked (a ``remember`` only creates it where there is none, or rewrites the
    same lease's own)."""
    kept = read_success(path)
    if kept is None or kept.lease.token != token:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:  # forgotten by another operator meanwhile
        return False
    return True


def read_success(path: str) -> Record | None:
    """The record in the success file ``path``, or None if there is none."""
    try:
        with open(path, "rb") as f:
            return Record.from_dict(json.loads(f.read()))
    except FileNotFoundError:
        return None
