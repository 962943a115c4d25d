"""Where the objects of one prefix go, and what a lock object's body holds.

``locks/<name>``
    One object per key. ``<name>`` is the key percent-encoded, or for long keys a prefix
    and a SHA-256 (:func:`celery_dlock.backends.naming.file_name`), so ``/``, ``..`` and ``%``
    cannot escape or collide. The body is JSON: ``state`` (``held`` or ``free``), ``fence``,
    the ``lease`` (token, holder, acquired_at, expires_at), ``write`` (a nonce new for every
    write, so no two bodies, and no two S3 ETags, are ever equal), ``freed_at``, ``ended``
    (the record of the last lease that ended) and ``successes`` (the success with a result
    kept per task name for ``once``: the first, never replaced by another lease's).
``history/<17 digits>-<token>-<outcome>-<name>``
    One create-only object per record; the digits are 10**17 - 1 - released_at in
    microseconds, so a listing is newest first, and key and outcome filter by name.
``success/<name>/<task name>/00000000000000000000``
    The success kept for ``once``, one per key and task name, written only by
    create-if-absent: whoever creates it first is the first success, the one every later
    release and ``remember`` finds (a 412) and keeps. A release writes it before the swap
    that puts it in its lock object's ``successes``, so every success there is here too.
    (Earlier versions wrote one per success, named ``10**20 - 1 - fence``: this name sorts
    before them, and ``prune_history`` keeps the first name of each directory.)
``fence-floor``
    The highest fence of any lock object the janitor deleted; a lock object created anew
    starts above it.

Names below the prefix take at most 431 bytes (a ``success/`` name of the longest key and
task name), so the prefix takes at most 593 bytes of UTF-8: S3 and GCS refuse names over
1024 bytes (``PREFIX_LIMIT``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from celery_dlock.backends.base import remembered
from celery_dlock.backends.naming import file_name
from celery_dlock.backends.objectstore.store import Found
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.records import Lease

__all__ = [
    "OBJECT_NAME_LIMIT",
    "PREFIX_LIMIT",
    "HistoryName",
    "Layout",
    "LockState",
    "Successes",
    "encode",
    "keeps_result",
    "kept_in",
    "lock_body",
    "us",
    "with_success",
]

_MICRO = 1_000_000
_HISTORY_DIGITS = 17
_FENCE_DIGITS = 20
#: Long keys have hashed names that share only their first 120 characters.
_SHARED_PREFIX = 120
#: The longest object name S3 and GCS take, in bytes of UTF-8.
OBJECT_NAME_LIMIT = 1024
#: The longest name ``file_name`` gives (longer ones are hashed to 185 characters).
_FILE_NAME_MAX = 200
#: The longest name below the prefix: ``success/<key name>/<task name>/<fence digits>``.
_LONGEST_NAME = len("success/") + _FILE_NAME_MAX + 1 + _FILE_NAME_MAX + 1 + _FENCE_DIGITS
#: The longest prefix (and its ``/``) that leaves room for every name below it.
PREFIX_LIMIT = OBJECT_NAME_LIMIT - _LONGEST_NAME - 1


def us(t: float) -> float:
    """``t`` rounded to the microsecond, the precision of history names."""
    return round(t * _MICRO) / _MICRO


def encode(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode("ascii")


#: A lock object's ``successes``: task name -> the record (``Record.to_dict()``) kept.
Successes = dict[str, dict[str, Any]]


def keeps_result(record: dict[str, Any]) -> bool:
    """Whether ``record`` (a ``Record.to_dict()``) keeps a result for ``last_success``: a
    success with a result, of a holder with a task name."""
    task_name = record["lease"]["holder"]["task_name"]
    return remembered(record["outcome"], record["result"], task_name) is not None


def kept_in(successes: Successes | None, record: dict[str, Any]) -> bool:
    """Whether ``record`` is the success kept for its task in ``successes``."""
    if successes is None or not keeps_result(record):
        return False
    kept = successes.get(str(record["lease"]["holder"]["task_name"]))
    return kept is not None and kept["lease"]["token"] == record["lease"]["token"]


class HistoryName(NamedTuple):
    """What a history object's name says: release time (µs), token, outcome, key name."""

    micros: int
    token: str
    outcome: str
    key_name: str


class Layout:
    """The object names under one prefix (``""`` for the top of the bucket)."""

    def __init__(self, prefix: str) -> None:
        _check_prefix(prefix)
        base = f"{prefix}/" if prefix else ""
        self.locks = f"{base}locks/"
        self.history = f"{base}history/"
        self.success = f"{base}success/"
        self.floor = f"{base}fence-floor"
        #: Read, never written: its 404 carries the server's Date.
        self.probe = f"{base}clock"
        self.doctor = f"{base}doctor/"

    def lock(self, key: str) -> str:
        return self.locks + file_name(key)

    def locks_of(self, key_prefix: str) -> str:
        """A name prefix that lists (at least) the lock objects of keys with this prefix."""
        return self.locks + file_name(key_prefix)[:_SHARED_PREFIX]

    def history_name(self, record: dict[str, Any]) -> str:
        micros = round(float(record["released_at"]) * _MICRO)
        lease = record["lease"]
        age = 10**_HISTORY_DIGITS - 1 - micros
        return (
            f"{self.history}{age:0{_HISTORY_DIGITS}d}-{lease['token']}-"
            f"{record['outcome']}-{file_name(lease['key'])}"
        )

    def parse_history(self, name: str) -> HistoryName | None:
        parts = name[len(self.history) :].split("-", 3)
        if len(parts) != 4 or not parts[0].isdigit():
            return None
        return HistoryName(10**_HISTORY_DIGITS - 1 - int(parts[0]), *parts[1:])

    def history_before(self, micros: int) -> str:
        """A name that sorts after every history object released at ``micros`` or later
        and before every one released earlier (those to prune)."""
        return f"{self.history}{10**_HISTORY_DIGITS - 1 - micros:0{_HISTORY_DIGITS}d}."

    def success_dir(self, key: str, task_name: str) -> str:
        return f"{self.success}{file_name(key)}/{file_name(task_name)}/"

    def success_name(self, key: str, task_name: str) -> str:
        """The object of the success kept for ``key`` and ``task_name``."""
        return f"{self.success_dir(key, task_name)}{'0' * _FENCE_DIGITS}"


def _check_prefix(prefix: str) -> None:
    """Refuse a prefix that would push object names past the stores' limit (the longest
    key's ``success/`` objects would fail to be written, and with them every release of
    that key), or that holds control characters (GCS refuses CR and LF in names)."""
    size = len(prefix.encode("utf-8", "surrogatepass"))
    if size > PREFIX_LIMIT:
        raise ConfigurationError(
            f"the object-store prefix is {size} bytes of UTF-8, over the limit of "
            f"{PREFIX_LIMIT} (object names are at most {OBJECT_NAME_LIMIT} bytes, and "
            f"names below the prefix take up to {_LONGEST_NAME + 1}): {prefix[:60]!r}..."
        )
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in prefix):
        raise ConfigurationError(f"the object-store prefix {prefix!r} contains a control character")


@dataclass(frozen=True, slots=True)
class LockState:
    """A lock object as read (or as this process last wrote it)."""

    key: str
    fence: int
    lease: Lease | None  # with the object's version
    freed_at: float | None
    write: str
    ended: dict[str, Any] | None
    successes: dict[str, dict[str, Any]]
    version: str

    @classmethod
    def decode(cls, found: Found, name: str, where: str) -> LockState | None:
        """The state in ``found`` (None if there is no object).

        Raises:
            BackendError: the object is not a lock object; it is left alone.
        """
        if found.body is None or found.version is None:
            return None
        try:
            data = json.loads(found.body)
            lease = None
            if data["state"] == "held":
                lease = Lease.from_dict(data["lease"])
            freed_at = data.get("freed_at")
            return cls(
                key=str(data["key"]),
                fence=int(data["fence"]),
                lease=lease,
                freed_at=None if freed_at is None else float(freed_at),
                write=str(data["write"]),
                ended=data.get("ended"),
                successes=dict(data.get("successes") or {}),
                version=found.version,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise BackendError(
                f"the lock object {name!r} is not a celery-dlock lock ({exc}); it was not changed",
                where,
            ) from exc


def lock_body(
    key: str,
    fence: int,
    lease: Lease | None,
    *,
    write: str,
    freed_at: float | None,
    ended: dict[str, Any] | None,
    successes: dict[str, dict[str, Any]],
) -> bytes:
    return encode(
        {
            "dlock": 1,
            "key": key,
            "state": "free" if lease is None else "held",
            "fence": fence,
            "lease": None if lease is None else lease.to_dict(),
            "freed_at": freed_at,
            "write": write,
            "ended": ended,
            "successes": successes,
        }
    )


#: Newest successes kept per lock object (by task name).
_SUCCESSES_KEPT = 8


def with_success(successes: Successes, record: dict[str, Any]) -> Successes:
    """``successes`` with ``record`` as its task's, if it answers ``once`` (the caller
    checked that no other lease's is kept); at most the 8 task names of the newest are
    kept in the lock object (the rest stay in ``success/``)."""
    if not keeps_result(record):
        return successes
    task_name = str(record["lease"]["holder"]["task_name"])
    updated = {**successes, task_name: record}
    newest = sorted(updated.items(), key=lambda item: -float(item[1]["released_at"]))
    return dict(newest[:_SUCCESSES_KEPT])
