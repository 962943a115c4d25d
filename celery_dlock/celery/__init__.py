"""The Celery layer: :class:`LockedTask`, the worker signal handlers, the janitor task, and
``install(app)``, which connects the last two. It uses the lock stores only through
:class:`celery_dlock.Lock` and :func:`celery_dlock.reap.reap`.

Modules: ``settings`` (pure reads of ``app.conf.dlock_*``), ``task``, ``signals``,
``janitor``. Importing this package needs Celery (``pip install 'celery-dlock[celery]'``).
"""

from __future__ import annotations

from typing import Any

from celery import Celery, bootsteps

from celery_dlock.celery import signals
from celery_dlock.celery.janitor import register as register_janitor
from celery_dlock.celery.settings import backend_for
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
    app.steps["worker"].add(CheckSettings)
    if janitor:
        register_janitor(app)


class CheckSettings(bootsteps.Step):  # type: ignore[misc]
    """A worker step that reads the ``dlock_*`` settings and builds the lock store from
    ``dlock_backend`` (without connecting) as the worker starts: a bad setting stops the
    worker with its ``ConfigurationError`` (a signal handler's error would only be logged),
    where every task would otherwise fail and its message be lost."""

    name = "celery_dlock.check_settings"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        backend_for(parent.app)
