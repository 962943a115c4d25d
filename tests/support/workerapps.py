"""What the apps of the real prefork workers share (``tests/celery/workerapp.py`` and the apps
beside it, run by ``tests.celery.prefork``): the app, configured by environment, the
decorator of their tasks, and the ledger file their bodies append events to.

The environment: DLOCK_TEST_BROKER, DLOCK_TEST_RESULTS, DLOCK_TEST_LOCKS (lock store URL),
DLOCK_TEST_LEDGER (the ledger file), and optionally DLOCK_TEST_QUEUE (default queue),
DLOCK_TEST_VISIBILITY (Redis visibility timeout, s), DLOCK_TEST_JANITOR (interval, s) and
DLOCK_TEST_METRICS ("1": dlock_metrics on).

A worker imports these apps as top-level modules (``celery -A workerapp``, run in
tests/celery): each puts the tree's root on ``sys.path`` before it imports this module.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery

from celery_dlock import LockedTask, install


def worker_app(main: str) -> Celery:
    """A Celery app named ``main``, configured by the environment, with celery-dlock
    installed."""
    app = Celery(main)
    app.conf.update(
        broker_url=os.environ["DLOCK_TEST_BROKER"],
        result_backend=os.environ["DLOCK_TEST_RESULTS"],
        dlock_backend=os.environ["DLOCK_TEST_LOCKS"],
        dlock_janitor_interval=float(os.environ.get("DLOCK_TEST_JANITOR", "3600")),
        dlock_metrics=os.environ.get("DLOCK_TEST_METRICS") == "1",
        task_default_queue=os.environ.get("DLOCK_TEST_QUEUE", "celery"),
        worker_prefetch_multiplier=1,
        task_track_started=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": float(os.environ.get("DLOCK_TEST_VISIBILITY", "3600")),
            "unacked_restore_interval": 0.5,
            "unacked_restore_throttle": 1,
        },
    )
    install(app)
    return app


def locked_task(app: Celery, name: str, **options: Any) -> Callable[[Any], Any]:
    """``@app.task`` for a bound task of ``app`` alone named ``name``: a ``LockedTask``,
    or the subclass given as ``base``, with the other ``options``."""
    options.setdefault("base", LockedTask)
    decorate: Callable[[Any], Any] = app.task(shared=False, bind=True, name=name, **options)
    return decorate


def write_event(event: str, task: Any, **data: Any) -> None:
    """Append one event of ``task``'s run, in order, to the ledger file: its task name,
    id and process, and ``data``."""
    entry = {"event": event, "task": task.name, "id": task.request.id, "pid": os.getpid(), **data}
    with open(os.environ["DLOCK_TEST_LEDGER"], "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(entry) + "\n")


def ledger(event: str, task: Any, **data: Any) -> None:
    """:func:`write_event` with the lease the body holds: its key, fence and token (None
    before the body's lock is taken)."""
    lease = task.lease
    write_event(
        event,
        task,
        key=None if lease is None else lease.key,
        fence=None if lease is None else lease.fence,
        token=None if lease is None else lease.token,
        **data,
    )


def beside_ledger(name: str) -> Path:
    """The file ``name`` beside the ledger: where a test leaves word for the bodies."""
    return Path(os.environ["DLOCK_TEST_LEDGER"]).with_name(name)


def kill_if_asked(name: str) -> None:
    """SIGKILL this process if a file ``kill-<name>`` lies beside the ledger; the file is
    removed first, so a redelivery runs to its end."""
    hook = beside_ledger(f"kill-{name}")
    if hook.exists():
        hook.unlink()
        os.kill(os.getpid(), signal.SIGKILL)
