"""Structured log events: every line celery-dlock logs carries ``event``, ``key``, ``fence``,
``task_id``, ``outcome`` and ``backend`` as ``extra`` fields (checked on the source: every
logging call passes them; and on real events: a lost lease, its lost release, an abandoned
Lock), so a JSON formatter gets fields, not prose."""

from __future__ import annotations

import ast
import gc
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_dlock import Holder, Lock, Outcome
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.events import FIELDS
from celery_dlock.reap import reap
from celery_dlock.testing import FakeClock
from tests.support import eventually, force_release

PACKAGE = Path(__file__).parent.parent / "celery_dlock"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def calls_in_package() -> Iterator[tuple[str, ast.Call]]:
    """Every call in the package's source, with its place (``path:line``)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", node


def keywords(call: ast.Call) -> set[str | None]:
    return {keyword.arg for keyword in call.keywords}


def test_every_logging_call_of_the_package_passes_the_event_fields() -> None:
    bare = [
        place
        for place, call in calls_in_package()
        if isinstance(call.func, ast.Attribute)
        and call.func.attr in LEVELS
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "logger"
        and "extra" not in keywords(call)
    ]
    assert bare == []


@pytest.mark.parametrize("event", ["lease_lost", "reaped"])
def test_the_events_of_a_lease_in_a_store_name_the_store(event: str) -> None:
    found = [
        (place, "backend" in keywords(call))
        for place, call in calls_in_package()
        if isinstance(call.func, ast.Name)
        and call.func.id == "fields"
        and call.args
        and isinstance(call.args[0], ast.Constant)
        and call.args[0].value == event
    ]
    assert found and all(named for _, named in found), found


class JsonLines(logging.Formatter):
    """What a JSON log setup does with a record: its message and its ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        data = {name: getattr(record, name, "MISSING") for name in FIELDS}
        return json.dumps({"message": record.getMessage(), **data})


@pytest.fixture
def lines() -> list[str]:
    captured: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(self.format(record))

    handler = Keep()
    handler.setFormatter(JsonLines())
    logger = logging.getLogger("celery_dlock")
    # Another test's Celery may have set the level (loglevel='error') or disabled the logger.
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.INFO)
    logger.disabled = False
    logger.addHandler(handler)
    yield captured
    logger.removeHandler(handler)
    logger.setLevel(level)
    logger.disabled = disabled


def events(lines: list[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in lines]


def test_a_lost_lease_and_its_release_are_events_with_their_fields(lines: list[str]) -> None:
    backend = MemoryBackend()
    lock = Lock(backend, "job:event:lost", ttl=0.3)
    lease = lock.acquire()
    force_release(backend, "job:event:lost", "operator")
    eventually(lambda: lock.lost, "the renewer finds the lease gone")
    assert lock.release() is None
    found = {e["event"]: e for e in events(lines)}
    lost, released = found["lease_lost"], found["release_lost"]
    assert (lost["key"], lost["fence"], lost["outcome"]) == ("job:event:lost", lease.fence, "lost")
    assert (released["key"], released["outcome"]) == ("job:event:lost", Outcome.LOST.value)
    assert lost["backend"] == released["backend"] == backend.url
    assert all(set(FIELDS) <= set(e) and "MISSING" not in e.values() for e in events(lines))


def test_an_abandoned_lock_is_an_event(lines: list[str]) -> None:
    backend = MemoryBackend()
    lock = Lock(backend, "job:event:dropped")
    lease = lock.acquire()
    with pytest.warns(ResourceWarning):
        del lock
        gc.collect()
    [event] = [e for e in events(lines) if e["event"] == "abandoned"]
    assert event["key"] == "job:event:dropped" and event["fence"] == lease.fence
    assert event["outcome"] == "abandoned" and "released as abandoned" in str(event["message"])


def test_a_lease_the_janitor_clears_is_an_event_that_names_its_store(lines: list[str]) -> None:
    clock = FakeClock()
    backend = MemoryBackend.from_url("memory://events-reaped", clock=clock)
    lease = backend.try_acquire("job:event:reaped", Holder.current(), 5.0)
    assert lease is not None
    clock.advance(10.0)
    assert reap(backend)["expired"] == 1
    [event] = [e for e in events(lines) if e["event"] == "reaped"]
    assert (event["key"], event["fence"]) == ("job:event:reaped", lease.fence)
    assert (event["outcome"], event["backend"]) == ("expired", "memory://events-reaped")
