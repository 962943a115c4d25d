"""``marks``: the dedupe marks held now, and whether their message has run; ``--release-ran``
releases the marks a store brought back after losing their release (held for a message that
ran: every call of its key coalesced into it until its ``dedupe_ttl`` ends), and no other."""

from __future__ import annotations

import json

from celery_dlock import Outcome
from celery_dlock.records import HANDED_ON, REQUEUE
from tests.cli.clitools import CliStore, run_cli
from tests.support.marks import TASK, body, handed_mark


def test_marks_tells_a_mark_whose_message_ran_and_releases_only_those(store: CliStore) -> None:
    backend = store.backend
    marks = {n: handed_mark(backend, f"job:sync:{n}", f"t{n}") for n in range(1, 10)}
    body(backend, "job:sync:1", "t1", Outcome.SUCCEEDED)  # ran
    body(backend, "job:sync:2", "t2", Outcome.RETRIED)  # goes on under its mark
    running = body(backend, "job:sync:3", "t3", None)  # runs now
    # 4: no run of it seen (queued)
    body(backend, "job:sync:5", "t99", Outcome.SUCCEEDED)  # another task id's run
    body(backend, "job:sync:6#1", "t6", Outcome.FAILED)  # ran, on a slot of a lock_limit
    # A run that replaced itself (Task.replace): the replacement goes on under its task id.
    body(backend, "job:sync:7", "t7", Outcome.SUCCEEDED, f"{HANDED_ON}{TASK}: its result...")
    body(backend, "job:sync:8", "t8", Outcome.RETRIED)  # retried, then ran
    body(backend, "job:sync:8", "t8", Outcome.SUCCEEDED)
    # A Reject that put its message back (acks_late): it runs again under its mark.
    requeued = body(backend, "job:sync:9", "t9", None)
    backend.release(requeued, Outcome.FAILED, "Reject", f"{REQUEUE}True: Reject(...)")

    shown = run_cli("--backend", store.url, "marks")
    assert shown.returncode == 0, shown.stderr
    states = {line.split()[0]: line for line in shown.stdout.splitlines()[1:]}
    assert set(states) == {mark.key for mark in marks.values()}, shown.stdout
    assert "ran: succeeded" in states[marks[1].key] and "ran: failed" in states[marks[6].key]
    assert "ran: succeeded" in states[marks[8].key]
    assert f"running (fence {running.fence})" in states[marks[3].key]
    for n in (2, 4, 5, 7, 9):
        assert states[marks[n].key].rstrip().endswith("queued"), states[marks[n].key]

    declined = run_cli("--backend", store.url, "marks", "--release-ran", input="")
    assert declined.returncode == 1, declined.stdout + declined.stderr
    assert all(backend.get(mark.key) is not None for mark in marks.values())

    done = run_cli("--backend", store.url, "marks", "--release-ran", "--force", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    ran = [marks[1].key, marks[6].key, marks[8].key]
    assert sorted(r["key"] for r in report["released"]) == ran
    for n, mark in marks.items():
        now = backend.get(mark.key)
        if n in (1, 6, 8):
            assert now is None
            (record,) = backend.history(key=mark.key)
            assert record.outcome is Outcome.FORCED and record.lease.token == mark.token
            assert record.details is not None and "marks --release-ran" in record.details
        else:
            assert now is not None and now.token == mark.token

    again = run_cli("--backend", store.url, "marks", "--release-ran", "--force")
    assert again.returncode == 0, again.stderr
    assert "no mark under 'job:' is held for a message that has run" in again.stdout
