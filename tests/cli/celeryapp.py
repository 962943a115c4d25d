"""The Celery app that ``celery -A celeryapp dlock ...`` loads in tests/cli.

Configured by environment: ``DLOCK_CLI_BACKEND`` (the lock store's URL; unset: the default
file store), ``DLOCK_CLI_NAMESPACE`` (default ``job``) and ``DLOCK_CLI_JANITOR`` (the
janitor interval in seconds, default 30). No broker is contacted by the ``dlock`` commands.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_dlock import install

app = Celery("celeryapp", broker="memory://")
if "DLOCK_CLI_BACKEND" in os.environ:
    app.conf.dlock_backend = os.environ["DLOCK_CLI_BACKEND"]
app.conf.dlock_namespace = os.environ.get("DLOCK_CLI_NAMESPACE", "job")
app.conf.dlock_janitor_interval = float(os.environ.get("DLOCK_CLI_JANITOR", "30"))
install(app)
