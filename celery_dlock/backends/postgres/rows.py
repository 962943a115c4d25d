"""Between Python values and the Postgres backend's rows: leases, records, times, text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from psycopg.types.numeric import Int8

from celery_dlock.backends.common import taken_over
from celery_dlock.errors import ConfigurationError
from celery_dlock.records import DETAILS_LIMIT, Holder, Lease, Outcome, Record, truncate_utf8

__all__ = [
    "SessionEndedHolder",
    "lease",
    "only",
    "record",
    "record_params",
    "result_json",
    "text",
    "timestamp",
    "took_over",
]

#: Bytes of UTF-8 kept of a record's ``problem`` (an exception's type name, normally).
PROBLEM_LIMIT = 1024
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True, slots=True)
class SessionEndedHolder(Holder):
    """The holder of a lease whose lock session has ended (no session holds the lease's
    advisory lock, :meth:`LeaseKeys.ended`): gone, whatever became of its process (killed,
    cut off, alive on another host), as the next ``try_acquire`` or ``reap`` will find.
    Only ``get`` and ``leases`` give one; equal to no plain :class:`Holder`."""

    def is_gone(self) -> bool:
        return True

    def gone_because(self) -> str:
        return "lock session ended"


def lease(row: Any) -> Lease:
    """A lease from ``key, token, fence, holder, acquired_at, expires_at`` and, as ``get``
    and ``leases`` read it, whether its lock session ended (then its holder is a
    :class:`SessionEndedHolder`)."""
    kind = SessionEndedHolder if len(row) > 6 and row[6] else Holder
    return Lease(row[0], row[1], int(row[2]), kind.from_dict(row[3]), row[4], row[5])


def record(row: Any) -> Record:
    """A record from a lease's columns and ``released_at, outcome, problem, details, result``."""
    return Record(lease(row[:6]), row[6], Outcome(row[7]), row[8], row[9], row[10])


def took_over(row: Any, held: dict[int, str]) -> Any:
    """The new lease's columns of a ``take_over`` row, or None (no row: its holder lives).
    The old lease is counted if it was dead (``taken_over``) and, if this session held its
    advisory lock (which the statement let go), dropped from ``held`` (fence -> key)."""
    if row is None:
        return None
    taken_over(row[0])
    if row[7] is not None:
        held.pop(int(row[6]), None)
    return row[1:6]


def timestamp(seconds: float) -> datetime:
    """``seconds`` since the epoch as an exact timestamp: Postgres keeps microseconds, and a
    float read back from one rounds to the same microsecond."""
    return _EPOCH + timedelta(microseconds=round(seconds * 1e6))


def text(value: str | None, limit: int) -> str | None:
    """``value`` as Postgres text stores it: at most ``limit`` UTF-8 bytes, NUL (which text
    cannot hold) and unpaired surrogates replaced (U+FFFD, ``?``). Never refused."""
    if value is None:
        return None
    value = truncate_utf8(value, limit)
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "replace").decode("utf-8")
    return value


def result_json(result: Any) -> tuple[str | None, Any]:
    """The JSON text to store for ``result``, and the value history will give back.

    Raises:
        ConfigurationError: ``result`` is not JSON (a set, an object, NaN...).
    """
    if result is None:
        return None, None
    try:
        dumped = json.dumps(result, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"a released lease's result must be JSON-compatible, got {type(result).__name__}: {exc}"
        ) from exc
    # A NUL stays: the json type keeps its "\u0000" escape (jsonb and text could not hold
    # it), and a once replay must give back what the first caller got (bytes included).
    return dumped, json.loads(dumped)


def record_params(record: Record, holder_json: str) -> dict[str, Any]:
    """The parameters of a statement that writes ``record`` (its holder as ``holder_json``)."""
    lease = record.lease
    result, _ = result_json(record.result)
    return {
        "token": lease.token,
        "key": lease.key,
        "fence": Int8(lease.fence),
        "holder": holder_json,
        "acquired_at": timestamp(lease.acquired_at),
        "expires_at": None if lease.expires_at is None else timestamp(lease.expires_at),
        "released_at": timestamp(record.released_at),
        "outcome": Outcome(record.outcome).value,
        "problem": text(record.problem, PROBLEM_LIMIT),
        "details": text(record.details, DETAILS_LIMIT),
        "result": result,
    }


def only(conn: psycopg.Connection[Any], statement: str, params: Any = None) -> Any:
    """The one row of ``statement`` (a query that always returns one: the doctor's)."""
    row = conn.execute(statement, params).fetchone()
    assert row is not None
    return row
