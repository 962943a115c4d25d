"""The soak's checker (``soak.py``): the ledger, the bodies' logs and the store's history.

1. Every order charged exactly once: its ledger counter is 1, from one accepted write.
2. No two bodies of one order overlapped in time, unless the later one's fence is higher and
   the ledger refused the earlier one's write ("fenced"). A body lasts from its ``start``
   line to its ``end`` line, or to the SIGKILL of its process.
3. Every accepted write comes from a logged body, and every body that logged its write
   accepted is in the ledger's journal.
4. The history explains every kill: each lease the killed process held (the store's leases
   read while it was stopped just before the SIGKILL, and the body it was in) is recorded
   ``disconnected``, ``expired`` or ``lost``; one whose body had ended may have had its
   release land (``succeeded``, ``failed``), and one kept for the body's retry (after a
   ledger error, ``lock_across_retries``) outlives its process until the retry takes it
   over (``retried``). And every body's lease has a record.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from pathlib import Path
from typing import Any

from celery_dlock import LockBackend, backend_from_url

from .check import Findings, json_lines
from .ledger import Ledger
from .run import settle

__all__ = ["SoakReport", "check", "table"]

KILLED = {"disconnected", "expired", "lost"}


@dataclasses.dataclass
class SoakReport(Findings):
    tasks: int
    duplicates: int
    published: int = 0
    duration: float = 0.0
    bodies: int = 0
    charged_once: int = 0
    double_charges: int = 0
    uncharged: int = 0
    kills: int = 0
    killed_in_body: int = 0
    kills_explained: int = 0
    broker_restarts: int = 0
    store_restarts: int = 0
    worker_exits: int = 0  # the worker died by itself and was started again
    overlaps: int = 0
    fenced_overlaps: int = 0
    refused: int = 0
    kept_at_write: int = 0
    killed_after_write: int = 0  # killed in its body after its charge committed
    ledger_errors: int = 0
    records_checked: int = 0
    lost_records: int = 0
    killed_outcomes: dict[str, int] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"soak: {self.published} messages for {self.tasks} orders, {self.bodies} bodies; "
            f"refused stale writes {self.refused}, successes found kept at the write "
            f"{self.kept_at_write}, bodies killed after their charge committed "
            f"{self.killed_after_write}, ledger errors {self.ledger_errors}, records checked "
            f"{self.records_checked}, killed leases {self.killed_outcomes or '-'}"
        )


@dataclasses.dataclass
class Body:
    key: str
    token: str
    fence: int
    start: float
    pid: int
    end: float = math.inf
    ended: bool = False
    accepted: bool | str | None = None


def load_bodies(logs: Path, kills: dict[int, float], report: SoakReport) -> list[Body]:
    bodies: list[Body] = []
    for path in sorted(logs.glob("body-*.jsonl")):
        pid = int(path.stem.removeprefix("body-"))
        mine: dict[str, Body] = {}
        for entry in json_lines(path):
            if entry["e"] == "start":
                body = Body(entry["key"], entry["token"], entry["fence"], entry["t"], pid)
                mine[body.token] = body
            else:
                body = mine[entry["token"]]
                body.end, body.ended, body.accepted = entry["t"], True, entry["accepted"]
                report.refused += body.accepted is False
                report.kept_at_write += body.accepted == "kept"
                report.ledger_errors += body.accepted is None
        for body in mine.values():
            if body.ended:
                continue
            if pid in kills:
                body.end = kills[pid]
                report.killed_in_body += 1
            else:
                body.end = body.start
                report.fail(f"{body.key}: fence {body.fence} (pid {pid}) never ended")
        bodies.extend(mine.values())
    report.bodies = len(bodies)
    return bodies


def check_ledger(bodies: list[Body], ledger: Ledger, report: SoakReport) -> None:
    """Invariants 1 and 3."""
    state, journal = ledger.state(), ledger.journal()
    by_fence = {(body.key, body.fence): body for body in bodies}
    landed: set[tuple[str, int]] = set()
    for key, (counter, _) in sorted(state.items()):
        writes = journal.get(key, [])
        if counter == 1 and len(writes) == 1:
            report.charged_once += 1
        elif counter == 0 and not writes:
            report.uncharged += 1
            report.fail(f"{key}: never charged")
        else:
            report.double_charges += 1
            report.fail(f"{key}: counter {counter}, accepted writes {writes}")
        for fence, _ in writes:
            landed.add((key, fence))
            if (key, fence) not in by_fence:
                report.fail(f"{key}: accepted write of fence {fence} from no logged body")
    for body in bodies:
        report.killed_after_write += not body.ended and (body.key, body.fence) in landed
        if body.accepted is True and (body.key, body.fence) not in landed:
            report.fail(f"{body.key}: fence {body.fence} logged accepted, not in the journal")


def check_overlaps(bodies: list[Body], report: SoakReport) -> None:
    """Invariant 2."""
    keyed: dict[str, list[Body]] = {}
    for body in sorted(bodies, key=lambda b: b.start):
        keyed.setdefault(body.key, []).append(body)
    for key, mine in keyed.items():
        for earlier, later in itertools.pairwise(mine):
            if later.fence <= earlier.fence:
                report.fail(f"{key}: fence {later.fence} granted after fence {earlier.fence}")
        for earlier, later in itertools.combinations(mine, 2):
            if earlier.end <= later.start:
                continue
            if later.fence > earlier.fence and earlier.accepted is False:
                report.fenced_overlaps += 1
                continue
            report.overlaps += 1
            report.fail(
                f"{key}: fence {later.fence} (pid {later.pid}) began "
                f"{earlier.end - later.start:.6f} s before fence {earlier.fence} "
                f"(pid {earlier.pid}, {'ended' if earlier.ended else 'killed'}, "
                f"write {earlier.accepted}) ended"
            )


def check_history(
    bodies: list[Body], kills: list[dict[str, Any]], backend: LockBackend, report: SoakReport
) -> None:
    """Invariant 4."""
    recorded: dict[str, list[str]] = {}
    for record in backend.history(limit=None):
        recorded.setdefault(record.lease.token, []).append(str(record.outcome))
    ended = {body.token for body in bodies if body.ended}
    kept = {body.token for body in bodies if body.ended and body.accepted is None}
    outcomes: Counter[str] = Counter()
    for kill in kills:
        tokens = {token for _, token in kill["held"]}
        if kill["start"] is not None:
            tokens.add(kill["start"]["token"])
        explained = True
        for token in sorted(tokens):
            found = recorded.get(token, [])
            outcomes.update(found or ["missing"])
            allowed = KILLED | ({"succeeded", "failed"} if token in ended else set())
            allowed |= {"retried"} if token in kept else set()
            if not found or not set(found) <= allowed:
                explained = False
                report.fail(f"kill of pid {kill['pid']}: lease {token} recorded {found}")
        report.kills_explained += explained
    for body in bodies:
        report.records_checked += 1
        if body.token not in recorded:
            report.lost_records += 1
            report.fail(f"{body.key}: no record of fence {body.fence} (pid {body.pid})")
    report.killed_outcomes = dict(sorted(outcomes.items()))


def check(
    report: SoakReport,
    logs: Path,
    events: list[dict[str, Any]],
    ledger: Ledger,
    *,
    store_url: str,
    namespace: str,
) -> None:
    """Check every invariant of the soak whose bodies logged to ``logs``."""
    kills = [event for event in events if event["e"] == "kill"]
    report.kills = len(kills)
    exits = [event for event in events if event["e"] == "exit"]
    report.worker_exits = len(exits)
    ends: dict[int, float] = {}  # pid -> when it was killed, or its worker exited
    for event in sorted(kills + exits, key=lambda event: event["t"]):
        for pid in event["children"] if event["e"] == "exit" else [event["pid"]]:
            ends.setdefault(pid, event["t"])
    if len({kill["pid"] for kill in kills}) < len(kills):
        report.fail("a pid was killed twice (a harness error)")
    restarts = [event["what"] for event in events if event["e"] == "restart"]
    report.broker_restarts, report.store_restarts = (
        restarts.count("broker"),
        restarts.count("store"),
    )
    bodies = load_bodies(logs, ends, report)
    check_ledger(bodies, ledger, report)
    check_overlaps(bodies, report)
    backend = backend_from_url(store_url)
    try:
        left = settle(backend, f"{namespace}:", 30.0)
        if left:
            report.fail(f"{left} leases still held (or the store unreachable) after the run")
        check_history(bodies, kills, backend, report)
    finally:
        backend.close()


COLUMNS = (
    ("orders", "tasks"),
    ("duplicates", "duplicates"),
    ("messages", "published"),
    ("bodies", "bodies"),
    ("charged once", "charged_once"),
    ("double charges", "double_charges"),
    ("uncharged", "uncharged"),
    ("kills", "kills"),
    ("in body", "killed_in_body"),
    ("kills explained", "kills_explained"),
    ("broker restarts", "broker_restarts"),
    ("store restarts", "store_restarts"),
    ("worker exits", "worker_exits"),
    ("overlaps", "overlaps"),
    ("fenced overlaps", "fenced_overlaps"),
    ("lost records", "lost_records"),
    ("violations", "violations"),
    ("duration s", "duration"),
)


def table(report: SoakReport) -> str:
    """The results as a Markdown table (the torture's style)."""
    cells = [
        f"{value:.1f}" if isinstance(value := getattr(report, name), float) else str(value)
        for _, name in COLUMNS
    ]
    rows = [[title for title, _ in COLUMNS], cells]
    widths = [max(len(row[n]) for row in rows) for n in range(len(COLUMNS))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
