"""``Task.replace`` and a ``dedupe="until_finished"`` mark: the mark goes on with the
replacement when it is the same logical task, the same task on the same key (a sync that
replaces itself page by page), so that duplicates are coalesced until the last page ends,
not only until the first. A replacement by another task, or on another key, ends the mark
with the replaced run (``succeeded``): nothing of that task would release it.
"""

from __future__ import annotations

from typing import Any

from celery import Signature

from celery_dlock.celery.dedupe import DEDUPE_HEADER, extend_mark, mark_key, mark_ttl
from celery_dlock.celery.settings import settings
from celery_dlock.errors import LockKeyError

__all__ = ["hand_mark"]


def hand_mark(task: Any, sig: Any) -> None:
    """Put the ``until_finished`` mark of ``task``'s running request into the message of
    ``sig``, its replacement, if ``sig`` is the same task on the same mark key: the
    replacement's worker then releases it when that body ends, by its token. The mark is
    made to live as the replacement's own would (:func:`~celery_dlock.celery.dedupe.mark_ttl`:
    ``dedupe_ttl`` past its countdown or eta, and no longer than its ``expires``). A send
    that fails still ends it with the replaced run (``failed``)."""
    mark = getattr(task.request, "dlock_mark", None)
    if mark is None or task.dedupe != "until_finished":
        return
    if type(sig) is not Signature or sig.task != task.name:  # not a chain, group or chord
        return
    try:
        lock_key = task.lock_key_for(
            tuple(sig.args), dict(sig.kwargs), settings(task.app).namespace
        )
    except LockKeyError:
        return
    if mark_key(lock_key, task.name) != mark.key:
        return
    ttl = mark_ttl(task, settings(task.app).dedupe_ttl, sig.options)
    extend_mark(task, mark, ttl, shorten=True)  # the new message's: to its expires, say
    sig.set(headers={**(sig.options.get("headers") or {}), DEDUPE_HEADER: mark.to_dict()})
    task.request.dlock_mark_handed = True
