"""The janitor as a Celery task on the beat schedule: ``register(app)`` adds the
``celery_dlock.janitor`` task, which runs :func:`celery_dlock.reap.reap` with the app's
settings, and its beat entry every ``dlock_janitor_interval`` seconds.

A ``celery beat`` of an app whose ``dlock_*`` settings are bad stops as it starts, with the
``ConfigurationError`` naming the setting: an error raised in a signal handler is only
logged, and that beat used to run on without the janitor's entry (or, with an interval past
year 9999, log "Cannot calculate the next run" every second), so no lease was ever reaped.
(Durations past 100 years are refused with the other settings.)

The task looks at the dedupe marks (``dlock_janitor_marks``) at most every
:data:`MARKS_EVERY` seconds in each worker process, not at every run: a look lists every
lease of the namespace (on an object store, a read of each), and a mark is released only
once its message's run ended :data:`~celery_dlock.marks.GRACE` seconds ago anyway.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery
from celery import signals as celery_signals

from celery_dlock.celery.settings import backend_for, forget_settings, settings
from celery_dlock.errors import ConfigurationError
from celery_dlock.marks import GRACE
from celery_dlock.reap import JANITOR_QUIET, JANITOR_TASK, reap

__all__ = ["MARKS_EVERY", "register"]

#: Seconds between two looks at the dedupe marks by the janitor task in one process.
MARKS_EVERY = GRACE / 2


def _interval(app: Celery) -> float:
    """``dlock_janitor_interval`` of ``app``.

    Raises:
        ConfigurationError: a bad ``dlock_*`` setting (an interval past 100 years, say).
    """
    return settings(app).janitor_interval


def register(app: Celery) -> Any:
    """Add the janitor task to ``app`` and its beat entry, whatever the order of
    configuration; returns the task."""
    existing = getattr(app, "_dlock_janitor", None)
    if existing is not None:
        return existing

    looked_at: float | None = None  # when this process's task last looked at the marks

    @app.task(name=JANITOR_TASK, ignore_result=False, shared=False)  # type: ignore[untyped-decorator]
    def janitor() -> dict[str, int]:
        """Reap leases whose holder is gone, release the dedupe marks held for a message
        that has run, and prune history past retention; a run with nothing to do is
        recorded once an hour (``reap``'s ``quiet_for``)."""
        nonlocal looked_at
        current = settings(app)
        now = time.monotonic()
        due = looked_at is None or now - looked_at >= MARKS_EVERY
        marks = current.janitor_marks if due else 0
        counts = reap(
            backend_for(app),
            namespace=current.namespace,
            retention=current.history_retention,
            quiet_for=JANITOR_QUIET,
            marks=marks,
        )
        if marks:
            looked_at = now
        return counts

    def add_entry(sender: Any = None, **_: Any) -> None:
        target = sender if sender is not None else app
        if target is not app:
            return
        forget_settings(app)  # a (re)configuration: read the settings anew
        interval = _interval(app)
        app.add_periodic_task(interval, janitor.s(), name=JANITOR_TASK)

    # on_after_configure fires once per (re)configuration; an app already configured gets the
    # entry now. Both are needed: see the Celery 5.7 notes on configuration order.
    app.on_after_configure.connect(add_entry, weak=False)
    if app.configured:
        add_entry(app)

    def ensure_entry(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        try:
            interval = _interval(app)
        except ConfigurationError as exc:
            # Signal.send logs an Exception and goes on; SystemExit stops this beat.
            raise SystemExit(f"celery beat: {exc}") from exc
        # A beat_schedule dict assigned after install replaces ours: put it back.
        scheduler = getattr(sender, "scheduler", None)
        if scheduler is not None and JANITOR_TASK not in scheduler.schedule:
            scheduler.update_from_dict({JANITOR_TASK: {"task": JANITOR_TASK, "schedule": interval}})

    celery_signals.beat_init.connect(ensure_entry, weak=False)
    app._dlock_janitor = janitor
    return janitor
