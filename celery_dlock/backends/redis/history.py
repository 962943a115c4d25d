"""Reading the history streams: ``XREVRANGE`` back to ``since``, filtered here."""

from __future__ import annotations

import math

from celery_dlock.backends.redis.client import Client
from celery_dlock.backends.redis.fields import record_from_fields, seconds
from celery_dlock.backends.redis.layout import Layout
from celery_dlock.records import Outcome, Record

__all__ = ["ms_floor", "read"]


def ms_floor(when: float) -> int:
    """A stream id's milliseconds for a release at ``when``, 2 ms early: entry ids follow
    release times, but ``add_record``'s may be a millisecond off (float rounding)."""
    return math.floor(when * 1000) - 2


def read(
    client: Client,
    layout: Layout,
    *,
    key: str | None,
    outcome: Outcome | None,
    since: float | None,
    limit: int | None,
) -> list[Record]:
    """Records newest first, of one key or of all; see ``RedisBackend.history``."""
    if limit is not None and limit <= 0:
        return []
    buckets = range(layout.buckets) if key is None else [layout.bucket(key)]
    found: list[Record] = []
    for bucket in buckets:
        found += _bucket(client, layout, bucket, key=key, outcome=outcome, since=since, limit=limit)
    if len(buckets) > 1:
        found.sort(key=lambda record: record.released_at, reverse=True)
    return found if limit is None else found[:limit]


def _bucket(
    client: Client,
    layout: Layout,
    bucket: int,
    *,
    key: str | None,
    outcome: Outcome | None,
    since: float | None,
    limit: int | None,
) -> list[Record]:
    stream = layout.history(bucket)
    raw_key = None if key is None else key.encode("utf-8", "surrogatepass")
    raw_outcome = None if outcome is None else Outcome(outcome).value.encode()
    low = "-" if since is None else str(max(0, ms_floor(since)))
    high = "+"
    batch = 200 if limit is None else min(max(limit, 50), 1000)
    found: list[Record] = []
    while True:
        entries = client.command("history", "XREVRANGE", stream, high, low, "COUNT", batch)
        for _, flat in entries:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            if raw_key is not None and fields[b"key"] != raw_key:
                continue
            if raw_outcome is not None and fields[b"out"] != raw_outcome:
                continue
            if since is not None and seconds(fields[b"rel"]) < since:
                continue
            found.append(record_from_fields(fields))
            if limit is not None and len(found) >= limit:
                return found
        if len(entries) < batch:
            return found
        high = b"(" + entries[-1][0]
