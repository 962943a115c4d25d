"""The app of tests/celery/test_janitor_trial.py, for a ``celery beat`` of its own: its
``dlock_*`` settings come from the environment (``DLOCK_TRIAL_BACKEND``, and
``DLOCK_TRIAL_INTERVAL``, a Python literal such as ``30.0`` or ``'30'``)."""

from __future__ import annotations

import ast
import os

from celery import Celery

from celery_dlock import install

app = Celery("janitor_trial", broker="memory://", set_as_current=False)
app.conf.dlock_backend = os.environ["DLOCK_TRIAL_BACKEND"]
if "DLOCK_TRIAL_INTERVAL" in os.environ:
    app.conf.dlock_janitor_interval = ast.literal_eval(os.environ["DLOCK_TRIAL_INTERVAL"])
install(app)
