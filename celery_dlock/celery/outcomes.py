"""What a task's run becomes in the history: the outcome of an exception, and the result a
``once`` success keeps for its duplicates to replay."""

from __future__ import annotations

import json
import logging
from typing import Any

from celery.exceptions import Ignore, TaskRevokedError

from celery_dlock.events import fields
from celery_dlock.records import Outcome

__all__ = ["outcome_of", "replayed", "stored_result"]

logger = logging.getLogger("celery_dlock.task")


def outcome_of(exc: BaseException) -> Outcome:
    """The outcome of a body that raised ``exc`` (Retry is handled before this)."""
    if isinstance(exc, Ignore):
        return Outcome.SKIPPED
    # billiard raises Terminated in a child that gets SIGTERM (revoke(terminate=True)).
    if isinstance(exc, (TaskRevokedError, SystemExit, KeyboardInterrupt)) or type(exc).__name__ in (
        "Terminated",
        "WorkerTerminate",
    ):
        return Outcome.REVOKED
    return Outcome.FAILED


def stored_result(task_name: str, result: Any) -> dict[str, Any]:
    """What a ``once`` success keeps for replays: ``{"value": result}`` (never None, so the
    store keeps it as the key's last success even when the task returned None)."""
    try:
        json.dumps(result)
    except (TypeError, ValueError):
        logger.warning(
            "%s returned a value that is not JSON (%s): once-replays will return None",
            task_name,
            type(result).__name__,
            extra=fields("result_not_json"),
        )
        return {"value": None, "unstored": type(result).__qualname__}
    return {"value": result}


def replayed(stored: Any) -> Any:
    """The value a ``once`` duplicate returns, from what ``stored_result`` kept."""
    return stored.get("value") if isinstance(stored, dict) else stored
