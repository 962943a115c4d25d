"""Embedded-worker fixtures: one Celery app and one worker thread for the session.

The worker runs the tasks of ``tests.celery.embedded_tasks`` with the solo pool in a thread
of the test process, so the tests share the memory lock store with it and can hold keys
themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

# pytest-celery 1.x shadows this fixture with a Docker worker; the classic one wins here.
from celery.contrib.pytest import celery_worker  # noqa: F401

from celery_dlock import install
from celery_dlock.backends.memory import MemoryBackend

STORE = "memory://celery-tests"


@pytest.fixture(scope="session")
def celery_config() -> dict[str, Any]:
    return {
        "broker_url": "memory://",
        "broker_transport_options": {"polling_interval": 0.02},
        "result_backend": "cache+memory://",
        "result_serializer": "json",
        "task_serializer": "json",
        "dlock_backend": STORE,
        "dlock_janitor_interval": 3600.0,
    }


@pytest.fixture(scope="session")
def celery_includes() -> list[str]:
    return ["tests.celery.embedded_tasks"]


@pytest.fixture(scope="session")
def session_app(celery_session_app: Any, celery_session_worker: Any) -> Iterator[Any]:
    install(celery_session_app)
    yield celery_session_app


@pytest.fixture
def app(session_app: Any) -> Any:
    # Any Celery() made meanwhile (another test module's app) became the current app, and
    # the shared tasks of embedded_tasks resolve through the current app: make it ours.
    session_app.set_current()
    session_app.set_default()
    return session_app


@pytest.fixture
def store() -> MemoryBackend:
    backend = MemoryBackend.from_url(STORE)
    assert isinstance(backend, MemoryBackend)
    return backend
