"""The dedupe soak's checker (``bench/torture/dedupesoak.py``) on logs written by hand: it
must report each way a coalesced call can miss its run, and overlapping bodies. (The soak
itself runs for minutes with a worker, producers and restarts: ``python -m
bench.torture.dedupesoak``; it is not part of the test run.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.torture.dedupesoak import Logs
from celery_dlock import Holder, Lease, Outcome, Record


def write(path: Path, *entries: dict[str, Any]) -> None:
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries) + '{"e": "cut')


def call(c: int, mine: str, t: float, got: str | None = None) -> list[dict[str, Any]]:
    """A webhook under id ``mine`` at ``t``, answered ``got`` (None: cut by a kill)."""
    sent = [{"e": "call", "c": c, "id": mine, "t": t}]
    return sent if got is None else [*sent, {"e": "ret", "id": mine, "got": got, "t": t + 0.001}]


def body(c: int, task: str, start: float, end: float) -> list[dict[str, Any]]:
    return [
        {"e": "start", "c": c, "task": task, "fence": 1, "t": start},
        {"e": "end", "task": task, "t": end},
    ]


def test_the_checker_reports_every_coalesced_call_without_a_run_after_it(tmp_path: Path) -> None:
    write(
        tmp_path / "producer-1.jsonl",
        *call(1, "a", 1.0, "a"),  # sent; runs at 10
        *call(1, "early", 5.0, "a"),  # coalesced before the run: kept
        *call(1, "late", 11.0, "a"),  # coalesced after the run had started: a violation
        *call(2, "d", 1.0, "d"),  # sent, never runs
        *call(2, "into-d", 6.0, "d"),  # a violation
        *call(3, "f", 1.0),  # its producer killed in the call
        *call(3, "into-f", 2.0, "f"),  # excused
        *call(4, "m", 1.0, "m"),  # sent; its start is known by its mark's record only
        *call(4, "into-m", 2.0, "m"),
        *call(4, "as-m-started", 3.01, "m"),  # as its mark's release began: reported
        *call(4, "after-m", 3.2, "m"),  # its mark's release 0.2 s before: a violation
    )
    write(tmp_path / "producer-2.jsonl", {"e": "err", "id": "x", "error": "OperationalError"})
    write(tmp_path / "body-7.jsonl", *body(1, "a", 10.0, 12.0), *body(5, "p", 20.0, 22.0))
    write(tmp_path / "body-8.jsonl", *body(1, "b", 11.5, 13.0), *body(5, "q", 22.0, 23.0))
    logs = Logs(tmp_path)
    holder = Holder.current(task_id="m", task_name="dsoak.sync")
    mark = Lease("dsoak:sync:4#queued:dsoak.sync", "t", 1, holder, 1.0, None)
    ended = logs.add_dequeued([Record(mark, 3.0, Outcome.DEQUEUED, None, None)])
    assert ended == {"dequeued": 1}

    verdicts, examples = logs.verdicts()
    assert verdicts == {
        "sent": 3,
        "coalesced, run started after": 2,  # "early", and "into-m" by its mark's record
        "coalesced as its run started (its mark being released)": 1,
        "VIOLATION started before the webhook": 2,
        "VIOLATION never ran, sent": 1,
        "never ran, its producer was killed (excused)": 1,
    }
    assert examples["VIOLATION started before the webhook"] == [
        "late at 11.0000 given a started at 10.0000 (-1.0000 s)",
        "after-m at 3.2000 given m started at 3.0000 (-0.2000 s)",
    ]
    assert logs.overlaps() == 1  # "b" began before "a" ended; "q" began as "p" ended
    assert logs.started_after(1, 11.0) and not logs.started_after(2, 0.0)
    assert len(logs.errs) == 1


def mark_record(task: str, acquired: float, released: float, outcome: Outcome) -> Record:
    holder = Holder.current(task_id=task, task_name="dsoak.sync")
    mark = Lease(f"dsoak:sync:1#queued:dsoak.sync:{task}", "t", 1, holder, acquired, None)
    return Record(mark, released, outcome, None, None)


def test_the_until_finished_checker_holds_calls_to_a_queued_or_running_message(
    tmp_path: Path,
) -> None:
    write(
        tmp_path / "producer-1.jsonl",
        *call(1, "a", 1.0, "a"),  # sent; runs 10 to 12, its mark released at 12.01
        *call(1, "queued", 5.0, "a"),  # kept: queued
        *call(1, "running", 11.0, "a"),  # kept: running
        *call(1, "as-it-ended", 12.005, "a"),  # reported: its mark being released
        *call(2, "s", 1.0, "s"),  # sent; runs 2 to 3, its mark released at 30 (late)
        *call(2, "late", 20.0, "s"),  # a violation: 17 s after its run ended
        *call(3, "r", 1.0, "r"),  # sent; its mark released at 4, the message runs at 6
        *call(3, "stale", 5.0, "r"),  # a violation: the mark had ended at 4
        *call(4, "k", 1.0, "k"),  # sent; its child killed before it started
        *call(4, "into-k", 2.0, "k"),  # reported
        *call(5, "d", 1.0, "d"),  # sent; runs 2 to 3, its child killed before the mark's end
        *call(5, "into-d", 9.0, "d"),  # reported: the mark ended disconnected at 12
        *call(6, "h", 1.0, "h"),  # sent; runs 40 to 41 as the store restarts (at 40.5)
        *call(6, "into-h", 44.0, "h"),  # reported: its mark released at 45, held up by it
    )
    write(
        tmp_path / "body-7.jsonl",
        *body(1, "a", 10.0, 12.0),
        *body(2, "s", 2.0, 3.0),
        *body(3, "r", 6.0, 6.5),
        *body(5, "d", 2.0, 3.0),
        *body(6, "h", 40.0, 41.0),
    )
    logs = Logs(tmp_path, "until_finished")
    logs.store_restarts = [40.5]
    logs.add_dequeued(
        [
            mark_record("a", 1.0, 12.01, Outcome.SUCCEEDED),
            mark_record("s", 1.0, 30.0, Outcome.SUCCEEDED),
            mark_record("r", 1.0, 4.0, Outcome.REVOKED),
            mark_record("k", 1.0, 3.0, Outcome.DISCONNECTED),
            mark_record("d", 1.0, 12.0, Outcome.DISCONNECTED),
            mark_record("h", 1.0, 45.0, Outcome.SUCCEEDED),
        ]
    )

    verdicts, examples = logs.verdicts()
    assert verdicts == {
        "sent": 6,
        "coalesced, queued or running": 2,
        "coalesced after its run ended, its mark's release held up by a store restart": 1,
        "coalesced after its run ended, its child killed before the mark's end": 1,
        "coalesced as its run ended (its mark being released)": 1,
        "VIOLATION coalesced after its run had ended": 1,
        "VIOLATION its mark had ended before the webhook": 1,
        "never ran, its child killed first (its result FAILURE)": 1,
    }
    assert examples["VIOLATION coalesced after its run had ended"] == [
        "late at 20.0000 given s started at 2.0000 (-18.0000 s)"
    ]
    assert logs.ended_before_run() == {"revoked": 1}  # "r": its mark ended before it ran


def test_a_call_coalesced_into_a_mark_a_failover_brought_back_is_told_apart(
    tmp_path: Path,
) -> None:
    """Redis Cluster: a message started as its primary failed over; the mark's release was
    lost with that primary, so the mark ran out (``expired``) while calls were coalesced
    into the started message. Reported as such within the failover's window; the same
    without a failover, or long after it, is a violation."""
    write(
        tmp_path / "producer-1.jsonl",
        *call(1, "a", 1.0, "a"),  # sent; starts at 10.5, a failover began at 10.0
        *call(1, "into-a", 12.0, "a"),
        *call(2, "b", 1.0, "b"),  # sent; starts at 20.0, no failover near
        *call(2, "into-b", 21.0, "b"),
    )
    write(tmp_path / "body-7.jsonl", *body(1, "a", 10.5, 10.6), *body(2, "b", 20.0, 20.1))
    logs = Logs(tmp_path)
    logs.failovers = [10.0]
    logs.add_dequeued(
        [mark_record("a", 1.0, 20.0, Outcome.EXPIRED), mark_record("b", 1.0, 30.0, Outcome.EXPIRED)]
    )
    verdicts, _ = logs.verdicts()
    assert verdicts == {
        "sent": 2,
        "coalesced into a mark a failover brought back (its release lost)": 1,
        "VIOLATION started before the webhook": 1,
    }
