"""``Task.replace`` in a ``LockedTask``, on a real prefork worker: a run that hands itself
to a replacement is recorded ``succeeded``, naming it, and a ``once`` task keeps that
success, so that a duplicate runs neither the body nor the replacement again; the same
message delivered again (a redelivery: the same task id) neither; and a replacement on the
same key (a task that replaces itself page by page) goes on rather than replaying."""

from __future__ import annotations

import pytest

from celery_dlock import Outcome
from tests.celery.prefork import Worker, assert_never_overlapping, bodies
from tests.celery.support import new_run
from tests.support import eventually


def mails(worker: Worker, order: str) -> list[str]:
    """The task ids of the mailing runs of ``order``."""
    return [e["id"] for e in worker.events() if e["event"] == "mail" and e["order_id"] == order]


@pytest.mark.slow
def test_a_once_task_that_replaced_itself_is_not_run_again_by_a_duplicate(
    worker: Worker,
) -> None:
    order = new_run()
    first = worker.tasks.invoice.delay(order)
    assert first.get(timeout=60) == f"mailed {order}"  # the replacement's, under first.id
    assert worker.tasks.invoice.delay(order).get(timeout=60) is None
    key = f"job:invoice:{order}"
    assert len(bodies(worker, key)) == 2  # one start, one end: the body ran once
    assert mails(worker, order) == [first.id]  # and the replacement was sent once
    history = worker.history(key)
    assert [record.outcome for record in history] == [Outcome.SUCCEEDED, Outcome.SKIPPED]
    assert history[0].lease.holder.task_id == first.id
    assert history[0].details == f"replaced by w.mail: its result comes under task id {first.id}"
    assert history[1].problem == "once"


@pytest.mark.slow
def test_a_replaced_message_delivered_again_runs_neither_body_nor_replacement(
    worker: Worker,
) -> None:
    order = new_run()
    first = worker.tasks.invoice.delay(order)
    assert first.get(timeout=60) == f"mailed {order}"
    key = f"job:invoice:{order}"
    # What a broker's redelivery is to the worker: the same message, the same task id.
    worker.tasks.invoice.apply_async((order,), task_id=first.id)
    eventually(lambda: len(worker.history(key)) == 2, "the redelivery recorded", timeout=60)
    history = worker.history(key)
    assert [record.outcome for record in history] == [Outcome.SUCCEEDED, Outcome.SKIPPED]
    assert history[1].lease.holder.task_id == first.id
    assert len(bodies(worker, key)) == 2
    assert mails(worker, order) == [first.id]


@pytest.mark.slow
def test_a_once_task_replacing_itself_on_its_own_key_goes_on_to_the_last_page(
    worker: Worker,
) -> None:
    customer = new_run()
    first = worker.tasks.paged.delay(customer, 1, 3)
    assert first.get(timeout=90) == {"pages": 3}
    key = f"job:paged:{customer}"
    events = bodies(worker, key)
    assert_never_overlapping(events)
    pages = [e["page"] for e in worker.events() if e["key"] == key and e["event"] == "start"]
    assert pages == [1, 2, 3]
    succeeded = [r for r in worker.history(key) if r.outcome is Outcome.SUCCEEDED]
    assert [r.lease.holder.task_id for r in succeeded] == [first.id] * 3
    assert [r.details for r in succeeded][:2] == [
        f"replaced by w.paged: its result comes under task id {first.id}"
    ] * 2
    # A duplicate replays the last page's success (the first page's hand-over, then each
    # page's own, looked up page by page); nothing runs again.
    assert worker.tasks.paged.delay(customer, 1, 3).get(timeout=60) == {"pages": 3}
    assert len(bodies(worker, key)) == 6
    assert worker.history(key)[-1].outcome is Outcome.SKIPPED


@pytest.mark.slow
def test_an_until_finished_mark_ends_succeeded_when_its_task_replaces_itself(
    worker: Worker,
) -> None:
    customer = new_run()
    first = worker.tasks.handed.delay(customer)
    assert first.get(timeout=60) == f"mailed {customer}"
    marked = f"job:handed:{customer}#queued:w.handed"
    # The replaced run ends (and ends its mark) after sending: it may outlast the mailing.
    eventually(lambda: worker.history(marked) != [], "the mark ended", timeout=30)
    eventually(lambda: worker.history(f"job:handed:{customer}") != [], "the run ended")
    [mark] = worker.history(marked)
    assert mark.outcome is Outcome.SUCCEEDED and mark.problem is None
    assert mark.lease.holder.task_id == first.id
    assert mark.details is not None
    assert mark.details.startswith(f"replaced by w.mail: its result comes under task id {first.id}")
    [body] = [r.outcome for r in worker.history(f"job:handed:{customer}")]
    assert body is Outcome.SUCCEEDED
