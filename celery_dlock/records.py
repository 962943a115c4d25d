"""The data of a lock: who holds it (:class:`Holder`), the held lock (:class:`Lease`), and
one history entry (:class:`Record`) with its :class:`Outcome`.

All are frozen: a renewed lease is a new ``Lease``. ``to_dict``/``from_dict`` give the JSON
form that the file, Redis and object-store backends store, so one change of a field is one
change here.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache
from typing import Any

from celery_dlock.identity import identity, process_gone
from celery_dlock.tokens import new_token

__all__ = [
    "DETAILS_LIMIT",
    "HANDED_ON",
    "METADATA_LIMIT",
    "REQUEUE",
    "Holder",
    "Lease",
    "Outcome",
    "Record",
    "check_metadata",
    "describe_exception",
    "goes_on",
    "new_token",
    "truncate_utf8",
]

#: Upper bound, in UTF-8 bytes, of a record's ``details`` (message + traceback).
DETAILS_LIMIT = 8192
_MESSAGE_LIMIT = 2048
_LINE_LIMIT = 1024


class Outcome(str, Enum):
    """How a lease ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RETRIED = "retried"
    REVOKED = "revoked"
    SKIPPED = "skipped"
    DISCONNECTED = "disconnected"
    EXPIRED = "expired"
    FORCED = "forced"
    LOST = "lost"
    #: A dedupe mark released because a worker started its task (``until_started``).
    DEQUEUED = "dequeued"
    #: Let go without a release: its Lock collected while held, or its process ended.
    ABANDONED = "abandoned"
    #: A ``once`` success forgotten by an operator (``celery-dlock forget``): the record of
    #: that act, on the key, with a lease of its own (fence 0).
    FORGOTTEN = "forgotten"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds (or asks for) a lease.

    ``host_id`` names the kernel boot and pid namespace of ``pid``; ``started`` is the
    process's start in seconds since that boot. Together they tell a live process from a
    recycled pid. ``nonce`` is new for every attempt, so a redelivered Celery task with the
    same ``task_id`` is a different holder.
    """

    host: str
    pid: int
    started: float | None
    host_id: str
    nonce: str
    worker: str | None = None
    task_id: str | None = None
    task_name: str | None = None
    metadata: dict[str, Any] | None = field(default=None, hash=False)

    @classmethod
    def current(
        cls,
        *,
        worker: str | None = None,
        task_id: str | None = None,
        task_name: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Holder:
        """The holder for this process, with a fresh nonce.

        Raises:
            ValueError: ``metadata`` is not a JSON object of at most ``METADATA_LIMIT``
                bytes.
        """
        pid = os.getpid()
        host, started, host_id = identity(pid)
        nonce = os.urandom(8).hex()
        # By position: a quarter cheaper than by keyword, and made at every acquire.
        return cls(
            host, pid, started, host_id, nonce, worker, task_id, task_name, check_metadata(metadata)
        )

    def is_gone(self) -> bool:
        """True only when this holder's process provably no longer exists (see
        :func:`celery_dlock.identity.process_gone`; anything we cannot check is alive)."""
        return process_gone(self.pid, self.started, self.host_id)

    def gone_because(self) -> str | None:
        """Why this holder is gone (:meth:`is_gone`): ``process ended``; or None while it
        may live. A store that judges its holders itself says its own reason (Postgres:
        ``lock session ended``)."""
        return "process ended" if self.is_gone() else None

    def describe(self) -> str:
        """``task_name[task_id] on worker (pid N on host)``, ``task_name (pid N on host)``
        (``celery-dlock run``, a named Holder), or ``pid N on host``."""
        who = f"pid {self.pid} on {self.host}"
        if self.task_id:
            task = f"{self.task_name or 'task'}[{self.task_id}]"
            where = f" on {self.worker}" if self.worker else ""
            return f"{task}{where} ({who})"
        if self.worker:
            return f"{self.task_name or 'holder'} on {self.worker} ({who})"
        return f"{self.task_name} ({who})" if self.task_name else who

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "pid": self.pid,
            "started": self.started,
            "host_id": self.host_id,
            "nonce": self.nonce,
            "worker": self.worker,
            "task_id": self.task_id,
            "task_name": self.task_name,
        } | ({} if self.metadata is None else {"metadata": self.metadata})

    def to_json(self, ensure_ascii: bool = True) -> str:
        """``to_dict()`` as compact JSON, the text ``json.dumps(self.to_dict(),
        separators=(",", ":"), ensure_ascii=ensure_ascii)`` gives, at a seventh of its cost
        (it is encoded at every acquire, with a fresh nonce): the process's part is encoded
        once."""
        string = _STRINGS[ensure_ascii]
        text = (
            f"{_identity_json(self.host, self.pid, self.started, self.host_id, ensure_ascii)}"
            f'"nonce":{string(self.nonce)},"worker":{string(self.worker)},'
            f'"task_id":{string(self.task_id)},"task_name":{string(self.task_name)}'
        )
        if self.metadata is None:
            return text + "}"
        metadata = json.dumps(self.metadata, separators=(",", ":"), ensure_ascii=ensure_ascii)
        return f'{text},"metadata":{metadata}}}'

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Holder:
        return cls(**data)


def _json_string(encode: Callable[[str], str]) -> Callable[[str | None], str]:
    """A text as a JSON string by ``encode`` (escaped to ASCII, or not), None as null."""

    def string(value: str | None) -> str:
        return "null" if value is None else encode(value)

    return string


#: A JSON string or null, by ``ensure_ascii``.
_STRINGS = {
    True: _json_string(json.encoder.encode_basestring_ascii),
    False: _json_string(json.encoder.encode_basestring),
}


@lru_cache(maxsize=8)
def _identity_json(
    host: str, pid: int, started: float | None, host_id: str, ensure_ascii: bool
) -> str:
    """The opening of a holder's JSON up to its nonce: a process's own part."""
    part = {"host": host, "pid": pid, "started": started, "host_id": host_id}
    return json.dumps(part, separators=(",", ":"), ensure_ascii=ensure_ascii)[:-1] + ","


#: Bytes of compact JSON a lease's metadata may take: it is stored with every lease and
#: record, and read by every ``leases`` and ``history``.
METADATA_LIMIT = 4096


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``metadata`` as a plain dict, checked: a JSON object with string keys (no NaN or
    infinity) of at most ``METADATA_LIMIT`` bytes; a ValueError naming the problem
    otherwise."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise ValueError(f"lock metadata must be a dict, not {type(metadata).__name__}")
    if not all(isinstance(name, str) for name in metadata):
        raise ValueError(f"lock metadata keys must be strings: {list(metadata)!r}")
    try:
        text = json.dumps(dict(metadata), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"lock metadata must be JSON: {exc}") from None
    size = len(text.encode())
    if size > METADATA_LIMIT:
        raise ValueError(
            f"lock metadata is {size} bytes of JSON, past the limit of {METADATA_LIMIT}"
        )
    loaded: dict[str, Any] = json.loads(text)  # a copy: later changes by the caller stay out
    return loaded


@dataclass(frozen=True, slots=True)
class Lease:
    """A held lock.

    ``token`` is unique per acquisition; every release or renewal compares on it. ``fence``
    strictly increases per key: hand it to the protected resource so it can refuse a writer
    whose lease was lost. Times are seconds since the epoch on the store's clock;
    ``expires_at`` is None where liveness is the holder's connection or process.
    """

    key: str
    token: str = field(repr=False)  # the release capability: kept out of logs
    fence: int
    holder: Holder
    acquired_at: float
    expires_at: float | None = None

    @property
    def metadata(self) -> dict[str, Any] | None:
        """What the holder said about this hold (``Lock(..., metadata=...)``), or None."""
        return self.holder.metadata

    def for_task(self, task_name: str | None) -> Lease:
        """This lease with its holder's ``task_name`` replaced (the name a success is kept
        under for ``once``); itself for None."""
        if task_name is None:
            return self
        return replace(self, holder=replace(self.holder, task_name=task_name))

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "token": self.token,
            "fence": self.fence,
            "holder": self.holder.to_dict(),
            "acquired_at": self.acquired_at,
            "expires_at": self.expires_at,
        }

    def to_json(self, ensure_ascii: bool = True) -> str:
        """``to_dict()`` as compact JSON, the text ``json.dumps`` gives (see
        ``Holder.to_json``) at a fifth of its cost: the file store writes it at every
        acquire."""
        string = _STRINGS[ensure_ascii]
        # Numbers as json writes them: repr of a float (and of an int, for the fence).
        expires = "null" if self.expires_at is None else repr(float(self.expires_at))
        return (
            f'{{"key":{string(self.key)},"token":{string(self.token)},"fence":{int(self.fence)},'
            f'"holder":{self.holder.to_json(ensure_ascii)},'
            f'"acquired_at":{float(self.acquired_at)!r},"expires_at":{expires}}}'
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lease:
        return cls(
            key=data["key"],
            token=data["token"],
            fence=int(data["fence"]),
            holder=Holder.from_dict(data["holder"]),
            acquired_at=float(data["acquired_at"]),
            expires_at=None if data.get("expires_at") is None else float(data["expires_at"]),
        )


@dataclass(frozen=True, slots=True)
class Record:
    """One history entry: a lease and how it ended.

    ``problem`` is the exception type (``decimal.InvalidOperation``) or a word such as
    ``disconnected``; ``details`` the message and a traceback, at most 8 KiB; ``result`` the
    task's JSON-compatible return value, kept for ``once``.
    """

    lease: Lease
    released_at: float
    outcome: Outcome
    problem: str | None = None
    details: str | None = None
    result: Any = None

    @property
    def key(self) -> str:
        return self.lease.key

    @property
    def fence(self) -> int:
        return self.lease.fence

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease": self.lease.to_dict(),
            "released_at": self.released_at,
            "outcome": self.outcome.value,
            "problem": self.problem,
            "details": self.details,
            "result": self.result,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        return cls(
            lease=Lease.from_dict(data["lease"]),
            released_at=float(data["released_at"]),
            outcome=Outcome(data["outcome"]),
            problem=data.get("problem"),
            details=data.get("details"),
            result=data.get("result"),
        )


#: How the details of the body lease of a run that replaced itself begin: its task goes on
#: under the same id (the ``marks`` command tells such a run from one that ended; written
#: by :mod:`celery_dlock.celery.outcomes`).
HANDED_ON = "replaced by "
#: How the details of a run ended by ``Reject`` begin: ``requeue=True: ...``.
REQUEUE = "requeue="


def goes_on(record: Record) -> bool:
    """Whether the record of a task's body lease leaves that task to go on under its id:
    a retry, a run that handed itself to its replacement (``Task.replace``), or a
    ``Reject`` that put its message back, rather than ending it."""
    details = record.details or ""
    return (
        record.outcome is Outcome.RETRIED
        or (record.outcome is Outcome.SUCCEEDED and details.startswith(HANDED_ON))
        or (record.problem == "Reject" and details.startswith(f"{REQUEUE}True"))
    )


def truncate_utf8(text: str, limit: int = DETAILS_LIMIT) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes, keeping its head and its tail.

    The head holds the message and the tail the innermost frames, which are what a reader
    needs; the middle of a long traceback is what goes.
    """
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    marker = b"\n[... truncated ...]\n"
    room = limit - len(marker)
    head = data[: room // 2].decode("utf-8", "ignore")
    tail = data[len(data) - (room - room // 2) :].decode("utf-8", "ignore")
    return head + marker.decode() + tail


def describe_exception(exc: BaseException) -> tuple[str, str]:
    """``(problem, details)`` for an exception: its qualified type, and its message with a
    traceback, bounded to :data:`DETAILS_LIMIT` bytes.

    The message and each traceback line are cut first (to 2 KiB and 1 KiB), so a huge
    message cannot push the frames out of the bound.
    """
    kind = type(exc)
    module = kind.__module__
    problem = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    lines = traceback.format_exception(kind, exc, exc.__traceback__)
    text = "".join(truncate_utf8(line, _LINE_LIMIT) for line in lines)
    try:  # a broken __str__ must not keep a lease from its release (traceback guards too)
        said = str(exc)
    except Exception as failed:
        said = f"<str() of the exception failed: {type(failed).__name__}>"
    message = truncate_utf8(said, _MESSAGE_LIMIT)
    details = f"{message}\n{text}" if message else text
    return problem, truncate_utf8(details.rstrip("\n"))
