"""``Task.replace`` in a ``LockedTask`` tried as a demanding user would: a real prefork
worker of ``tests.celery.replace_trial_app`` on a Redis broker, the Postgres and file stores;
every check reads the store's history and the bodies' ledger. And eager mode, in process."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chain

from celery_dlock import Lock, LockedTask, Outcome, backend_from_url, install
from tests.celery.prefork import Worker, assert_never_overlapping, running, settled
from tests.support import eventually


class TrialWorker(Worker):
    """A prefork worker of ``tests.celery.replace_trial_app``."""

    module = "replace_trial_app"


@pytest.fixture(scope="module")
def trial(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, lock_url: str
) -> Iterator[TrialWorker]:
    with running(tmp_path_factory.mktemp("trial"), redis_url, lock_url, TrialWorker) as worker:
        yield worker


def new() -> str:
    return uuid.uuid4().hex[:10]


def starts(worker: Worker, task: str, **match: Any) -> list[dict[str, Any]]:
    """The ``start`` events of ``task`` whose fields include ``match``."""
    return [
        e
        for e in worker.events()
        if e["event"] == "start"
        and e["task"] == task
        and all(e.get(k) == v for k, v in match.items())
    ]


def notes(worker: Worker, order: str) -> list[str]:
    """The tags of the notes written for ``order``, in order."""
    return [e["tag"] for e in worker.events() if e["event"] == "note" and e["order"] == order]


def outcomes(worker: Worker, key: str) -> list[Outcome]:
    return [record.outcome for record in worker.history(key)]


pytestmark = pytest.mark.slow


def test_a_chain_replacement_holding_the_same_once_task_runs_each_body_once(
    trial: TrialWorker,
) -> None:
    order = new()
    first = trial.tasks.chained.delay(order)
    assert first.get(timeout=60) == f"b {order}"
    key = f"job:chained:{order}"
    assert [e["step"] for e in starts(trial, "r.chained", key=key)] == [0, 1]
    assert notes(trial, order) == ["a", "b"]
    assert outcomes(trial, key) == [Outcome.SUCCEEDED, Outcome.SUCCEEDED]
    assert trial.tasks.chained.delay(order).get(timeout=60) is None
    settled(trial)
    assert [e["step"] for e in starts(trial, "r.chained", key=key)] == [0, 1]
    assert notes(trial, order) == ["a", "b"]
    assert outcomes(trial, key)[-1] is Outcome.SKIPPED


def test_a_group_replacement_gives_its_results_and_a_duplicate_none(trial: TrialWorker) -> None:
    order = new()
    first = trial.tasks.fanout.delay(order)
    assert first.get(timeout=60) == [f"{n} {order}" for n in range(3)]
    settled(trial)  # the replaced run ends after sending: it may outlast its replacement
    key = f"job:fanout:{order}"
    [record] = trial.history(key)
    assert record.outcome is Outcome.SUCCEEDED
    assert record.details == f"replaced by celery.chord: its result comes under task id {first.id}"
    assert trial.tasks.fanout.delay(order).get(timeout=60) is None
    settled(trial)
    assert sorted(notes(trial, order)) == ["0", "1", "2"]
    assert len(starts(trial, "r.fanout", key=key)) == 1


def test_a_once_step_replaced_inside_a_chain_lets_the_later_steps_run(trial: TrialWorker) -> None:
    order = new()
    note, inchain = trial.tasks.note, trial.tasks.inchain
    result = chain(note.si(order, "a"), inchain.si(order), note.si(order, "c")).delay()
    assert result.get(timeout=60) == f"c {order}"
    settled(trial)  # the replaced run ends after sending: it may outlast its replacement
    assert notes(trial, order) == ["a", "r", "c"]
    key = f"job:inchain:{order}"
    assert outcomes(trial, key) == [Outcome.SUCCEEDED]


def test_a_later_step_of_the_same_chain_on_the_same_key_replays_after_a_replaced_step(
    trial: TrialWorker,
) -> None:
    """Without the replacement the chain's second ``inchain`` replays; with it, too: it is
    a later run on the key, not the replacement (which is the note ``r``)."""
    order = new()
    note, inchain = trial.tasks.note, trial.tasks.inchain
    steps = chain(inchain.si(order), note.si(order, "c"), inchain.si(order), note.si(order, "d"))
    assert steps.delay().get(timeout=60) == f"d {order}"
    settled(trial)
    key = f"job:inchain:{order}"
    assert len(starts(trial, "r.inchain", key=key)) == 1, [
        (r.outcome, r.details, r.result, r.lease.holder.task_id) for r in trial.history(key)
    ]
    assert notes(trial, order) == ["r", "c", "d"]
    assert outcomes(trial, key) == [Outcome.SUCCEEDED, Outcome.SKIPPED]


def test_three_pages_deep_with_a_duplicate_sent_while_a_page_runs(trial: TrialWorker) -> None:
    customer = new()
    first = trial.tasks.deep.delay(customer, 1, 3, pause=1.0, later=0)
    key = f"job:deep:{customer}"
    eventually(lambda: starts(trial, "r.deep", key=key, page=2), "page 2 started", timeout=60)
    duplicate = trial.tasks.deep.delay(customer, 1, 3, pause=1.0, later=0)
    assert first.get(timeout=90) == {"pages": 3}
    # None if it took the key between two pages, the last page's value if after the last
    assert duplicate.get(timeout=90) in (None, {"pages": 3})
    settled(trial)
    assert [e["page"] for e in starts(trial, "r.deep", key=key)] == [1, 2, 3]
    assert [e["nesting"] for e in starts(trial, "r.deep", key=key)] == [0, 1, 2]
    on_key = [(e["event"], e["token"]) for e in trial.events() if e.get("key") == key]
    assert_never_overlapping(on_key)
    done = [r for r in trial.history(key) if r.outcome is Outcome.SUCCEEDED]
    assert [r.lease.holder.task_id for r in done] == [first.id] * 3


def test_a_duplicate_sent_while_the_replacement_is_queued_returns_none_and_it_still_runs(
    trial: TrialWorker,
) -> None:
    customer = new()
    first = trial.tasks.deep.delay(customer, 1, 2, pause=0, later=3.0)  # page 2 sent 3 s on
    key = f"job:deep:{customer}"
    eventually(lambda: outcomes(trial, key) == [Outcome.SUCCEEDED], "page 1 handed over")
    duplicate = trial.tasks.deep.delay(customer, 1, 2, pause=0, later=3.0)
    assert duplicate.get(timeout=60) is None
    assert [e["page"] for e in starts(trial, "r.deep", key=key)] == [1]
    assert first.get(timeout=60) == {"pages": 2}
    settled(trial)
    assert [e["page"] for e in starts(trial, "r.deep", key=key)] == [1, 2]
    assert outcomes(trial, key) == [Outcome.SUCCEEDED, Outcome.SKIPPED, Outcome.SUCCEEDED]


def test_a_replacement_meeting_its_key_held_by_another_waits_and_then_goes_on(
    trial: TrialWorker,
) -> None:
    customer = new()
    key = f"job:deep:{customer}"
    first = trial.tasks.deep.delay(customer, 1, 2, pause=0, later=1.0)  # page 2 sent 1 s on
    eventually(lambda: outcomes(trial, key) == [Outcome.SUCCEEDED], "page 1 handed over")
    with Lock(trial.store, key) as lease:
        time.sleep(3.0)  # page 2 comes (1 s) and finds the key held: re-queued
        assert [e["page"] for e in starts(trial, "r.deep", key=key)] == [1]
    assert first.get(timeout=90) == {"pages": 2}
    [page2] = starts(trial, "r.deep", key=key, page=2)
    assert page2["fence"] > lease.fence
    assert trial.store.get(key) is None


def test_a_group_replacing_a_step_inside_a_chain_then_the_later_steps(trial: TrialWorker) -> None:
    order = new()
    note, fanout = trial.tasks.note, trial.tasks.fanout
    result = chain(note.si(order, "a"), fanout.si(order), note.si(order, "z")).delay()
    assert result.get(timeout=60) == f"z {order}"
    settled(trial)
    tags = notes(trial, order)
    assert (tags[0], sorted(tags[1:4]), tags[4:]) == ("a", ["0", "1", "2"], ["z"])
    assert outcomes(trial, f"job:fanout:{order}") == [Outcome.SUCCEEDED]


def test_the_replaced_message_delivered_again_runs_nothing(trial: TrialWorker) -> None:
    customer = new()
    first = trial.tasks.deep.delay(customer, 1, 2, pause=0, later=0)
    assert first.get(timeout=60) == {"pages": 2}
    key = f"job:deep:{customer}"
    trial.tasks.deep.apply_async((customer, 1, 2), {"pause": 0, "later": 0}, task_id=first.id)
    eventually(lambda: len(trial.history(key)) == 3, "the redelivery recorded", timeout=60)
    assert [e["page"] for e in starts(trial, "r.deep", key=key)] == [1, 2]
    assert outcomes(trial, key)[-1] is Outcome.SKIPPED


def test_the_replaced_message_delivered_again_before_its_replacement_ran_stores_no_result(
    trial: TrialWorker,
) -> None:
    """The first page's message delivered again while the second page waits out its
    countdown: the redelivery runs nothing and stores no result under the task's id (a
    ``None`` there would be what the caller gets, and the last page's result could not
    replace it); the caller gets the last page's."""
    customer = new()
    first = trial.tasks.deep.delay(customer, 1, 2, pause=0, later=3)
    key = f"job:deep:{customer}"
    eventually(lambda: len(trial.history(key)) == 1, "the first page ended", timeout=60)
    trial.tasks.deep.apply_async((customer, 1, 2), {"pause": 0, "later": 3}, task_id=first.id)
    eventually(lambda: len(trial.history(key)) == 2, "the redelivery recorded", timeout=60)
    assert outcomes(trial, key) == [Outcome.SUCCEEDED, Outcome.SKIPPED]
    assert first.get(timeout=60) == {"pages": 2}
    settled(trial)
    assert [e["page"] for e in starts(trial, "r.deep", key=key)] == [1, 2]


@pytest.mark.parametrize("last", [2, 3], ids=["last-page", "middle-page"])
def test_a_replacement_delivered_again_after_the_run_ended_runs_nothing(
    trial: TrialWorker, last: int
) -> None:
    """A broker's redelivery of the second page's message (same id, nesting and root: what
    an ``acks_late`` worker lost before its ack sends again) once all pages ran: it replays
    what that page kept (the last page's result, or a middle page's own hand-over), and
    neither its body nor a next page runs again, as the replaced message's redelivery."""
    customer = new()
    first = trial.tasks.deep.delay(customer, 1, last, pause=0, later=0)
    assert first.get(timeout=60) == {"pages": last}
    key = f"job:deep:{customer}"
    trial.tasks.deep.apply_async(
        (customer, 2, last),
        {"pause": 0, "later": 0},
        task_id=first.id,
        root_id=first.id,
        replaced_task_nesting=1,
    )
    eventually(lambda: len(trial.history(key)) == last + 1, "the redelivery recorded", timeout=60)
    settled(trial)
    assert [e["page"] for e in starts(trial, "r.deep", key=key)] == list(range(1, last + 1))
    assert outcomes(trial, key) == [Outcome.SUCCEEDED] * last + [Outcome.SKIPPED]
    kept = trial.store.last_success(key, "r.deep (replacement 1)")
    assert kept is not None and kept.lease.holder.task_id == first.id
    if last == 2:
        assert kept.result == {"value": {"pages": 2}}
    else:
        assert kept.result["value"] is None and kept.result["replaced"]["nesting"] == 2


def test_a_replacement_keeps_its_success_in_its_own_transaction(
    trial: TrialWorker, lock_url: str
) -> None:
    """``record_success`` in a replacement's body (the Postgres store): its transaction
    commits its page and its success, which the first page's kept hand-over does not
    refuse; a redelivery of the last page then replays it and writes nothing."""
    if not lock_url.startswith("postgres"):
        pytest.skip("not applicable: record_success needs the Postgres store")
    import psycopg

    url, table = lock_url.partition("?")[0], f'"{lock_url.split("schema=")[1]}".trial_pages'
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"CREATE TABLE IF NOT EXISTS {table} (customer text, page int)")
    customer = new()
    first = trial.tasks.booked.delay(customer, 1, 3)
    assert first.get(timeout=60) == {"pages": 3}
    key = f"job:booked:{customer}"
    trial.tasks.booked.apply_async(
        (customer, 3, 3), task_id=first.id, root_id=first.id, replaced_task_nesting=2
    )
    eventually(lambda: len(trial.history(key)) == 4, "the redelivery recorded", timeout=60)
    with psycopg.connect(url) as connection:
        rows = connection.execute(
            f"SELECT page FROM {table} WHERE customer = %s ORDER BY page", (customer,)
        )
        assert [row[0] for row in rows.fetchall()] == [1, 2, 3]
    assert [e["page"] for e in starts(trial, "r.booked", key=key)] == [1, 2, 3]
    assert outcomes(trial, key) == [Outcome.SUCCEEDED] * 3 + [Outcome.SKIPPED]
    kept = trial.store.last_success(key, "r.booked (replacement 2)")
    assert kept is not None and kept.result == {"value": {"pages": 3}}
    # A duplicate replays the last page's value, found through the pages' hand-overs (each
    # kept over the page's own record_success(None)), and writes nothing.
    assert trial.tasks.booked.delay(customer, 1, 3).get(timeout=60) == {"pages": 3}
    with psycopg.connect(url) as connection:
        rows = connection.execute(f"SELECT count(*) FROM {table} WHERE customer = %s", (customer,))
        assert rows.fetchone() == (3,)


def test_a_replacement_on_its_own_key_is_not_skipped_for_its_predecessors_lease(
    trial: TrialWorker,
) -> None:
    """``on_locked="skip"``: the replacement is sent while the replaced run still holds the
    key (for half a second here: the task's own ``on_replace`` works after Celery's); it
    must run all the same (else the caller gets None and the pages stop)."""
    for _ in range(2):
        customer = new()
        first = trial.tasks.skipping.delay(customer, 1, 4)
        assert first.get(timeout=60) == {"pages": 4}
        key = f"job:skipping:{customer}"
        assert [e["page"] for e in starts(trial, "r.skipping", key=key)] == [1, 2, 3, 4]
        assert Outcome.SKIPPED not in outcomes(trial, key)


def test_an_until_finished_mark_ends_succeeded_with_its_once_task_s_last_page(
    trial: TrialWorker,
) -> None:
    customer = new()
    first = trial.tasks.queued.delay(customer, 1, 2)
    assert first.get(timeout=60) == {"pages": 2}
    key = f"job:queued:{customer}"
    [mark] = trial.history(f"{key}#queued:r.queued")  # it went on with the second page
    assert (mark.outcome, mark.lease.holder.task_id) == (Outcome.SUCCEEDED, first.id)
    assert (mark.details or "").startswith("finished on ")
    assert outcomes(trial, key) == [Outcome.SUCCEEDED, Outcome.SUCCEEDED]
    assert trial.tasks.queued.delay(customer, 1, 2).get(timeout=60) == {"pages": 2}
    settled(trial)
    assert [e["page"] for e in starts(trial, "r.queued", key=key)] == [1, 2]


def test_the_replaced_message_delivered_again_leaves_the_mark_that_went_on_with_its_run(
    trial: TrialWorker,
) -> None:
    """``once`` and ``dedupe="until_finished"``: the first page's message, with its mark's
    header, delivered again while the second page waits out its countdown ends with
    ``Ignore`` and leaves the mark, which went on with the second page: a duplicate sent
    then is still coalesced, and the mark ends with the last page."""
    customer = new()
    first = trial.tasks.queued.delay(customer, 1, 2, 3)
    key = f"job:queued:{customer}"
    mark_key = f"{key}#queued:r.queued"
    eventually(lambda: len(trial.history(key)) == 1, "the first page ended", timeout=60)
    mark = trial.store.get(mark_key)
    assert mark is not None and mark.holder.task_id == first.id
    assert mark.expires_at is not None  # dedupe_ttl (3600 s) past the second page's countdown
    assert 3600 + 1 < mark.expires_at - time.time() <= 3600 + 3.1
    trial.tasks.queued.apply_async(
        (customer, 1, 2, 3), task_id=first.id, headers={"dlock_dedupe": mark.to_dict()}
    )
    eventually(lambda: len(trial.history(key)) == 2, "the redelivery recorded", timeout=60)
    assert outcomes(trial, key) == [Outcome.SUCCEEDED, Outcome.SKIPPED]
    held = trial.store.get(mark_key)
    assert held is not None and held.token == mark.token
    assert trial.tasks.queued.delay(customer, 1, 2, 3).id == first.id  # still coalesced
    assert first.get(timeout=60) == {"pages": 2}
    settled(trial)
    [ended] = trial.history(mark_key)
    assert (ended.outcome, ended.lease.token) == (Outcome.SUCCEEDED, mark.token)
    assert (ended.details or "").startswith("finished on ")


def test_an_until_finished_mark_goes_on_with_a_replacement_of_the_same_task_on_its_key(
    trial: TrialWorker,
) -> None:
    """A sync that replaces itself page by page under ``dedupe="until_finished"``: a
    duplicate sent while a later page runs is coalesced into the first (its id, nothing
    sent), and the mark ends once, when the last page does; then a call sends again."""
    customer = new()
    first = trial.tasks.synced.delay(customer, 1, 3, 0.5)
    key = f"job:synced:{customer}"
    eventually(
        lambda: 2 in [e["page"] for e in starts(trial, "r.synced", key=key)],
        "the second page started",
        timeout=60,
    )
    duplicate = trial.tasks.synced.delay(customer, 1, 3, 0.5)
    assert duplicate.id == first.id
    assert first.get(timeout=60) == {"pages": 3}
    settled(trial)
    assert [e["page"] for e in starts(trial, "r.synced", key=key)] == [1, 2, 3]
    [mark] = trial.history(f"{key}#queued:r.synced")
    assert (mark.outcome, mark.lease.holder.task_id) == (Outcome.SUCCEEDED, first.id)
    assert (mark.details or "").startswith("finished on ")
    after = trial.tasks.synced.delay(customer, 1, 1, 0)
    assert after.id != first.id
    assert after.get(timeout=60) == {"pages": 1}


def test_a_task_with_two_keys_replaced_records_both_succeeded(trial: TrialWorker) -> None:
    src, dst = new(), new()
    first = trial.tasks.moved.delay(src, dst)
    assert first.get(timeout=60) == f"moved {src}"
    settled(trial)  # the replaced run ends after sending: it may outlast its replacement
    for key in (f"job:account:{src}", f"job:account:{dst}"):
        [record] = trial.history(key)
        assert record.outcome is Outcome.SUCCEEDED
        assert record.details == f"replaced by r.note: its result comes under task id {first.id}"
        assert trial.store.get(key) is None


def test_a_task_in_a_slot_replaced_records_succeeded_and_frees_the_slot(
    trial: TrialWorker,
) -> None:
    tenant = new()
    first = trial.tasks.exported.delay(tenant)
    assert first.get(timeout=60) == f"exported {tenant}"
    settled(trial)  # the replaced run ends after sending: it may outlast its replacement
    [start] = starts(trial, "r.exported")[-1:]
    key = start["key"]
    assert key.startswith(f"job:export:{tenant}")
    [record] = trial.history(key)
    assert record.outcome is Outcome.SUCCEEDED
    assert record.details == f"replaced by r.note: its result comes under task id {first.id}"
    assert trial.store.leases(f"job:export:{tenant}") == []


def test_an_autoretried_once_task_then_replaced_runs_the_replacement_once(
    trial: TrialWorker,
) -> None:
    order = new()
    first = trial.tasks.flaky.delay(order)
    assert first.get(timeout=60) == f"flaky {order}"
    settled(trial)  # the replaced run ends after sending: it may outlast its replacement
    key = f"job:flaky:{order}"
    assert [e["retries"] for e in starts(trial, "r.flaky", key=key)] == [0, 1]
    assert outcomes(trial, key)[-1] is Outcome.SUCCEEDED
    assert trial.tasks.flaky.delay(order).get(timeout=60) is None
    settled(trial)
    assert notes(trial, order) == ["flaky"]
    assert len(starts(trial, "r.flaky", key=key)) == 2


def test_a_replacement_that_retries_runs_again_on_its_retry_and_a_duplicate_replays_it(
    trial: TrialWorker,
) -> None:
    order = new()
    first = trial.tasks.retrying.delay(order)
    assert first.get(timeout=60) == f"done {order}"
    key = f"job:retrying:{order}"
    runs = [(e["step"], e["retries"]) for e in starts(trial, "r.retrying", key=key)]
    assert runs == [(0, 0), (1, 0), (1, 1)]
    assert trial.tasks.retrying.delay(order).get(timeout=60) == f"done {order}"  # the last's
    settled(trial)
    assert len(starts(trial, "r.retrying", key=key)) == 3
    assert outcomes(trial, key)[-1] is Outcome.SKIPPED


# -- eager -------------------------------------------------------------------------------


@pytest.fixture
def eager_app() -> Iterator[tuple[Celery, str]]:
    url = f"memory://{uuid.uuid4().hex}"
    app = Celery("eager-replace", set_as_current=False)
    app.conf.update(task_always_eager=True, dlock_backend=url)
    install(app, janitor=False)
    yield app, url


def test_eager_replace_fails_as_celerys_own_and_keeps_no_success(
    eager_app: tuple[Celery, str],
) -> None:
    """Celery 5.7 itself fails ``replace`` in eager mode (its ``on_replace`` calls
    ``sig.apply().get()``, which refuses to block in a task): the run is recorded
    ``failed``, no success is kept, and the key is free again; no hang."""
    app, url = eager_app
    runs: list[str] = []

    @app.task(shared=False, name="e.mail")
    def mail(o: str) -> str:
        runs.append("mail")
        return f"mailed {o}"

    @app.task(
        shared=False, bind=True, base=LockedTask, name="e.invoice", lock_key="i:{o}", once=True
    )
    def invoice(self: Any, o: str) -> Any:
        runs.append("invoice")
        return self.replace(mail.si(o))

    result = invoice.delay("o1")
    assert result.failed() and isinstance(result.result, RuntimeError)
    assert runs == ["invoice", "mail"]
    store = backend_from_url(url)
    [record] = store.history(key="job:i:o1")
    assert (record.outcome, record.problem) == (Outcome.FAILED, "RuntimeError")
    assert store.last_success("job:i:o1", "e.invoice") is None
    assert store.get("job:i:o1") is None


def test_eager_once_task_replacing_itself_on_its_key_neither_hangs_nor_holds_it(
    eager_app: tuple[Celery, str],
) -> None:
    app, url = eager_app
    pages: list[int] = []

    @app.task(shared=False, bind=True, base=LockedTask, name="e.paged", lock_key="p:{c}", once=True)
    def paged(self: Any, c: str, page: int) -> Any:
        pages.append(page)
        if page < 3:
            return self.replace(paged.si(c, page + 1))
        return {"pages": page}

    started = time.monotonic()
    result = paged.delay("c1", 1)
    assert time.monotonic() - started < 10
    assert result.failed()
    store = backend_from_url(url)
    assert store.get("job:p:c1") is None
    assert pages == [1]  # the nested page 2 met the key held by page 1: busy, no queue
    outcomes = [r.outcome for r in reversed(store.history(key="job:p:c1"))]
    assert outcomes[-1] is Outcome.FAILED
