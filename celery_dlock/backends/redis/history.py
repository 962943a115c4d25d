"""Reading the history streams: ``XREVRANGE`` back to ``since``; a filter by key or
outcome runs in Redis (``FIND``), so only the records asked for travel."""

from __future__ import annotations

import math

from celery_dlock.backends.redis.client import Client
from celery_dlock.backends.redis.fields import record_from_fields, seconds
from celery_dlock.backends.redis.history_scripts import FIND
from celery_dlock.backends.redis.layout import Layout
from celery_dlock.records import Outcome, Record

__all__ = ["ms_floor", "read"]

#: Entries a ``FIND`` looks at per call: about 5 ms of Redis time on a busy 2-core VM
#: (other clients wait it out; an XREVRANGE of the 1,000 entries read before took 3 ms).
FIND_SCAN = 500


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
    low = "-" if since is None else str(max(0, ms_floor(since)))
    high: bytes | str = "+"
    filters: tuple[int, bytes, bytes] | None = None
    if key is not None or outcome is not None:
        raw_key = b"" if key is None else key.encode("utf-8", "surrogatepass")
        raw_outcome = b"" if outcome is None else Outcome(outcome).value.encode()
        filters = (FIND_SCAN, raw_key, raw_outcome)
    batch = 200 if limit is None else min(max(limit, 50), 1000)
    found: list[Record] = []
    while True:
        if filters is None:
            entries = client.command("history", "XREVRANGE", stream, high, low, "COUNT", batch)
            last = entries[-1][0] if len(entries) == batch else b""
        else:
            last, *entries = client.eval(
                FIND, [stream], [high, low, *filters], operation="history", key=key
            )
        for _, flat in entries:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            if since is not None and seconds(fields[b"rel"]) < since:
                continue
            found.append(record_from_fields(fields))
            if limit is not None and len(found) >= limit:
                return found
        if not last:
            return found
        high = b"(" + last
