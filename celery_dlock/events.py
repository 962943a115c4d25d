"""Structured log events: every line celery-dlock logs carries the same ``extra`` fields, so
that a JSON log setup (python-json-logger, structlog's stdlib bridge) gets fields, not prose.

Fields, on every record of the ``celery_dlock`` loggers (None where they do not apply):
``event`` (what happened, a stable name such as ``lease_lost``), ``key``, ``fence``,
``task_id``, ``outcome`` and ``backend`` (the store's URL, password masked).
"""

from __future__ import annotations

from typing import Any

from celery_dlock.records import Lease, Outcome

__all__ = ["FIELDS", "fields"]

#: The ``extra`` fields of every log record, in order.
FIELDS = ("event", "key", "fence", "task_id", "outcome", "backend")


def fields(
    event: str,
    lease: Lease | None = None,
    *,
    key: str | None = None,
    fence: int | None = None,
    task_id: str | None = None,
    outcome: Outcome | str | None = None,
    backend: str | None = None,
) -> dict[str, Any]:
    """The ``extra`` of a log record of ``event``; ``lease`` gives the key, fence and task
    id unless they are given."""
    if lease is not None:
        key = key if key is not None else lease.key
        fence = fence if fence is not None else lease.fence
        task_id = task_id if task_id is not None else lease.holder.task_id
    return {
        "event": event,
        "key": key,
        "fence": fence,
        "task_id": task_id,
        "outcome": None if outcome is None else str(outcome),
        "backend": backend,
    }
