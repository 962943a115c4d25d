"""``Task.replace`` with a ``dedupe`` mark and with ``once`` tried adversarially on a real
prefork worker of ``tests.celery.replace_trial_app`` (Redis broker; the Postgres and file
stores): the replacement revoked, failing, retried, cut by its soft time limit, expired;
duplicates while a page is queued or runs; a replacement on another key; ``until_started``;
two deliveries of one page at once; ``record_success`` in every page, each delivered again.
Every check reads the store (leases, history, kept successes) and the bodies' ledger."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TaskRevokedError, TimeLimitExceeded
from celery.result import AsyncResult

from celery_dlock import Outcome
from celery_dlock.celery.dedupe import EXPIRY_GRACE
from celery_dlock.errors import DuplicateTaskError
from celery_dlock.records import Lease, Record
from tests.celery.prefork import running, settled
from tests.celery.test_replace_trial import TrialWorker, new, outcomes, starts
from tests.cli.clitools import run_cli
from tests.support import eventually

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trial(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, lock_url: str
) -> Iterator[TrialWorker]:
    with running(tmp_path_factory.mktemp("marks"), redis_url, lock_url, TrialWorker) as worker:
        yield worker


def mark_key(task: str, customer: str) -> str:
    """The dedupe mark key of ``r.<task>`` for ``customer``."""
    return f"job:{task}:{customer}#queued:r.{task}"


def pages(worker: TrialWorker, task: str, task_id: str) -> list[int]:
    """The pages whose bodies started under ``task_id``, in order."""
    return [e["page"] for e in starts(worker, f"r.{task}", id=task_id)]


def ended(worker: TrialWorker, key: str) -> list[Record]:
    """The records of the mark ``key``, oldest first."""
    return worker.history(key)


def page_ended(worker: TrialWorker, key: str, count: int) -> None:
    eventually(
        lambda: len(worker.history(key)) >= count, f"{count} runs ended on {key}", timeout=60
    )


# -- until_finished: the replacement queued, revoked -------------------------------------

#: The second page sent 5 s on.
WAITING = {"next": {"countdown": 5}}


def second_page_waiting(trial: TrialWorker) -> tuple[str, AsyncResult, Lease]:
    """A two-page ``paged`` sync whose first page ended and whose second waits out its
    countdown, holding the mark that went on with it: (customer, result, mark)."""
    customer = new()
    first = trial.tasks.paged.delay(customer, 1, 2, WAITING)
    page_ended(trial, f"job:paged:{customer}", 1)
    mark = trial.store.get(mark_key("paged", customer))
    assert mark is not None and mark.holder.task_id == first.id  # went on with page 2
    return customer, first, mark


def test_a_plain_revoke_of_the_replacement_waiting_out_its_countdown_ends_the_mark_revoked(
    trial: TrialWorker,
) -> None:
    customer, first, mark = second_page_waiting(trial)
    first.revoke()
    eventually(lambda: trial.store.get(mark.key) is None, "the mark released", timeout=30)
    [record] = ended(trial, mark.key)
    assert (record.outcome, record.lease.token) == (Outcome.REVOKED, mark.token)
    after = trial.tasks.paged.delay(customer, 1, 1, {})
    assert after.id != first.id
    assert after.get(timeout=60) == {"pages": 1}
    with pytest.raises(TaskRevokedError):
        first.get(timeout=60)
    settled(trial)
    assert pages(trial, "paged", first.id) == [1]  # the chain stopped: page 2 never ran


def test_revoke_queued_of_the_replacement_waiting_out_its_countdown_ends_the_mark_revoked(
    trial: TrialWorker,
) -> None:
    customer, first, mark = second_page_waiting(trial)
    assert trial.tasks.paged.revoke_queued(customer, 1, 2, WAITING) == first.id
    assert trial.store.get(mark.key) is None  # at once
    [record] = ended(trial, mark.key)
    assert (record.outcome, record.lease.token) == (Outcome.REVOKED, mark.token)
    assert "revoke_queued" in (record.details or "")
    with pytest.raises(TaskRevokedError):
        first.get(timeout=60)
    settled(trial)
    assert pages(trial, "paged", first.id) == [1]
    assert trial.store.get(f"job:paged:{customer}") is None
    assert ended(trial, mark.key) == [record]  # the discarded message released nothing more


# -- until_finished: the replacement fails, retries, is cut short ------------------------


def test_a_replacement_that_fails_ends_the_mark_failed_and_a_duplicate_sends(
    trial: TrialWorker,
) -> None:
    customer = new()
    first = trial.tasks.paged.delay(customer, 1, 3, {"fail": 2})
    with pytest.raises(ValueError, match="page 2 fails"):
        first.get(timeout=60)
    key = mark_key("paged", customer)
    [record] = ended(trial, key)
    assert (record.outcome, record.problem) == (Outcome.FAILED, "ValueError")
    assert record.lease.holder.task_id == first.id
    assert trial.store.get(key) is None
    assert outcomes(trial, f"job:paged:{customer}") == [Outcome.SUCCEEDED, Outcome.FAILED]
    after = trial.tasks.paged.delay(customer, 1, 1, {})
    assert after.id != first.id and after.get(timeout=60) == {"pages": 1}
    settled(trial)
    assert pages(trial, "paged", first.id) == [1, 2]


def test_a_replacement_that_retries_keeps_the_mark_until_its_retry_ends(
    trial: TrialWorker,
) -> None:
    customer = new()
    first = trial.tasks.paged.delay(customer, 1, 2, {"again": 2, "again_in": 4})
    eventually(lambda: pages(trial, "paged", first.id) == [1, 2], "page 2 tried", timeout=60)
    key = mark_key("paged", customer)
    mark = trial.store.get(key)
    assert mark is not None and mark.holder.task_id == first.id  # kept for the retry
    assert trial.tasks.paged.delay(customer, 1, 2, {}).id == first.id  # coalesced
    assert first.get(timeout=60) == {"pages": 2}
    settled(trial)
    assert [(e["page"], e["retries"]) for e in starts(trial, "r.paged", id=first.id)] == [
        (1, 0),
        (2, 0),
        (2, 1),
    ]
    [record] = ended(trial, key)
    assert (record.outcome, record.lease.token) == (Outcome.SUCCEEDED, mark.token)
    assert trial.store.get(key) is None


def test_a_replacement_cut_by_its_soft_time_limit_ends_the_mark_failed(
    trial: TrialWorker,
) -> None:
    customer = new()
    how = {"next": {"soft_time_limit": 1}, "pause": 4}
    first = trial.tasks.paged.delay(customer, 1, 2, how)
    with pytest.raises(SoftTimeLimitExceeded):
        first.get(timeout=60)
    key = mark_key("paged", customer)
    [record] = ended(trial, key)
    assert (record.outcome, record.problem) == (Outcome.FAILED, "SoftTimeLimitExceeded")
    assert trial.store.get(key) is None
    assert trial.store.get(f"job:paged:{customer}") is None
    assert outcomes(trial, f"job:paged:{customer}") == [Outcome.SUCCEEDED, Outcome.FAILED]
    assert trial.tasks.paged.delay(customer, 1, 1, {}).id != first.id
    settled(trial)  # the soft-limited job read by the worker before any shutdown: see settled


def test_a_replacement_killed_by_its_hard_time_limit_ends_the_mark_disconnected(
    trial: TrialWorker,
) -> None:
    customer = new()
    how = {"next": {"countdown": 1, "time_limit": 2}, "pause": 6}
    first = trial.tasks.paged.delay(customer, 1, 2, how)
    page_ended(trial, f"job:paged:{customer}", 1)
    key = mark_key("paged", customer)
    mark = trial.store.get(key)
    assert mark is not None
    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=60)
    eventually(lambda: ended(trial, key) != [], "the mark ended", timeout=30)
    [record] = ended(trial, key)
    assert (record.outcome, record.lease.token) == (Outcome.DISCONNECTED, mark.token)
    eventually(
        lambda: trial.store.get(f"job:paged:{customer}") is None, "page 2's key freed", timeout=30
    )
    # As a plain task's (test_worker_death): billiard SIGTERMs the child before it kills it.
    assert outcomes(trial, f"job:paged:{customer}")[0] is Outcome.SUCCEEDED
    assert outcomes(trial, f"job:paged:{customer}")[1:] in (
        [Outcome.DISCONNECTED],
        [Outcome.REVOKED],
    )
    assert trial.tasks.paged.delay(customer, 1, 1, {}).id != first.id


def test_a_revoke_while_the_replaced_run_runs_discards_its_replacement_and_ends_the_mark(
    trial: TrialWorker,
) -> None:
    """A plain revoke does not stop the running page 1, and leaves its mark; page 1 then
    hands its run to page 2, under the same (revoked) task id: the worker discards it, and
    the mark that went on with it ends ``revoked``."""
    customer = new()
    first = trial.tasks.paged.delay(customer, 1, 2, {"first_pause": 3})
    eventually(lambda: pages(trial, "paged", first.id) == [1], "page 1 runs", timeout=30)
    first.revoke()
    key = mark_key("paged", customer)
    time.sleep(1.0)  # the revoke reached the worker, which looked at the mark
    mark = trial.store.get(key)
    assert mark is not None and mark.holder.task_id == first.id  # page 1 still runs
    eventually(lambda: ended(trial, key) != [], "the mark ended", timeout=30)
    [record] = ended(trial, key)
    assert (record.outcome, record.lease.token) == (Outcome.REVOKED, mark.token)
    with pytest.raises(TaskRevokedError):
        first.get(timeout=60)
    settled(trial)
    assert pages(trial, "paged", first.id) == [1]


def test_a_terminating_revoke_of_the_running_replacement_ends_the_mark_revoked(
    trial: TrialWorker,
) -> None:
    customer = new()
    # Page 2 comes a second after page 1 ended: Celery's worker keeps its requests by task
    # id, and page 1's end would otherwise drop page 2's entry, which terminate looks up.
    first = trial.tasks.paged.delay(customer, 1, 2, {"pause": 8, "next": {"countdown": 1}})
    eventually(lambda: pages(trial, "paged", first.id) == [1, 2], "page 2 runs", timeout=30)
    key = mark_key("paged", customer)
    mark = trial.store.get(key)
    assert mark is not None
    first.revoke(terminate=True)
    eventually(lambda: ended(trial, key) != [], "the mark ended", timeout=30)
    [record] = ended(trial, key)
    body = [(r.outcome, r.details) for r in trial.history(f"job:paged:{customer}")]
    assert (record.outcome, record.lease.token) == (Outcome.REVOKED, mark.token), (
        record.details,
        body,
    )
    eventually(
        lambda: trial.store.get(f"job:paged:{customer}") is None, "page 2's key freed", timeout=30
    )
    assert outcomes(trial, f"job:paged:{customer}") == [Outcome.SUCCEEDED, Outcome.REVOKED]
    assert trial.tasks.paged.delay(customer, 1, 1, {}).id != first.id


def test_a_retried_first_page_hands_its_mark_to_its_replacement(trial: TrialWorker) -> None:
    customer = new()
    how = {"again": 1, "next": {"countdown": 3}}
    first = trial.tasks.paged.delay(customer, 1, 2, how)
    key = mark_key("paged", customer)
    eventually(
        lambda: (
            [(e["page"], e["retries"]) for e in starts(trial, "r.paged", id=first.id)]
            == [(1, 0), (1, 1)]
        ),
        "page 1 retried",
        timeout=30,
    )
    page_ended(trial, f"job:paged:{customer}", 1)
    mark = trial.store.get(key)
    assert mark is not None and mark.holder.task_id == first.id
    assert trial.tasks.paged.delay(customer, 1, 2, how).id == first.id  # page 2 queued
    assert first.get(timeout=60) == {"pages": 2}
    [record] = ended(trial, key)
    assert (record.outcome, record.lease.token) == (Outcome.SUCCEEDED, mark.token)
    assert (record.details or "").startswith("finished on ")


# -- duplicates ----------------------------------------------------------------------------


def test_on_duplicate_raise_while_the_replacement_is_queued_then_runs_then_after_the_end(
    trial: TrialWorker,
) -> None:
    customer = new()
    task = trial.tasks.paged_raise
    how = {"next": {"countdown": 3}, "pause": 3}
    first = task.delay(customer, 1, 2, how)
    page_ended(trial, f"job:paged_raise:{customer}", 1)
    assert pages(trial, "paged_raise", first.id) == [1]  # page 2 queued
    with pytest.raises(DuplicateTaskError) as queued:
        task.delay(customer, 1, 2, how)
    assert queued.value.task_id == first.id
    eventually(lambda: pages(trial, "paged_raise", first.id) == [1, 2], "page 2 runs", timeout=30)
    with pytest.raises(DuplicateTaskError) as runs:
        task.delay(customer, 1, 2, how)
    assert runs.value.task_id == first.id
    assert first.get(timeout=60) == {"pages": 2}
    after = task.delay(customer, 1, 1, {})
    assert after.id != first.id and after.get(timeout=60) == {"pages": 1}
    records = ended(trial, mark_key("paged_raise", customer))
    assert [(r.outcome, r.lease.holder.task_id) for r in records] == [
        (Outcome.SUCCEEDED, first.id),
        (Outcome.SUCCEEDED, after.id),
    ]


# -- expires ---------------------------------------------------------------------------------


def test_a_replacement_that_expires_waiting_out_its_countdown_ends_the_mark_expired(
    trial: TrialWorker,
) -> None:
    customer = new()
    first = trial.tasks.paged.delay(customer, 1, 2, {"next": {"countdown": 4, "expires": 1}})
    key = mark_key("paged", customer)
    eventually(lambda: ended(trial, key) != [], "the mark ended", timeout=60)
    [record] = ended(trial, key)
    assert (record.outcome, record.lease.holder.task_id) == (Outcome.EXPIRED, first.id)
    settled(trial)
    assert pages(trial, "paged", first.id) == [1]
    assert trial.tasks.paged.delay(customer, 1, 1, {}).id != first.id


def test_a_replacement_with_expires_that_no_worker_sees_lets_the_next_call_send(
    trial: TrialWorker,
) -> None:
    """As a message sent with ``expires`` (test_dedupe_trial): its mark ends with its
    expiry (plus ``EXPIRY_GRACE``) while it is queued."""
    customer = new()
    nowhere = f"nowhere-{uuid.uuid4().hex[:8]}"
    how = {"next": {"queue": nowhere, "expires": 2}}
    first = trial.tasks.paged.delay(customer, 1, 2, how)
    page_ended(trial, f"job:paged:{customer}", 1)
    key = mark_key("paged", customer)
    mark = trial.store.get(key)
    assert mark is not None and mark.holder.task_id == first.id
    time.sleep(2 + EXPIRY_GRACE + 1.0)  # page 2's message expired, unseen, in its queue
    assert trial.tasks.paged.delay(customer, 1, 1, {}).id != first.id, trial.store.get(key)
    [record] = [r for r in ended(trial, key) if r.lease.token == mark.token]
    assert record.outcome is Outcome.EXPIRED


# -- another key, until_started --------------------------------------------------------------


def test_a_replacement_on_another_key_ends_the_mark_with_the_replaced_run(
    trial: TrialWorker,
) -> None:
    customer, other = new(), new()
    how = {"to": other, "next": {"countdown": 4}}
    first = trial.tasks.paged.delay(customer, 1, 2, how)
    key = mark_key("paged", customer)
    eventually(lambda: ended(trial, key) != [], "the mark ended", timeout=60)
    [record] = ended(trial, key)
    assert (record.outcome, record.lease.holder.task_id) == (Outcome.SUCCEEDED, first.id)
    assert (record.details or "").startswith("replaced by r.paged")
    assert pages(trial, "paged", first.id) == [1]  # page 2 still waits: the mark ended first
    assert trial.tasks.paged.delay(customer, 1, 1, {}).id != first.id
    assert first.get(timeout=60) == {"pages": 2}
    settled(trial)
    [page2] = starts(trial, "r.paged", id=first.id, page=2)
    assert page2["key"] == f"job:paged:{other}"
    assert ended(trial, mark_key("paged", other)) == []  # the replacement took no mark


def test_an_until_started_mark_ends_dequeued_once_and_the_replacement_carries_none(
    trial: TrialWorker,
) -> None:
    customer = new()
    task = trial.tasks.paged_started
    first = task.delay(customer, 1, 2, {"next": {"countdown": 3}})
    page_ended(trial, f"job:paged_started:{customer}", 1)
    key = mark_key("paged_started", customer)
    [record] = ended(trial, key)
    assert (record.outcome, record.lease.holder.task_id) == (Outcome.DEQUEUED, first.id)
    assert trial.store.get(key) is None
    duplicate = task.delay(customer, 1, 1, {})  # page 1 started: sent, as documented
    assert duplicate.id != first.id
    assert first.get(timeout=60) == {"pages": 2}
    assert duplicate.get(timeout=60) == {"pages": 1}
    settled(trial)
    records = ended(trial, key)
    assert [(r.outcome, r.lease.holder.task_id) for r in records] == [
        (Outcome.DEQUEUED, first.id),
        (Outcome.DEQUEUED, duplicate.id),
    ]


# -- once ------------------------------------------------------------------------------------


def test_two_deliveries_of_one_replacement_at_once_run_its_page_once(trial: TrialWorker) -> None:
    """Page 2's message sent twice at once (same id, root and nesting: a broker's
    redelivery racing the original), before Celery's own page 2 comes: one runs the page,
    the others replay its hand-over (``Ignore``: nothing stored under the id), and the
    caller gets the last page's result."""
    customer = new()
    options = {"pause": 1.0, "later": 4.0}
    first = trial.tasks.deep.delay(customer, 1, 3, **options)
    key = f"job:deep:{customer}"
    page_ended(trial, key, 1)
    for _ in range(2):
        trial.tasks.deep.apply_async(
            (customer, 2, 3),
            options,
            task_id=first.id,
            root_id=first.id,
            replaced_task_nesting=1,
        )
    assert first.get(timeout=90) == {"pages": 3}
    settled(trial)
    assert [e["page"] for e in starts(trial, "r.deep", key=key)] == [1, 2, 3]
    assert sorted(outcomes(trial, key)) == sorted([Outcome.SUCCEEDED] * 3 + [Outcome.SKIPPED] * 2)
    assert trial.app.AsyncResult(first.id).get(timeout=10) == {"pages": 3}


@pytest.mark.xfail(
    strict=True,
    reason="design gap (README: a failure of the replacement does not undo the kept "
    "success): the first page's hand-over stays the key's once success whatever becomes of "
    "the pages after it, so once page 2 failed every later call replays None; resuming the "
    "chain would need the replacement's signature kept with the hand-over",
)
def test_a_once_sync_whose_replacement_failed_can_be_run_again(trial: TrialWorker) -> None:
    customer = new()
    first = trial.tasks.paged_once.delay(customer, 1, 2, {"fail": 2})
    with pytest.raises(ValueError, match="page 2 fails"):
        first.get(timeout=60)
    key = f"job:paged_once:{customer}"
    assert outcomes(trial, key) == [Outcome.SUCCEEDED, Outcome.FAILED]
    [mark] = ended(trial, mark_key("paged_once", customer))
    assert mark.outcome is Outcome.FAILED
    again = trial.tasks.paged_once.delay(customer, 1, 2, {})
    assert again.id != first.id
    result = again.get(timeout=60)
    settled(trial)
    assert pages(trial, "paged_once", again.id) != [], (result, outcomes(trial, key))
    assert result == {"pages": 2}


def test_a_once_sync_whose_replacement_failed_runs_again_once_its_success_is_forgotten(
    trial: TrialWorker,
) -> None:
    """The design gap above, as an operator closes it: ``celery-dlock forget KEY --task
    r.paged_once`` forgets the first page's hand-over and the success page 2 kept as its
    replacement (which a new run's page 2 would replay), and the next call runs the whole
    sync again, every page."""
    customer = new()
    first = trial.tasks.paged_once.delay(customer, 1, 3, {"fail": 3})
    with pytest.raises(ValueError, match="page 3 fails"):
        first.get(timeout=60)
    settled(trial)
    key = f"job:paged_once:{customer}"
    step = trial.store.last_success(key, "r.paged_once (replacement 1)")
    assert step is not None and step.lease.holder.task_id == first.id
    done = run_cli("--backend", trial.store.url, "forget", key, "--task", "r.paged_once",
                   "--force", "--reason", "page 3 fixed")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"forgot the success of r.paged_once on {key}" in done.stdout
    assert "and those of r.paged_once (replacement 1) forgotten" in done.stdout
    assert trial.store.last_success(key, "r.paged_once (replacement 1)") is None
    again = trial.tasks.paged_once.delay(customer, 1, 3, {})
    assert again.get(timeout=60) == {"pages": 3}
    settled(trial)
    assert pages(trial, "paged_once", again.id) == [1, 2, 3]
    assert Outcome.FORGOTTEN in outcomes(trial, key)


def _pages_table(lock_url: str) -> str:
    if not lock_url.startswith("postgres"):
        pytest.skip("not applicable: record_success needs the Postgres store")
    import psycopg

    url, table = lock_url.partition("?")[0], f'"{lock_url.split("schema=")[1]}".trial_pages'
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"CREATE TABLE IF NOT EXISTS {table} (customer text, page int)")
    return table


def _rows(lock_url: str, table: str, customer: str) -> list[int]:
    import psycopg

    with psycopg.connect(lock_url.partition("?")[0]) as connection:
        rows = connection.execute(
            f"SELECT page FROM {table} WHERE customer = %s ORDER BY page", (customer,)
        )
        return [row[0] for row in rows.fetchall()]


def test_record_success_in_every_page_then_each_page_delivered_again_writes_nothing(
    trial: TrialWorker, lock_url: str
) -> None:
    table = _pages_table(lock_url)
    customer = new()
    first = trial.tasks.booked.delay(customer, 1, 3)
    assert first.get(timeout=60) == {"pages": 3}
    key = f"job:booked:{customer}"
    for page in (1, 2, 3):
        trial.tasks.booked.apply_async(
            (customer, page, 3),
            task_id=first.id,
            root_id=first.id,
            replaced_task_nesting=page - 1,
        )
        page_ended(trial, key, 3 + page)
    settled(trial)
    assert _rows(lock_url, table, customer) == [1, 2, 3]
    assert [e["page"] for e in starts(trial, "r.booked", key=key)] == [1, 2, 3]
    assert outcomes(trial, key) == [Outcome.SUCCEEDED] * 3 + [Outcome.SKIPPED] * 3
    assert trial.app.AsyncResult(first.id).get(timeout=10) == {"pages": 3}


def test_a_middle_page_with_record_success_delivered_again_before_the_last_stores_no_result(
    trial: TrialWorker, lock_url: str
) -> None:
    table = _pages_table(lock_url)
    customer = new()
    first = trial.tasks.booked.delay(customer, 1, 3, 4.0)
    key = f"job:booked:{customer}"
    page_ended(trial, key, 2)  # page 3 waits out its countdown
    kept = trial.store.last_success(key, "r.booked (replacement 1)")
    assert kept is not None
    trial.tasks.booked.apply_async(
        (customer, 2, 3, 4.0), task_id=first.id, root_id=first.id, replaced_task_nesting=1
    )
    page_ended(trial, key, 3)
    assert outcomes(trial, key)[-1] is Outcome.SKIPPED
    settled(trial)
    # Page 3's row commits with its body's end, which settled() may see just before.
    eventually(lambda: _rows(lock_url, table, customer) == [1, 2, 3], "page 3's row")
    assert trial.app.AsyncResult(first.id).get(timeout=60) == {"pages": 3}, kept.result
