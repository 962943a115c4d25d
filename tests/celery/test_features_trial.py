"""``LockedTask`` combined with the Celery features users combine it with, tried on the
Postgres and Redis lock stores with an embedded worker (``tests.celery.features_trial_app``):
``autoretry_for`` with backoff and jitter (alone, with ``once``, with an ``until_finished``
mark), canvas (a chord of ``once`` tasks with a replayed duplicate, ``link_error`` on a busy
key), ``ignore_result`` with ``once``, class-based tasks and a base class of the user's own,
and key templates with a format spec. Every check reads the store."""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from celery import Task, chord, group

from celery_dlock import (
    ConfigurationError,
    Lock,
    LockedTask,
    LockKeyError,
    LockNotAcquiredError,
    Outcome,
    backend_from_url,
)
from celery_dlock.backends.base import LockBackend
from tests.celery import features_trial_app as trial
from tests.celery.features_trial_app import SEEN, Audited, Charge, Flaky
from tests.celery.support import embedded_worker, own_store
from tests.support import eventually

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["postgres", "redis"])
def store_url_of(request: pytest.FixtureRequest) -> Iterator[str]:
    """A lock store of this module's own: Postgres in a schema of its own, or Redis under a
    prefix of its own."""
    with own_store(request.param, "features") as url:
        yield url


@pytest.fixture(scope="module")
def features(store_url_of: str) -> Iterator[tuple[SimpleNamespace, LockBackend]]:
    """The trial app's tasks, run by an embedded worker, and the store they lock in."""
    app, tasks = trial.make_app(store_url_of)
    store = backend_from_url(store_url_of)
    try:
        with embedded_worker(app):
            yield tasks, store
    finally:
        store.close()


def new_run() -> str:
    return uuid.uuid4().hex[:10]


def history(store: LockBackend, key: str) -> list[tuple[Outcome, str | None]]:
    return [(r.outcome, r.problem) for r in reversed(store.history(key=key, limit=None))]


# -- autoretry_for ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["auto", "auto_once", "auto_queued"])
def test_autoretry_with_backoff_keeps_the_key_between_attempts_and_records_each(
    features: tuple[SimpleNamespace, LockBackend], name: str
) -> None:
    """``autoretry_for`` with ``retry_backoff``, ``retry_jitter`` and ``max_retries=2``:
    each attempt holds the key, which no one else can take between them (the attempt's
    lease is kept for its retry, as with ``self.retry``); the attempts are recorded
    ``retried``, ``retried`` and, when the retries run out, ``failed`` with the body's own
    exception; nothing is left held. An ``until_finished`` mark lives across the retries
    and ends ``failed`` with the last attempt."""
    tasks, store = features
    task = getattr(tasks, name)
    run = new_run()
    key = f"job:auto:{run}"
    result = task.delay(run, 5)
    if name == "auto_queued":
        assert task.delay(run, 5).id == result.id  # queued or retrying: one task
    with pytest.raises(Flaky, match="attempt 2"):
        # Three attempts 1 s apart at most; the module's one solo worker may still be busy
        # with an earlier test's task (random order): CI once took more than 30 s.
        result.get(timeout=90)
    assert [seen["retries"] for seen in SEEN[run]] == [0, 1, 2]
    records = list(reversed(store.history(key=key, limit=None)))
    problem = f"{Flaky.__module__}.Flaky"
    assert [(r.outcome, r.problem) for r in records] == [
        (Outcome.RETRIED, None),
        (Outcome.RETRIED, None),
        (Outcome.FAILED, problem),
    ]
    assert [r.lease.token for r in records] == [seen["token"] for seen in SEEN[run]]
    assert {r.lease.holder.task_id for r in records} == {result.id}
    # Never free between two attempts: each kept lease ended in the step that granted the
    # next attempt's (a retry's takeover by its token), not before it.
    for kept, taking in itertools.pairwise(records):
        assert "continued by its retry" in (kept.details or ""), kept
        assert kept.released_at >= taking.lease.acquired_at, (kept, taking)
    assert store.get(key) is None
    if name == "auto_queued":
        mark = f"{key}#queued:{task.name}"
        assert [outcome for outcome, _ in history(store, mark)] == [Outcome.FAILED]
        assert store.get(mark) is None


def test_autoretry_of_a_once_task_that_succeeds_on_retry_is_replayed(
    features: tuple[SimpleNamespace, LockBackend],
) -> None:
    tasks, store = features
    run = new_run()
    assert tasks.auto_once.delay(run, 1).get(timeout=30) == "done after 1"
    assert tasks.auto_once.delay(run, 1).get(timeout=30) == "done after 1"
    assert [seen["retries"] for seen in SEEN[run]] == [0, 1]  # the duplicate replayed
    assert [outcome for outcome, _ in history(store, f"job:auto:{run}")] == [
        Outcome.RETRIED,
        Outcome.SUCCEEDED,
        Outcome.SKIPPED,
    ]


# -- canvas -----------------------------------------------------------------------------------


def test_a_replayed_once_duplicate_s_result_flows_into_the_chord_callback(
    features: tuple[SimpleNamespace, LockBackend],
) -> None:
    tasks, store = features
    run = new_run()
    assert tasks.part.delay(run, 1).get(timeout=30) == 10
    workflow = chord([tasks.part.s(run, 1), tasks.part.s(run, 2)], tasks.total.s())
    assert workflow.apply_async().get(timeout=30) == 30
    assert group(tasks.part.s(run, 3), tasks.part.s(run, 3)).apply_async().get(timeout=30) == [
        30,
        30,
    ]
    assert sorted(SEEN[run]) == [("part", 1), ("part", 2), ("part", 3)]  # each body once
    assert [outcome for outcome, _ in history(store, f"job:part:{run}:1")] == [
        Outcome.SUCCEEDED,
        Outcome.SKIPPED,
    ]


def test_a_busy_key_under_fail_calls_link_error_and_under_skip_the_link_with_none(
    features: tuple[SimpleNamespace, LockBackend],
) -> None:
    """``on_locked="fail"``: the task fails with ``LockNotAcquiredError`` and its errback
    runs; ``"skip"``: the task succeeds with None, which its callback gets (as the next step
    of a chain does: a skipped step does not stop a chain)."""
    tasks, store = features
    failing, skipping = new_run(), new_run()
    with Lock(store, f"job:busy:{failing}"), Lock(store, f"job:busy:{skipping}"):
        failed = tasks.busy_fail.apply_async((failing,), link_error=tasks.errback.s())
        with pytest.raises(LockNotAcquiredError):
            failed.get(timeout=30)
        skipped = tasks.busy_skip.apply_async((skipping,), link=tasks.then.s(skipping))
        assert skipped.get(timeout=30) is None
        eventually(lambda: SEEN[skipping], "the callback ran")
    eventually(lambda: SEEN[failing], "the errback ran")
    assert SEEN[failing] == [("errback", "LockNotAcquiredError", failed.id)]
    assert SEEN[skipping] == [("then", None)]
    assert history(store, f"job:busy:{skipping}")[0] == (Outcome.SKIPPED, "locked")


def test_a_once_task_with_ignore_result_replays_from_the_lock_store(
    features: tuple[SimpleNamespace, LockBackend],
) -> None:
    tasks, store = features
    run = new_run()
    key = f"job:quiet:{run}"
    tasks.quiet.delay(run)
    eventually(lambda: history(store, key), "the first run's record")
    tasks.quiet.delay(run)
    eventually(lambda: len(history(store, key)) == 2, "the duplicate's record")
    assert len(SEEN[run]) == 1
    assert history(store, key) == [(Outcome.SUCCEEDED, None), (Outcome.SKIPPED, "once")]


# -- task classes -----------------------------------------------------------------------------


def test_a_subclass_of_a_task_class_locks_its_own_key_with_the_body_it_inherits(
    features: tuple[SimpleNamespace, LockBackend],
) -> None:
    """``class UrgentCharge(Charge): lock_key = "urgent:{order_id}"`` runs ``Charge.run``
    under its own key (it locked ``Charge``'s: the subclass's key was never read)."""
    tasks, store = features
    order = new_run()
    assert tasks.urgent.delay(order).get(timeout=30) == f"job:urgent:{order}"
    assert history(store, f"job:urgent:{order}") == [(Outcome.SUCCEEDED, None)]
    assert history(store, f"job:order:{order}") == []
    with pytest.raises(Flaky):
        tasks.charge.delay(order, True).get(timeout=30)
    assert history(store, f"job:order:{order}") == [(Outcome.FAILED, f"{Flaky.__module__}.Flaky")]


def test_the_options_of_a_subclass_of_a_task_class_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="on_locked must be one of"):
        type("Sloppy", (Charge,), {"on_locked": "skp"})
    with pytest.raises(LockKeyError, match="'order', which is not a parameter"):
        type("Elsewhere", (Charge,), {"lock_key": "order:{order}"})


def test_a_body_from_a_base_of_the_users_own_is_locked_by_the_tasks_key() -> None:
    """``class Charge(PaymentBase, LockedTask): lock_key = ...`` with ``run`` on
    ``PaymentBase``: it had no key at all (every run failed, "has no lock_key")."""

    class PaymentBase(Task):  # type: ignore[misc]  # celery has no type hints
        def run(self, order_id: int) -> int:
            return order_id

    charge = type("Pay", (PaymentBase, LockedTask), {"lock_key": "pay:{order_id}"})()
    assert charge.lock_key_for((7,), namespace="job") == "job:pay:7"


@pytest.mark.parametrize("fail", [False, True])
def test_a_users_base_with_every_hook_overridden_runs_them_all_and_every_exit_is_recorded(
    features: tuple[SimpleNamespace, LockBackend], fail: bool
) -> None:
    tasks, store = features
    run = new_run()
    result = tasks.audited.delay(run, fail)
    if fail:
        with pytest.raises(Flaky):
            result.get(timeout=30)
    else:
        assert result.get(timeout=30) == "audited"
    eventually(lambda: "after_return" in SEEN[run], "after_return ran")
    ending = "on_failure" if fail else "on_success"
    body = ("body", f"job:au:{run}", True)
    assert SEEN[run] == ["before_start", "__call__", body, ending, "after_return"]
    outcome = (Outcome.FAILED, f"{Flaky.__module__}.Flaky") if fail else (Outcome.SUCCEEDED, None)
    assert history(store, f"job:au:{run}") == [outcome]


def test_a_base_whose_call_locked_task_would_skip_is_refused_naming_the_fix() -> None:
    """``class Base(LockedTask, Audited)``: ``LockedTask.__call__`` runs the body itself, so
    ``Audited.__call__`` would never run, without a word."""
    with pytest.raises(ConfigurationError, match="put Audited before LockedTask"):
        type("Base", (LockedTask, Audited), {})
    type("Fine", (Audited, LockedTask), {})
    type("AlsoFine", (LockedTask, type("Plain", (Task,), {"abstract": True})), {})


# -- key templates ----------------------------------------------------------------------------


def test_a_format_spec_that_does_not_fit_its_argument_is_a_lock_key_error_naming_it(
    features: tuple[SimpleNamespace, LockBackend],
) -> None:
    tasks, _ = features
    run = new_run()
    assert tasks.padded.delay(run, 42).get(timeout=30) == f"job:n:00042:{run}"
    with pytest.raises(LockKeyError, match=r"f\.padded: \{n:>05\} cannot format a value of type"):
        tasks.padded.delay(run, [4, 2]).get(timeout=30)


def test_a_placeholder_inside_a_format_spec_is_refused_when_the_task_is_defined() -> None:
    def pad(n: int, width: int) -> None: ...

    with pytest.raises(LockKeyError, match=r"placeholder in the format spec of \{n\}"):
        type("Padded", (LockedTask,), {"lock_key": "n:{n:>{width}}", "run": staticmethod(pad)})


def test_a_task_s_own_throws_keeps_a_busy_key_an_expected_error(
    features: tuple[SimpleNamespace, LockBackend], caplog: pytest.LogCaptureFixture
) -> None:
    """``throws=(Flaky,)`` replaced ``LockedTask``'s ``(LockNotAcquiredError,)``: every
    ``on_locked="fail"`` was then logged at ERROR with its traceback."""
    tasks, store = features
    assert set(tasks.busy_fail_throws.throws) == {Flaky, LockNotAcquiredError}
    run = new_run()
    with (
        Lock(store, f"job:busy:{run}"),
        caplog.at_level(logging.INFO, "celery.app.trace"),
        pytest.raises(LockNotAcquiredError),
    ):
        tasks.busy_fail_throws.delay(run).get(timeout=30)
    [logged] = [r for r in caplog.records if r.name == "celery.app.trace" and run in r.getMessage()]
    assert (logged.levelno, logged.exc_info) == (logging.INFO, None), logged.getMessage()
