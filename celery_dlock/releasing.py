"""How a lease's release ends, lease or no lease: the record, and what a lost lease still
owes ``once``.

A release that finds its lease gone records it ``lost``, naming the outcome it could not
record, and still keeps a success with a result for ``once`` (insert-if-absent: the first
success wins). A success whose store fails is tried again with backoff for a bounded time.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from celery_dlock import metrics
from celery_dlock.backends import mask_url
from celery_dlock.backends.base import LockBackend, remembered
from celery_dlock.errors import BackendError, ConfigurationError, LockLostError
from celery_dlock.events import fields
from celery_dlock.records import (
    DETAILS_LIMIT,
    Lease,
    Outcome,
    Record,
    describe_exception,
    truncate_utf8,
)

__all__ = [
    "Ending",
    "Unsettled",
    "end_block",
    "release",
    "release_success",
    "remember_success",
    "settle",
    "unsettled",
]

logger = logging.getLogger("celery_dlock")
_T = TypeVar("_T")

#: First and longest pause between two attempts to store a success while the store fails.
SUCCESS_PAUSE = 0.25
SUCCESS_PAUSE_MAX = 5.0
#: Records of a key read back to find a release whose reply was lost.
RECENT = 50
#: Releases kept for a later try while their store refuses them (``Unsettled``).
UNSETTLED_MAX = 1000


class Ending(NamedTuple):
    """What a release records: the lease, and how its holder says it ended (a named tuple:
    one is made at every release, at a third of a frozen dataclass's cost)."""

    lease: Lease
    outcome: Outcome
    problem: str | None
    details: str | None
    result: Any
    reported: bool


def release(
    backend: LockBackend, ending: Ending, retrying: bool = False, defer: bool = True
) -> Record | None:
    """Release ``ending``'s lease and settle it (see ``settle``). A release the store
    refuses is raised, and, with ``defer``, tried again at this process's next release
    that reaches the store (``unsettled``), so that its record is not lost for good."""
    lease = ending.lease
    started = time.perf_counter()
    try:
        record = backend.release(
            lease, ending.outcome, ending.problem, ending.details, ending.result
        )
    except BackendError:
        metrics.store_error(backend.name, "release")
        if defer:
            unsettled.add(backend, ending)
        raise
    except ConfigurationError as exc:
        if ending.result is None:
            raise
        # The store refused the result (Postgres: NaN is not JSON) before writing anything;
        # the lease, detached already, is released all the same, recorded without it.
        note = f"result not stored: {exc}"
        details = note if ending.details is None else f"{ending.details}\n{note}"
        release(backend, ending._replace(result=None, details=details), retrying, defer)
        raise
    metrics.store_call(backend.name, "release", started)
    if unsettled.items:
        unsettled.settle(backend)
    return settle(backend, ending, record, retrying)


def settle(
    backend: LockBackend, ending: Ending, record: Record | None, retrying: bool = False
) -> Record | None:
    """The end of a release whose store answered ``record``: counted, or, when the lease
    was gone (None), recorded ``lost`` (its success kept for ``once``). ``retrying``: an
    earlier attempt of this release failed, and its own record, found in the history,
    means it landed."""
    lease = ending.lease
    if record is not None:
        metrics.released(record)
        return record
    if retrying:  # an earlier attempt may have landed with its reply lost
        earlier = _record_of(backend, lease)
        # Another's record of the lease (the janitor's, a taker's ``disconnected``) settles
        # its history, not what a success still owes ``once``.
        owed = remembered(ending.outcome, ending.result, lease.holder.task_name) is not None
        if earlier is not None and (earlier.outcome is ending.outcome or not owed):
            return earlier
    _record_lost(backend, ending)
    return None


def release_success(backend: LockBackend, ending: Ending, retry: float) -> Record | None:
    """``_release`` of a success that ``once`` must remember, tried again with backoff
    while the store fails."""
    return _storing_success(
        backend,
        ending.lease,
        retry,
        lambda attempt: release(backend, ending, retrying=attempt > 1, defer=False),
        lambda: unsettled.add(backend, ending),
    )


def remember_success(backend: LockBackend, success: Record, retry: float) -> bool:
    """``backend.remember(success)``, tried again with backoff while the store fails (as
    :func:`release_success`, for a success kept apart from its lease's release)."""
    return _storing_success(
        backend, success.lease, retry, lambda _: backend.remember(success), lambda: None
    )


def _storing_success(
    backend: LockBackend,
    lease: Lease,
    retry: float,
    store: Callable[[int], _T],
    give_up: Callable[[], None],
) -> _T:
    """``store(attempt)``, tried again with backoff for up to ``retry`` seconds while the
    store fails; then ``give_up()`` and the error is raised."""
    deadline = time.monotonic() + retry
    pause = SUCCESS_PAUSE
    attempt = 1
    while True:
        try:
            stored = store(attempt)
        except BackendError as exc:
            if time.monotonic() + pause > deadline:
                give_up()
                logger.error(
                    "gave up storing the success of %s (fence %d) [%s] after %d attempts "
                    "in %.0f s: once may run this task again: %s",
                    lease.key,
                    lease.fence,
                    mask_url(backend.url),
                    attempt,
                    retry,
                    exc,
                    extra=fields("success_given_up", lease, backend=backend.url),
                )
                raise
            logger.warning(
                "could not store the success of %s (fence %d) [%s], attempt %d; trying "
                "again in %.2f s: %s",
                lease.key,
                lease.fence,
                mask_url(backend.url),
                attempt,
                pause,
                exc,
                extra=fields("success_retrying", lease, backend=backend.url),
            )
            time.sleep(pause)
            pause = min(pause * 2, SUCCESS_PAUSE_MAX)
            attempt += 1
            continue
        if attempt > 1:
            logger.warning(
                "stored the success of %s (fence %d) at attempt %d",
                lease.key,
                lease.fence,
                attempt,
                extra=fields("success_stored", lease, outcome=Outcome.SUCCEEDED),
            )
        return stored


class Unsettled:
    """Releases the store refused (it was down), oldest first, each tried again at this
    process's next release that reaches the same store: a lease still there is released
    with its own outcome; one the store lost meanwhile (a Postgres crash empties the locks
    table) is recorded ``lost``, unless someone recorded it already (the janitor, a taker)
    and it owes ``once`` no success (a success is kept, and recorded ``lost``, all the
    same). Those still waiting when the process ends are tried once more then (``settle_all``).
    Bounded; a forked child starts with none (they are its parent's)."""

    def __init__(self) -> None:
        self.items: list[tuple[LockBackend, Ending]] = []
        self._mutex = threading.Lock()
        self._settling = False
        self._at_exit = False

    def add(self, backend: LockBackend, ending: Ending) -> None:
        with self._mutex:
            if len(self.items) >= UNSETTLED_MAX:
                _, dropped = self.items.pop(0)
                logger.error(
                    "gave up settling the release of %s (fence %d): more than %d releases "
                    "are waiting for their store",
                    dropped.lease.key,
                    dropped.lease.fence,
                    UNSETTLED_MAX,
                    extra=fields("release_dropped", dropped.lease),
                )
            self.items.append((backend, ending))
            if not self._at_exit:
                # Registered now, after the process's own exit handler (which closes the
                # stores), so that it runs before it.
                atexit.register(self.settle_all)
                self._at_exit = True

    def settle_all(self) -> None:
        """Try each waiting release once more (as the process ends: at exit, and at a Celery
        worker child's shutdown, which skips exit handlers); log those that still fail."""
        for backend in dict.fromkeys(owner for owner, _ in list(self.items)):
            self.settle(backend)
        for _, ending in list(self.items):
            logger.error(
                "the release of %s (fence %d) never reached its store before this process "
                "ended: the janitor records its lease when it expires or its holder is gone",
                ending.lease.key,
                ending.lease.fence,
                extra=fields("release_unsettled", ending.lease),
            )

    def settle(self, backend: LockBackend) -> None:
        """Try again the releases waiting for ``backend`` (which just answered)."""
        with self._mutex:
            mine = [ending for owner, ending in self.items if owner is backend]
            if self._settling or not mine:
                return
            self.items = [item for item in self.items if item[0] is not backend]
            self._settling = True
        try:
            for n, ending in enumerate(mine):
                try:
                    record = release(backend, ending, retrying=True, defer=False)
                except BackendError:
                    with self._mutex:
                        self.items[:0] = [(backend, left) for left in mine[n:]]
                    return
                logger.warning(
                    "settled the release of %s (fence %d) that the store refused earlier: %s",
                    ending.lease.key,
                    ending.lease.fence,
                    "recorded lost" if record is None else f"recorded {record.outcome}",
                    extra=fields("release_settled", ending.lease),
                )
        finally:
            with self._mutex:
                self._settling = False

    def forget(self) -> None:
        self.items = []
        self._mutex = threading.Lock()
        self._settling = False


#: The releases of this process waiting for their store.
unsettled = Unsettled()
os.register_at_fork(after_in_child=unsettled.forget)


def _record_of(backend: LockBackend, lease: Lease) -> Record | None:
    """The record of ``lease``'s own release, if one is in the recent history."""
    for record in backend.history(key=lease.key, limit=RECENT):
        if record.lease.token == lease.token and record.outcome is not Outcome.LOST:
            return record if record.released_at >= lease.acquired_at else None
    return None


def _record_lost(backend: LockBackend, ending: Ending) -> None:
    """The lease was gone at release: keep its success (first wins) and record the
    release as ``lost``, naming the outcome it could not record."""
    lease, outcome = ending.lease, ending.outcome
    now = time.time()
    kept = ""
    if remembered(outcome, ending.result, lease.holder.task_name) is not None:
        success = Record(lease, now, outcome, ending.problem, ending.details, ending.result)
        kept = _keep(backend, success)
    note = f"{outcome} not recorded: the lease was lost before its release{kept}"
    text = "\n".join(part for part in (note, ending.problem, ending.details) if part)
    lost = Record(lease, now, Outcome.LOST, "lost", truncate_utf8(text, DETAILS_LIMIT), None)
    backend.add_record(lost)
    metrics.released(lost)
    if not ending.reported:  # else counted when it was reported (``report_lost``)
        metrics.lost(lease)
    logger.log(
        logging.WARNING if ending.reported else logging.ERROR,
        "lease on %s (fence %d) was lost before release [%s] (outcome %s): %s",
        lease.key,
        lease.fence,
        mask_url(backend.url),
        Outcome.LOST,
        note,
        extra=fields("release_lost", lease, outcome=Outcome.LOST, backend=backend.url),
    )


def _keep(backend: LockBackend, success: Record) -> str:
    """``remember`` the success of a lost lease; what became of it, in words."""
    if backend.remember(success):
        return "; its success is kept for once"
    task_name = str(success.lease.holder.task_name)
    kept = backend.last_success(success.key, task_name)
    if kept is not None and kept.lease.token == success.lease.token:
        return "; its success is kept for once"
    fence = "?" if kept is None else kept.lease.fence
    return f"; the success of fence {fence}, kept before it, stays (first wins)"


def end_block(release: Callable[..., Any], first: Lease, exc: BaseException | None) -> None:
    """The end of a ``with`` block over a lock: ``succeeded``, or ``failed`` with the
    exception's type, message and traceback; a lease lost meanwhile raises LockLostError
    (naming ``first``) unless the block raised already."""
    if exc is not None:
        problem, details = describe_exception(exc)
        release(Outcome.FAILED, problem, details)
    elif release(Outcome.SUCCEEDED) is None:
        raise LockLostError(first.key, first.fence, "release")
