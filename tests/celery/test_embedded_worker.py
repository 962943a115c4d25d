"""``embedded_worker``, the worker of one test's own app: it runs that app's tasks, and
stopping it leaves the session's embedded worker running (Celery's ``start_worker`` ends
every worker of the process as it stops, which timed out the next tests of the process)."""

from __future__ import annotations

from typing import Any

import pytest
from celery.bootsteps import RUN

from tests.celery import embedded_tasks as tasks
from tests.celery.support import embedded_app, embedded_worker, new_run


def test_a_tests_own_worker_runs_its_tasks_and_stops_alone(app: Any) -> None:
    own = embedded_app("own-worker")

    @own.task(shared=False)
    def double(n: int) -> int:
        return 2 * n

    with embedded_worker(own) as worker:
        assert double.delay(21).get(timeout=10) == 42
    assert worker.blueprint.state != RUN
    with pytest.raises(Exception, match="timed out"):
        double.delay(1).get(timeout=1)
    # The session's worker, in this same process, still takes the session app's tasks.
    app.set_current()
    run = new_run()
    assert tasks.refund.delay(run).get(timeout=10) == "refunded"
