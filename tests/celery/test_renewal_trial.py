"""``on_lock_lost="raise"`` under a real prefork worker (``tests.celery.renewal_trial_app``)
with the Redis lock store: a body whose lease an operator force-releases gets LockLostError
while it runs, the release is recorded ``lost`` (naming ``failed``), and ``once`` keeps no
success of it, so the next run runs the body, once, and the one after replays it.
``self.lease`` keeps its key, token and fence across renewals. Every check reads the
store or the ledger the bodies write."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_dlock import LockLostError, Outcome
from tests.celery.prefork import Worker, running
from tests.celery.support import own_store
from tests.support import eventually, force_release

pytestmark = pytest.mark.slow


class RenewalWorker(Worker):
    """A prefork worker of ``tests.celery.renewal_trial_app``."""

    module = "renewal_trial_app"


@pytest.fixture(scope="module")
def trial(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[RenewalWorker]:
    with (
        own_store("redis", "renewal") as url,
        running(tmp_path_factory.mktemp("renewal"), redis_url, url, RenewalWorker) as worker,
    ):
        yield worker


def events(worker: Worker, run: str, event: str) -> list[dict[str, Any]]:
    return [e for e in worker.events() if e.get("run") == run and e["event"] == event]


def test_raise_stops_the_body_records_lost_and_once_runs_the_body_once_more(
    trial: RenewalWorker,
) -> None:
    run = uuid.uuid4().hex[:8]
    key = f"job:sync:{run}"
    first = trial.tasks.sync.delay(run)
    [renewed] = eventually(lambda: events(trial, run, "renewed"), "the lease renewed twice")
    assert renewed["same"] is True
    [start] = events(trial, run, "start")
    forced = force_release(trial.store, key, "an operator's release --force")
    assert forced is not None and forced.lease.token == start["token"]

    error = eventually(
        lambda: first.ready() and first.get(propagate=False), "the first run ended", 30
    )
    assert isinstance(error, LockLostError) and error.key == key, repr(error)
    assert first.state == "FAILURE"
    assert events(trial, run, "lost") and not events(trial, run, "end")
    mine = [r for r in trial.history(key) if r.lease.token == start["token"]]
    assert [r.outcome for r in mine] == [Outcome.FORCED, Outcome.LOST]
    assert "failed not recorded" in (mine[1].details or "")

    (trial.ledger.parent / f"go-{run}").touch()
    second = trial.tasks.sync.delay(run).get(timeout=30)
    third = trial.tasks.sync.delay(run).get(timeout=30)
    starts = events(trial, run, "start")
    assert len(starts) == 2 and len(events(trial, run, "end")) == 1
    assert second == third == {"run": run, "fence": starts[1]["fence"]}
    assert starts[1]["fence"] > start["fence"]
    assert trial.store.get(key) is None
