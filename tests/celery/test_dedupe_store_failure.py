"""A ``dedupe`` mark whose release the lock store refuses, in an embedded worker on a real
Postgres store in a schema of its own; the refusal is a real server error (a trigger on the
history table that raises for the marks' records of one outcome, dropped later).

Found by the dedupe soak (``python -m bench.torture.dedupesoak --store postgres``): a store
restart as a worker started an ``until_started`` message failed the mark's release, the body
ran all the same, and the mark stayed to its ``dedupe_ttl`` (an hour by default): every
later call for the key was coalesced into a run that had begun, or ended, and nothing ran
for it.

- ``until_started``: a mark the store fails to end as the body is about to start: the body
  does not run; the message is re-queued (its body lock released ``retried``) under its
  mark, so a call meanwhile is still a duplicate of a message that has not started; once the
  store answers, the re-queued message ends its mark and runs, once.
- ``until_finished``: a mark the store fails to end after the body: the release is tried
  again at the process's next release that reaches the store, not left to its ttl."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import pytest

from celery_dlock import LockedTask, Outcome, backend_from_url, install
from celery_dlock.celery.dedupe import mark_key
from tests.celery.support import embedded_app, embedded_worker
from tests.support import eventually
from tests.support.services import POSTGRES_URL, migrated_schema, with_options

psycopg = pytest.importorskip("psycopg")

runs: list[str] = []


@pytest.fixture
def schema() -> Iterator[str]:
    with migrated_schema("dlock_dstore") as (name, admin):
        admin.execute(
            f'CREATE FUNCTION "{name}".refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN '
            "IF NEW.key LIKE '%#queued:%' AND NEW.outcome = TG_ARGV[0] THEN "
            "RAISE EXCEPTION 'the test refuses this mark''s record'; END IF; RETURN NEW; END $$"
        )
        yield name


def refuse(schema: str, outcome: Outcome) -> None:
    """From now on, the store fails every release of a mark recorded ``outcome``."""
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(
            f'CREATE TRIGGER refuse BEFORE INSERT ON "{schema}".history FOR EACH ROW '
            f"EXECUTE FUNCTION \"{schema}\".refuse('{outcome.value}')"
        )


def answer(schema: str) -> None:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(f'DROP TRIGGER refuse ON "{schema}".history')


@pytest.fixture
def store(schema: str) -> Iterator[Any]:
    with closing(backend_from_url(with_options(POSTGRES_URL, schema=schema))) as backend:
        yield backend


@pytest.fixture
def tasks(schema: str) -> Iterator[dict[str, Any]]:
    app = embedded_app("dedupe-store", with_options(POSTGRES_URL, schema=schema))
    install(app, janitor=False)
    made = {}
    for dedupe in ("until_started", "until_finished"):

        @app.task(shared=False, base=LockedTask, name=f"dstore.{dedupe}", dedupe=dedupe,
                  lock_key="sync:{customer}", lock_retry_backoff=0.2,
                  lock_retry_backoff_max=0.2)  # fmt: skip
        def sync(customer: str, dedupe: str = dedupe) -> str:
            runs.append(f"{dedupe}:{customer}")
            return customer

        made[dedupe] = sync
    runs.clear()
    with embedded_worker(app, pool="solo", shutdown_timeout=10):
        yield made


def test_a_mark_the_store_fails_to_end_at_the_start_keeps_the_body_from_running(
    tasks: dict[str, Any], schema: str, store: Any
) -> None:
    sync, customer = tasks["until_started"], uuid.uuid4().hex[:8]
    key, mark = f"job:sync:{customer}", mark_key(f"job:sync:{customer}", "dstore.until_started")
    refuse(schema, Outcome.DEQUEUED)
    try:
        first = sync.delay(customer)
        retried = eventually(
            lambda: [r for r in store.history(key=key) if r.outcome is Outcome.RETRIED],
            "the body lock released as the message is re-queued",
            30,
        )
        assert retried[0].lease.holder.task_id == first.id
        assert "the test refuses" in (retried[0].details or "")
        assert runs == []  # the body did not run while its mark stood
        held = store.get(mark)
        assert held is not None and held.holder.task_id == first.id
        assert sync.delay(customer).id == first.id  # not started: a duplicate
    finally:
        answer(schema)
    assert first.get(timeout=30) == customer  # the re-queued message, once the store answers
    assert runs == [f"until_started:{customer}"]
    assert store.get(mark) is None
    [dequeued] = store.history(key=mark)
    assert (dequeued.outcome, dequeued.lease.holder.task_id) == (Outcome.DEQUEUED, first.id)
    assert sync.delay(customer).id != first.id  # it has started: the next call is sent


def test_a_mark_the_store_fails_to_end_after_the_body_is_ended_at_the_next_release(
    tasks: dict[str, Any], schema: str, store: Any
) -> None:
    sync, customer = tasks["until_finished"], uuid.uuid4().hex[:8]
    mark = mark_key(f"job:sync:{customer}", "dstore.until_finished")
    refuse(schema, Outcome.SUCCEEDED)
    try:
        first = sync.delay(customer)
        assert first.get(timeout=30) == customer
        held = store.get(mark)  # the store refused its end
        assert held is not None and held.holder.task_id == first.id
    finally:
        answer(schema)
    other = uuid.uuid4().hex[:8]
    assert tasks["until_started"].delay(other).get(timeout=30) == other  # a release: settles
    assert store.get(mark) is None  # not left to its ttl
    [ended] = store.history(key=mark)
    assert (ended.outcome, ended.lease.holder.task_id) == (Outcome.SUCCEEDED, first.id)
    assert sync.delay(customer).id != first.id
    assert runs == [f"until_finished:{customer}", f"until_started:{other}"]
