"""The Celery layer: :class:`LockedTask`, the worker signal handlers, the janitor task, and
``install(app)``, which connects the last two. It uses the lock stores only through
:class:`celery_dlock.Lock` and :func:`celery_dlock.reap.reap`.

Modules: ``settings`` (pure reads of ``app.conf.dlock_*``), ``task``, ``signals``,
``janitor``. Importing this package needs Celery (``pip install 'celery-dlock[celery]'``).
"""

from __future__ import annotations

from celery import Celery

from celery_dlock.celery import signals
from celery_dlock.celery.janitor import register as register_janitor
from celery_dlock.celery.task import LockedTask

__all__ = ["LockedTask", "install"]


def install(app: Celery, *, janitor: bool = True) -> None:
    """Connect celery-dlock to ``app``: the worker signal handlers and, unless ``janitor``
    is False, the janitor task with its beat entry every ``dlock_janitor_interval``.

    Safe to call more than once, before or after the app is configured.
    """
    # Nothing here may read app.conf: that would configure the app now, and a
    # beat_schedule the user assigns afterwards would replace the janitor's entry.
    signals.connect()
    if janitor:
        register_janitor(app)
