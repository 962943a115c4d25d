"""The stored form of leases and records in Redis: hash and stream fields, both ways.

A record is the stream entry ``key tok fence holder acq exp rel out prob det res`` (see
:mod:`celery_dlock.backends.redis.scripts`); ``holder``, ``prob``, ``det`` and ``res``
are JSON, ASCII-escaped so that any text (lone surrogates included) survives. The same
fields make the kept result. One function reads each form, so a record returned
by ``release`` and the one ``history`` reads back are built alike and compare equal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from celery_dlock.records import Holder, Lease, Outcome, Record

__all__ = [
    "encode_json",
    "holder_json",
    "lease_from_state",
    "optional_seconds",
    "record_fields",
    "record_from_fields",
    "seconds",
    "seconds_text",
]

_encode = json.JSONEncoder(separators=(",", ":")).encode


def encode_json(value: Any) -> str:
    """JSON text of ``value``, ASCII only; None is ``null`` without a call (the hot path)."""
    return "null" if value is None else _encode(value)


def holder_json(holder: Holder) -> str:
    return holder.to_json()


def seconds(value: bytes) -> float:
    """A stored time: decimal seconds, read back to the float that was meant."""
    return float(value)


def optional_seconds(value: bytes | None) -> float | None:
    """A stored expiry; empty (stored) or ``-`` (in a script's reply) means none."""
    return None if not value or value == b"-" else float(value)


def seconds_text(value: float | None) -> str:
    """A time as stored (``repr`` reads back as the same float); None as empty."""
    return "" if value is None else repr(float(value))


def _text(value: bytes) -> str:
    return value.decode("utf-8", "surrogatepass")


def lease_from_state(key: str, state: Sequence[bytes]) -> Lease:
    """The lease from a state hash read as ``tok fence holder acq exp``."""
    token, fence, holder, acquired, expires = state
    return Lease(
        key,
        _text(token),
        int(fence),
        Holder.from_dict(json.loads(holder)),
        seconds(acquired),
        optional_seconds(expires),
    )


def record_from_fields(fields: Mapping[bytes, bytes] | Sequence[bytes]) -> Record:
    """The record from a stream entry (or kept result) given as a mapping or a flat list."""
    if not isinstance(fields, Mapping):
        fields = dict(zip(fields[::2], fields[1::2], strict=True))
    key = _text(fields[b"key"])
    lease = lease_from_state(
        key,
        [fields[b"tok"], fields[b"fence"], fields[b"holder"], fields[b"acq"], fields[b"exp"]],
    )
    return Record(
        lease,
        seconds(fields[b"rel"]),
        Outcome(_text(fields[b"out"])),
        json.loads(fields[b"prob"]),
        json.loads(fields[b"det"]),
        json.loads(fields[b"res"]),
    )


def record_fields(record: Record) -> list[str | bytes]:
    """The stored fields of ``record``, as ``add_record`` writes them."""
    lease = record.lease
    return [
        "key",
        lease.key.encode("utf-8", "surrogatepass"),
        "tok",
        lease.token,
        "fence",
        str(lease.fence),
        "holder",
        holder_json(lease.holder),
        "acq",
        seconds_text(lease.acquired_at),
        "exp",
        seconds_text(lease.expires_at),
        "rel",
        seconds_text(record.released_at),
        "out",
        Outcome(record.outcome).value,
        "prob",
        encode_json(record.problem),
        "det",
        encode_json(record.details),
        "res",
        encode_json(record.result),
    ]
