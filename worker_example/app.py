"""The payments example's Celery app, configured by environment.

By default everything is embedded (no servers): kombu's ``filesystem://`` broker, a
``file://`` result backend, the file lock store and a SQLite ledger, all under
``DLOCK_EXAMPLE_DATA`` (default ``./demo-data``). For real services set:

    DLOCK_EXAMPLE_BROKER   redis://redis:6379/0
    DLOCK_EXAMPLE_RESULTS  redis://redis:6379/1
    DLOCK_EXAMPLE_LOCKS    postgresql://postgres@postgres:5432/payments?auto_migrate=1
    DLOCK_EXAMPLE_LEDGER   postgresql://postgres@postgres:5432/payments
    DLOCK_EXAMPLE_JANITOR  30   (seconds between janitor runs)
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from celery import Celery
from celery.schedules import crontab

from celery_dlock import install
from worker_example.broker import SCHEME

DATA = Path(os.environ.get("DLOCK_EXAMPLE_DATA", "demo-data")).absolute()


def _embedded_broker() -> dict[str, object]:
    # kombu's filesystem transport needs absolute folders that exist; in == out on one host.
    queue, control, processed = DATA / "queue", DATA / "control", DATA / "processed"
    for folder in (queue, control, processed, DATA / "results"):
        folder.mkdir(parents=True, exist_ok=True)
    return {
        "data_folder_in": str(queue),
        "data_folder_out": str(queue),
        "control_folder": str(control),
        "processed_folder": str(processed),
        "store_processed": False,
        "polling_interval": 0.1,
    }


app = Celery("worker_example", include=["worker_example.tasks"])
broker = os.environ.get("DLOCK_EXAMPLE_BROKER", "filesystem://")
app.conf.update(
    # filesystem://: kombu's, its message files written whole (worker_example.broker).
    broker_url=f"{SCHEME}://" if broker == "filesystem://" else broker,
    broker_transport_options=_embedded_broker() if broker == "filesystem://" else {},
    result_backend=os.environ.get("DLOCK_EXAMPLE_RESULTS", f"file://{DATA}/results"),
    dlock_backend=os.environ.get("DLOCK_EXAMPLE_LOCKS", f"file://{DATA}/locks"),
    dlock_janitor_interval=float(os.environ.get("DLOCK_EXAMPLE_JANITOR", "30")),
    worker_prefetch_multiplier=1,
    task_track_started=True,
    broker_connection_retry_on_startup=True,
    beat_schedule_filename=str(DATA / "beat-schedule"),
    beat_schedule={
        "nightly-report": {
            "task": "payments.nightly_report",
            "schedule": crontab(hour=2, minute=0),
        },
    },
)
install(app)  # worker signal handlers + the janitor on the beat schedule

LEDGER_URL = os.environ.get("DLOCK_EXAMPLE_LEDGER", f"sqlite:///{DATA}/ledger.sqlite")


def _same_database(a: str, b: str) -> bool:
    """Whether two Postgres URLs name one database (host, port, database; not the options)."""
    first, second = urlsplit(a), urlsplit(b)
    postgres = ("postgresql", "postgres")
    return (
        first.scheme in postgres
        and second.scheme in postgres
        and (
            (first.hostname, first.port, first.path) == (second.hostname, second.port, second.path)
        )
    )


#: The ledger lives in the lock store's own Postgres: each charge keeps its ``once`` success
#: in its own transaction (``record_success``), so the charge and its memory commit together.
TRANSACTIONAL_SUCCESS = _same_database(LEDGER_URL, app.conf.dlock_backend)
