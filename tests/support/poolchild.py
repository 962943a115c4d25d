"""This process's main thread as a Celery pool child's, for the soft time limit's tests:
billiard's SIGUSR1 handler installed, and a fresh guard (``celery_dlock.celery.softlimit``)
and count of store regions (``celery_dlock.critical``), put in place by the first task."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from billiard.pool import soft_timeout_sighandler

from celery_dlock import critical
from celery_dlock.celery import softlimit


@pytest.fixture
def pool_child(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Billiard's SIGUSR1 handler, and no guard until a task puts it in place."""
    previous = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
    monkeypatch.setattr(softlimit, "_guard", softlimit._Guard())
    monkeypatch.setattr(critical, "state", critical._State())
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)
