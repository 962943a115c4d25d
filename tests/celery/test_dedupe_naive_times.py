"""A naive ``eta`` or ``expires`` bounds a dedupe mark as Celery reads it: as UTC.

Celery takes a naive datetime (and a naive ISO 8601 string, as a retry passes the message's
own ``expires`` on) as UTC, on the producer (``subtract_datetimes``, the AMQP expiration)
and in the worker (``maybe_make_aware(naive_as_utc=True)``, when the message runs or
expires), whatever the host's local zone. The mark read it as local time: on a host east
of UTC a naive ``expires`` ten minutes ahead lay hours in the past, and the mark lived one
second (every call sent again); west of UTC it lay hours ahead, and a mark bounded by
``expires`` blocked the key for ``dedupe_ttl``; a naive ``eta`` hours ahead was not added
to the mark's life, which then ended while its message still waited. The zones are set
as POSIX TZ strings, which need no time zone database."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery

from celery_dlock import LockedTask
from celery_dlock.celery.dedupe import EXPIRY_GRACE, mark_key
from celery_dlock.celery.settings import backend_for
from tests.celery.test_dedupe_retry_race import DEDUPE_TTL, app

__all__ = ["app"]  # the fixture: an app on the lock store, with dlock_dedupe_ttl

#: Nine hours east of UTC, and five west (POSIX TZ: the offset is west of UTC).
ZONES = {"UTC+9": "JST-9", "UTC-5": "EST+5"}


@pytest.fixture(params=list(ZONES))
def local_zone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("TZ", ZONES[request.param])
    time.tzset()
    try:
        yield request.param
    finally:
        monkeypatch.undo()
        time.tzset()


def _naive_utc(seconds: float) -> datetime:
    return datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=seconds)


def _mark_lives(app: Celery, task: Any, who: str, **options: Any) -> float:
    """Seconds from now to the end of the mark ``task.apply_async`` takes for ``who``."""
    sent = task.apply_async((who,), **options)
    mark = backend_for(app).get(mark_key(f"job:sync:{who}", task.name))
    assert mark is not None and mark.holder.task_id == sent.id
    assert mark.expires_at is not None
    return mark.expires_at - time.time()


@pytest.mark.parametrize("form", ["datetime", "ISO string"])
def test_a_naive_expires_bounds_the_mark_as_utc(app: Celery, local_zone: str, form: str) -> None:
    @app.task(base=LockedTask, lock_key="sync:{who}", dedupe="until_started", shared=False)
    def sync(who: str) -> None: ...

    expires = _naive_utc(600)
    given = expires if form == "datetime" else expires.isoformat()
    lives = _mark_lives(app, sync, uuid.uuid4().hex[:10], expires=given)
    assert 600 + EXPIRY_GRACE - 5 < lives < 600 + EXPIRY_GRACE + 1, local_zone


def test_a_naive_eta_lengthens_the_mark_as_utc(app: Celery, local_zone: str) -> None:
    @app.task(base=LockedTask, lock_key="sync:{who}", dedupe="until_started", shared=False)
    def sync(who: str) -> None: ...

    lives = _mark_lives(app, sync, uuid.uuid4().hex[:10], eta=_naive_utc(7200))
    assert 7200 + DEDUPE_TTL - 5 < lives < 7200 + DEDUPE_TTL + 1, local_zone
