"""``embedded_worker``, the worker of one test's own app: it runs that app's tasks, and
stopping it leaves the session's embedded worker running (Celery's ``start_worker`` ends
every worker of the process as it stops, which timed out the next tests of the process)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from celery.bootsteps import RUN

from tests.celery import embedded_tasks as tasks
from tests.celery.support import embedded_worker, new_run


def test_a_tests_own_worker_runs_its_tasks_and_stops_alone(app: Any) -> None:
    own = Celery("own-worker", set_as_current=False)
    own.conf.update(
        broker_url="memory://",
        task_default_queue=f"own-worker-{uuid.uuid4().hex[:8]}",
        broker_transport_options={"polling_interval": 0.02},
        result_backend="cache+memory://",
    )

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
