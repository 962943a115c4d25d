"""Structured log events: every line celery-dlock logs carries ``event``, ``key``, ``fence``,
``task_id``, ``outcome`` and ``backend`` as ``extra`` fields (checked on the source: every
logging call passes them; and on real events: a lost lease, its lost release, an abandoned
Lock), so a JSON formatter gets fields, not prose."""

from __future__ import annotations

import ast
import gc
import json
import logging
from pathlib import Path

import pytest

from celery_dlock import Lock, Outcome
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.events import FIELDS
from tests.support import eventually, force_release

PACKAGE = Path(__file__).parent.parent / "celery_dlock"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def test_every_logging_call_of_the_package_passes_the_event_fields() -> None:
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LEVELS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "logger"
                and not any(keyword.arg == "extra" for keyword in node.keywords)
            ):
                bare.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert bare == []


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
    assert released["backend"] == backend.url
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
