"""``forget KEY --task NAME``: an operator undoes what ``once`` keeps. A real ``once`` task
(eager, on the file, Postgres and Redis stores) replays its first success until the success
is forgotten; then the next run charges again and its success is the one replayed. The act
is recorded ``forgotten`` with who and why; a question nobody answers forgets nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dlock import LockedTask, Outcome, install
from tests.cli.clitools import CliStore, run_cli

TASK = "forget.charge"


@pytest.fixture
def charge(store: CliStore) -> Iterator[tuple[Any, list[tuple[str, int]]]]:
    """A ``once`` charge on ``store``, run eagerly in this process, and the charges it made."""
    app = Celery("forget-tests", set_as_current=False)
    app.conf.update(task_always_eager=True, dlock_backend=store.url)
    install(app, janitor=False)
    charges: list[tuple[str, int]] = []

    @app.task(shared=False, base=LockedTask, name=TASK, lock_key="order:{order}", once=True)
    def charge(order: str, amount: int) -> dict[str, Any]:
        charges.append((order, amount))
        return {"order": order, "charged": amount}

    yield charge, charges


def test_a_forgotten_success_lets_the_next_run_charge_again(
    store: CliStore, charge: tuple[Any, list[tuple[str, int]]]
) -> None:
    task, charges = charge
    order = uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    assert task.delay(order, 10).get() == {"order": order, "charged": 10}
    assert task.delay(order, 99).get() == {"order": order, "charged": 10}  # replayed
    assert charges == [(order, 10)]

    done = run_cli(
        "--backend", store.url, "forget", key, "--task", TASK, "--force", "--reason", "refunded"
    )
    assert done.returncode == 0, done.stderr
    assert "forgot the success of forget.charge" in done.stdout
    assert store.backend.last_success(key, TASK) is None

    assert task.delay(order, 20).get() == {"order": order, "charged": 20}  # the body ran
    assert task.delay(order, 30).get() == {"order": order, "charged": 20}  # and is kept
    assert charges == [(order, 10), (order, 20)]
    records = store.backend.history(key=key, limit=None)
    assert [r.outcome for r in reversed(records)] == [
        Outcome.SUCCEEDED, Outcome.SKIPPED, Outcome.FORGOTTEN, Outcome.SUCCEEDED,
        Outcome.SKIPPED,
    ]  # fmt: skip
    [forgotten] = [r for r in records if r.outcome == Outcome.FORGOTTEN]
    assert forgotten.details is not None
    assert "with celery-dlock forget: refunded" in forgotten.details
    assert f"kept by fence {records[-1].fence}" in forgotten.details
    problems = run_cli("--backend", store.url, "history", "--key", key, "--problems", "--json")
    assert [r["outcome"] for r in json.loads(problems.stdout)["records"]] == ["forgotten"]


def test_an_unanswered_question_forgets_nothing_and_json_says_what_was_kept(
    store: CliStore, charge: tuple[Any, list[tuple[str, int]]]
) -> None:
    task, charges = charge
    order = uuid.uuid4().hex[:8]
    key = f"job:order:{order}"
    task.delay(order, 10).get()
    result = run_cli("--backend", store.url, "forget", key, "--task", TASK, "--json", input="")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert (data["status"], data["forgotten"], data["record"]) == ("declined", False, None)
    assert data["kept"]["result"] == {"value": {"order": order, "charged": 10}}
    assert task.delay(order, 20).get() == {"order": order, "charged": 10}
    assert charges == [(order, 10)]
    assert Outcome.FORGOTTEN not in [r.outcome for r in store.backend.history(key=key)]


def test_a_key_without_its_namespace_or_another_task_forgets_nothing(
    file_store: CliStore, tmp_path: Any
) -> None:
    app = Celery("forget-hint", set_as_current=False)
    app.conf.update(task_always_eager=True, dlock_backend=file_store.url)
    install(app, janitor=False)

    @app.task(shared=False, base=LockedTask, name=TASK, lock_key="order:{order}", once=True)
    def charge(order: str) -> str:
        return f"charged {order}"

    charge.delay("7").get()
    short = run_cli("--backend", file_store.url, "forget", "order:7", "--task", TASK, "--force")
    assert short.returncode == 1
    assert "did you mean 'job:order:7'?" in short.stderr
    other = run_cli(
        "--backend", file_store.url, "forget", "job:order:7", "--task", "forget.refund", "--force"
    )
    assert other.returncode == 1
    assert "no success of forget.refund is kept on 'job:order:7': nothing to forget" in (
        other.stderr
    )
    blank = run_cli("--backend", file_store.url, "forget", "job:order:7", "--task", " ")
    assert blank.returncode == 2 and "must name a task" in blank.stderr
    kept = file_store.backend.last_success("job:order:7", TASK)
    assert kept is not None and kept.result == {"value": "charged 7"}
