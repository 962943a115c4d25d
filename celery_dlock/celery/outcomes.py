"""What a task's run becomes in the history: the outcome of an exception, and the result a
``once`` success keeps for its duplicates to replay."""

from __future__ import annotations

import json
import logging
from typing import Any

from celery import Signature
from celery.exceptions import Ignore, Retry, TaskRevokedError
from kombu.utils import json as kombu_json

from celery_dlock.events import fields
from celery_dlock.records import HANDED_ON, Outcome

__all__ = [
    "REPLACED",
    "lineage",
    "outcome_of",
    "replaced_by",
    "replacement",
    "replayed",
    "stored_result",
]

logger = logging.getLogger("celery_dlock.task")

#: The field of a kept success whose run was handed to a replacement (``Task.replace``).
REPLACED = "replaced"


def outcome_of(exc: BaseException) -> Outcome:
    """The outcome of a run that raised ``exc``: ``retried`` for a Retry (the same task goes
    on; a body's own retry keeps its lock, handled before this: ``LockedTask._retrying``)."""
    if isinstance(exc, Retry):
        return Outcome.RETRIED
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
    store keeps it as the key's last success even when the task returned None), in kombu's
    JSON, as Celery's ``json`` serializer sends it: a ``Decimal``, ``datetime``, ``UUID`` or
    ``bytes`` is kept tagged, and replayed as that type (:func:`replayed`). NaN and
    Infinity, which Celery sends but JSON cannot hold (the Postgres store refuses them), are
    not JSON here either, on every store."""
    try:
        text = kombu_json.dumps(result)  # type: ignore[no-untyped-call]
        value = json.loads(text, parse_constant=_not_json)
    except (TypeError, ValueError, RecursionError) as exc:
        logger.warning(
            "%s returned a value that is not JSON (%s: %s): once-replays will return None",
            task_name,
            type(result).__name__,
            type(exc).__name__,
            extra=fields("result_not_json"),
        )
        return {"value": None, "unstored": type(result).__qualname__}
    return {"value": value}


def replaced_by(request: Any) -> str | None:
    """What the running ``request``'s body handed its run to with ``Task.replace`` (the
    signature was sent, then Celery raised ``Ignore``), described; None when it did not."""
    sig = getattr(request, "dlock_replaced_by", None)
    if sig is None:
        return None
    name = getattr(sig, "name", None) or type(sig).__name__
    return f"{HANDED_ON}{name}: its result comes under task id {request.id}"


def replacement(request: Any) -> dict[str, Any]:
    """What a ``once`` success kept by a body that replaced itself holds: no value (the
    result is the replacement's, under the task's own id), and what tells the replacement
    (and the steps of a chain replacing it) from a duplicate: its ``replaced_task_nesting``,
    the workflow's root id and the ids of this task's later steps in the chain the run was
    in (:func:`~celery_dlock.celery.once.continues`)."""
    nesting, root = lineage(request)
    # Celery appends the steps of the chain the run was in to its replacement, one nesting
    # deeper like it: those of this task are later runs, not the replacement.
    later = [
        step.get("options", {}).get("task_id")
        for step in getattr(request, "chain", None) or ()
        if step.get("task") == getattr(request, "task", None)
    ]
    sig: Any = getattr(request, "dlock_replaced_by", None)
    # Itself again (a page of a sync, not a chain or group): the last page's value is the
    # run's result.
    itself = type(sig) is Signature and sig.task == getattr(request, "task", None)
    handed = {"nesting": nesting + 1, "root_id": root, "later": later, "itself": itself}
    return {"value": None, REPLACED: handed}


def lineage(request: Any) -> tuple[int, str]:
    """How many replacements deep ``request`` runs (Celery's ``replaced_task_nesting``),
    and the id of its workflow's root (its own id for a message sent by itself)."""
    nesting = getattr(request, "replaced_task_nesting", 0) or 0
    return nesting, getattr(request, "root_id", None) or request.id


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def replayed(stored: Any) -> Any:
    """The value a ``once`` duplicate returns, from what ``stored_result`` kept: what the
    first run's caller got through Celery's ``json`` serializer."""
    value = stored.get("value") if isinstance(stored, dict) else stored
    if isinstance(value, (dict, list)):  # may hold kombu's tagged values
        return kombu_json.loads(json.dumps(value))  # type: ignore[no-untyped-call]
    return value
