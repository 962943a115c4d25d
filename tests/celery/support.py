"""Helpers of the embedded-worker tests."""

from __future__ import annotations

import uuid

from celery_dlock import (
    Outcome,
)
from celery_dlock.backends.memory import MemoryBackend


def new_run() -> str:
    return uuid.uuid4().hex[:12]


def outcomes(store: MemoryBackend, key: str) -> list[Outcome]:
    return [record.outcome for record in reversed(store.history(key=key))]
