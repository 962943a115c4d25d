"""``self.idempotency_key``: one per logical operation, for a task with several keys or a
``lock_limit`` too (eager app on the memory store: the key comes from the request)."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from celery import Celery

from celery_dlock import LockedTask, install


def _app() -> tuple[Celery, list[tuple[str, str]]]:
    app = Celery("idempotency-tests", set_as_current=False)
    app.conf.update(task_always_eager=True, dlock_backend=f"memory://{uuid.uuid4().hex}")
    install(app, janitor=False)
    seen: list[tuple[str, str]] = []

    @app.task(shared=False, base=LockedTask, bind=True, name="i.transfer",
              lock_key=["account:{src}", "account:{dst}"])  # fmt: skip
    def transfer(self: Any, src: str, dst: str, amount: int) -> None:
        seen.append((f"{src}->{dst}", self.idempotency_key))

    @app.task(shared=False, base=LockedTask, bind=True, name="i.export", lock_key="export:{tenant}",
              lock_limit=3)  # fmt: skip
    def export(self: Any, tenant: str) -> None:
        seen.append((self.lease.key, self.idempotency_key))

    @app.task(shared=False, base=LockedTask, bind=True, name="i.charge", lock_key="order:{order}")
    def charge(self: Any, order: int) -> None:
        seen.append(("charge", self.idempotency_key))

    return app, seen


def test_transfers_between_other_accounts_or_the_other_way_have_keys_of_their_own() -> None:
    # Found by trying the API: the key came from the first of the sorted leases, so every
    # transfer touching account A shared one, and a gateway took A->C for a replay of A->B.
    app, seen = _app()
    transfer = app.tasks["i.transfer"]
    for src, dst in [("A", "B"), ("A", "C"), ("B", "A"), ("A", "B")]:
        transfer.apply((src, dst, 10)).get()
    keys = [key for _, key in seen]
    assert keys[0] == keys[3]  # a duplicate of A->B
    assert len(set(keys[:3])) == 3


def test_a_limited_task_s_key_is_the_same_whatever_slot_it_holds() -> None:
    app, seen = _app()
    export = app.tasks["i.export"]
    for _ in range(12):
        export.apply(("acme",)).get()
    assert len({slot for slot, _ in seen}) > 1  # it did run in several slots
    assert len({key for _, key in seen}) == 1


def test_a_single_key_s_idempotency_key_is_unchanged() -> None:
    app, seen = _app()
    app.tasks["i.charge"].apply((42,)).get()
    digest = hashlib.sha256(b"i.charge\njob:order:42").hexdigest()[:40]
    assert seen == [("charge", f"dlock-{digest}")]
