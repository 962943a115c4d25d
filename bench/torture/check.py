"""The invariant checker over a run's logs, its ledger and its store's history.

Sections come from the workers' logs (``worker.py``); kills, pauses, restarts and partitions
from ``chaos.jsonl`` (``chaos.py``). A section's interval is from its lease's grant (``begin``) to
just before its release (``end``), or to the moment its worker was SIGKILLed. What must hold:

1. No two sections on one key overlap in time, unless the later one's fence is higher and the
   ledger refused the earlier one's write ("fenced"; the ledger refuses a fence lower than
   one that has read, see ``ledger.py``), and the earlier one's release did not find its
   lease still there (then the store held two leases at once: a double grant that the
   fence happened to stop). One more exception ("serialized"): the
   earlier holder lost its lease to a recorded fault (a pause past the ttl, a partition, or a
   store restart, between its write and its release) after its write was accepted, and the
   later one read that write; or it lost its lease so and was killed before it wrote. A
   partition's lease must be freed (``FREE_LIMIT``).
2. Fences strictly increase per key: among sections in order of grant, and among the ledger's
   accepted writes in the order accepted.
3. The ledger agrees with itself and with the logs: each key's counter equals its accepted
   writes (an overlap that slipped through loses an update), less the "late writes" of
   killed holders (see ``_late_writes``); every accepted write belongs to a logged section
   and every section's logged verdict matches the journal.
4. Every lease has its record in the store's history (``history(key=...)``): a release the
   store acknowledged, one ``succeeded``; one that found the lease gone, ``lost``; a holder
   SIGKILLed in its section, ``disconnected``, ``expired`` or ``lost`` (once the store took
   the key over or reaped it); a release that failed, whatever it became. Unless a restart
   that may lose data came after it: Postgres ``-m immediate`` (the last ~0.6 s of history,
   and the locks table: a live or dead lease not yet recorded never will be), a wiped
   Redis (everything), or a Redis Cluster failover (what the dying primary wrote in its
   last moments, see ``_excuse``); or such a restart (not a failover) came during the
   section of a holder that died before its release said how it ended (the lease died with
   the store's data, and only its release would have recorded it ``lost``).
5. No lease is recorded ``disconnected`` while its holder lived and reached its store: not
   killed, not cut off by a partition (nor was another lease of its set), no store restart
   from its grant to its release, and its release did not fail (a failed one leaves the
   lease to its holder's death).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from celery_dlock import LockBackend

from .ledger import Ledger
from .servers import LOSSY

__all__ = ["Report", "Section", "check", "load_sections"]

#: Seconds of history before a Postgres crash that asynchronous commit may lose (3 x
#: wal_writer_delay is 0.6 s), with a margin.
CRASH_WINDOW = 2.0
#: Violations listed in full; beyond this only counted.
SHOWN = 20


@dataclasses.dataclass
class Section:
    """One critical section, from one worker's log."""

    key: str
    token: str
    fence: int
    start: float
    log: str
    end: float = math.inf  # just before its release, or when its worker was killed
    ended: bool = False  # the worker logged the end (it was killed later, if at all)
    read: int | None = None
    accepted: bool | None = None  # as logged; None if the worker died first
    release: str | None = None  # ok, lost, error; None if the worker died first
    #: When the release returned (its record acknowledged); None in logs from before it
    #: was logged. Later than ``end`` by as long as the release waited: a cut-off holder's
    #: until the network healed.
    released: float | None = None
    killed: bool = False  # its worker was killed before it logged the release's result
    landed: bool = False  # its write is in the ledger's journal


@dataclasses.dataclass(kw_only=True)
class Findings:
    """The violations a check found, and the first ``SHOWN`` of them in words."""

    violations: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    def fail(self, problem: str) -> None:
        self.violations += 1
        if len(self.problems) < SHOWN:
            self.problems.append(problem)


@dataclasses.dataclass
class Report(Findings):
    store: str
    duration: float = 0.0
    acquisitions: int = 0
    busy: int = 0
    store_errors: int = 0  # acquires that failed
    release_errors: int = 0
    ledger_errors: int = 0
    kills: int = 0
    killed_in_section: int = 0
    restarts: int = 0
    restart_kinds: str = ""
    pauses: int = 0
    partitions: int = 0
    diskfulls: int = 0
    freed_after: list[float] = dataclasses.field(default_factory=list)  # s, per partition
    cut_releases: dict[str, int] = dataclasses.field(default_factory=dict)  # cut-off sections'
    cut_outcomes: dict[str, int] = dataclasses.field(default_factory=dict)  # their records
    overlaps: int = 0  # pairs of sections that overlapped, excused ones not counted
    fenced_overlaps: int = 0
    serialized_overlaps: int = 0
    refused: int = 0
    late_writes: int = 0
    lost_releases: int = 0
    records_checked: int = 0
    lost_records: int = 0
    excused_records: int = 0
    crash_loss: float = 0.0  # seconds of acknowledged history before a crash found missing
    killed_outcomes: dict[str, int] = dataclasses.field(default_factory=dict)


def json_lines(path: Path) -> Iterable[dict[str, Any]]:
    """The JSON lines of a log, without a last line that a SIGKILL cut short."""
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n"):  # a line cut by SIGKILL is not a line
                yield json.loads(line)


def load_events(directory: Path) -> list[dict[str, Any]]:
    """The chaos thread's record of the run's faults."""
    path = directory / "chaos.jsonl"
    return list(json_lines(path)) if path.exists() else []


def load_sections(directory: Path, events: list[dict[str, Any]], report: Report) -> list[Section]:
    """Every section of the run, with kills applied; counts busy keys and store errors."""
    kills = {event["log"]: event for event in events if event["e"] == "kill"}
    # The faults asked for: not the workers killed at the stop (still starting, or stuck).
    report.kills = sum(not event.get("at_stop", False) for event in kills.values())
    restarts = [event for event in events if event["e"] == "restart"]
    report.restarts = len(restarts)
    report.pauses = sum(event["e"] == "pause" for event in events)
    report.diskfulls = sum(event["e"] == "diskfull" for event in events)
    for event in events:
        if event["e"] != "partition":
            continue
        report.partitions += 1
        if event["t_free"] is None:
            report.fail(f"{event['key']}: fence {event['fence']} cut off, its lease never freed")
        else:
            report.freed_after.append(round(event["t_free"] - event["t"], 3))
    report.restart_kinds = ",".join(event["kind"] for event in restarts)
    sections: list[Section] = []
    for log in sorted(directory.glob("w*.jsonl")):
        mine: dict[str, Section] = {}
        for entry in json_lines(log):
            kind = entry["e"]
            if kind == "begin":
                section = Section(
                    entry["key"], entry["token"], entry["fence"], entry["t"], log.name
                )
                mine[section.token] = section
            elif kind == "end":
                section = mine[entry["token"]]
                section.end, section.read = entry["t"], entry["read"]
                section.accepted, section.ended = entry["accepted"], True
            elif kind == "rel":
                section = mine[entry["token"]]
                section.release, section.released = entry["release"], entry.get("t")
            elif kind == "busy":
                report.busy += 1
            elif kind == "store_error":
                report.store_errors += 1
            elif kind == "ledger_error":
                report.ledger_errors += 1
        kill = kills.get(log.name)
        for section in mine.values():
            if section.release is not None:
                continue
            if kill is None:  # the worker died by itself: see its .err file
                section.end = section.end if section.ended else section.start
                report.fail(f"{section.key}: fence {section.fence} ({log.name}) never ended")
                continue
            section.killed = True
            if not section.ended:
                section.end = kill["t"]
                report.killed_in_section += 1
        sections.extend(mine.values())
    report.acquisitions = len(sections)
    if not sections:  # e.g. every worker started after the stop, on a loaded machine
        report.fail("no acquisition at all: the run tested nothing")
    return sections


def _by_key(sections: list[Section]) -> dict[str, list[Section]]:
    keyed: dict[str, list[Section]] = {}
    for section in sorted(sections, key=lambda s: s.start):
        keyed.setdefault(section.key, []).append(section)
    return keyed


def check_ledger(keyed: dict[str, list[Section]], ledger: Ledger, report: Report) -> None:
    """Invariants 2 (the journal's half) and 3."""
    state, journal = ledger.state(), ledger.journal()
    for key, (counter, last_fence) in sorted(state.items()):
        writes = journal.get(key, [])
        if writes and last_fence != writes[-1][0]:
            report.fail(f"{key}: last fence {last_fence}, last accepted write {writes[-1][0]}")
        for (before, _), (after, _) in itertools.pairwise(writes):
            if after <= before:
                report.fail(f"{key}: the ledger accepted fence {after} after {before}")
        sections = {section.fence: section for section in keyed.get(key, [])}
        for fence, written in writes:
            section = sections.get(fence)
            if section is None:
                report.fail(f"{key}: accepted write of fence {fence} from no logged section")
            else:
                section.landed = True
                section.read = written - 1 if section.read is None else section.read
        late = _late_writes(writes, sections)
        report.late_writes += late
        if counter != len(writes) - late:
            report.fail(
                f"{key}: counter {counter} but {len(writes)} accepted writes"
                + (f" ({late} late writes of killed holders)" if late else "")
            )
    for sections_of_key in keyed.values():
        for section in sections_of_key:
            if section.accepted is not None and section.accepted != section.landed:
                report.fail(
                    f"{section.key}: fence {section.fence} logged accepted={section.accepted} "
                    f"but the journal says {section.landed}"
                )
            report.refused += section.accepted is False
            report.lost_releases += section.release == "lost"
            report.release_errors += section.release == "error"


def _late_writes(writes: list[tuple[int, int]], sections: dict[int, Section]) -> int:
    """Updates lost to a killed holder's write that landed after its death: it was in
    flight (sent to the ledger's server, which ran it after the client was gone), and the
    next holder, granted after the kill, had read the counter before it landed. The lock did
    its job; a fence checked only at the write cannot refuse such a write, and its update
    and the next holder's overwrite each other. Counted apart, not as violations; any other
    repeated counter is a lost update the lock let happen."""
    late = 0
    seen: dict[int, int] = {}  # counter written -> fence that wrote it
    for fence, counter in writes:
        first = seen.get(counter)
        if first is not None:
            dead, next_holder = sections.get(first), sections.get(fence)
            if (
                dead is not None
                and next_holder is not None
                and dead.killed
                and not dead.ended
                and dead.end <= next_holder.start
            ):
                late += 1
        seen[counter] = fence
    return late


def _lost_by_fault(section: Section, events: list[dict[str, Any]]) -> bool:
    """Whether a recorded fault can have cost ``section`` its lease while it ran: its worker
    was paused or cut off in it, or the store restarted during it."""
    paused = (
        event["e"] in ("pause", "partition")
        and event["log"] == section.log
        and section.start <= event["t"] <= section.end
        for event in events
    )
    restarted = (
        event["e"] == "restart" and event["t"] <= section.end and event["t_end"] >= section.start
        for event in events
    )
    return any(paused) or any(restarted)


def _serialized(earlier: Section, later: Section, events: list[dict[str, Any]]) -> bool:
    """Whether the ledger ordered two overlapping sections all the same: the earlier one
    lost its lease to a recorded fault (a pause past its ttl, a store restart) and the later
    one has a higher fence, and either the earlier one's write was accepted before and the
    later one read that write (or was killed before it wrote anything), or the earlier one
    was killed before its write, so nothing of it reached the ledger (a pause past the ttl,
    then a SIGKILL just as it woke up). Harmless, and no lock can prevent it; any overlap that
    lost an update still fails invariant 3."""
    if not (
        later.fence > earlier.fence and earlier.release != "ok" and _lost_by_fault(earlier, events)
    ):
        return False
    if not earlier.landed:
        return earlier.killed and earlier.accepted is None
    if later.read is None:  # killed before its end line; read known if its write landed
        return not later.landed
    return earlier.read is not None and later.read > earlier.read


def check_sections(
    keyed: dict[str, list[Section]], events: list[dict[str, Any]], report: Report
) -> None:
    """Invariants 1 and 2 (the grants' half)."""
    for key, sections in sorted(keyed.items()):
        for earlier, later in itertools.pairwise(sections):
            if later.fence <= earlier.fence:
                report.fail(
                    f"{key}: fence {later.fence} granted at {later.start:.6f} after fence "
                    f"{earlier.fence} at {earlier.start:.6f}"
                )
        open_sections: list[Section] = []
        for section in sections:
            open_sections = [other for other in open_sections if other.end > section.start]
            for earlier in open_sections:
                if (
                    section.fence > earlier.fence
                    and earlier.accepted is False
                    and earlier.release != "ok"
                ):
                    report.fenced_overlaps += 1
                    continue
                if _serialized(earlier, section, events):
                    report.serialized_overlaps += 1
                    continue
                report.overlaps += 1
                report.fail(
                    f"{key}: fence {section.fence} ({section.log}) began "
                    f"{earlier.end - section.start:.6f} s before fence {earlier.fence} "
                    f"({earlier.log}, {'killed' if earlier.killed else earlier.release}, "
                    f"write {'accepted' if earlier.landed else 'not made'}) ended"
                )
            open_sections.append(section)


def _excuse(section: Section, restarts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The restart after its end by which the record of ``section`` may be lost, or never
    written: a wiped Redis loses everything; a Postgres crash loses the last moments of
    history and its locks table, so a lease not yet released or taken over is never
    recorded (the README's known gap); a Redis Cluster failover loses what the primary
    wrote in its last moments (from shortly before the chaos thread cut its replica off
    until it died), so a lease granted or released then is unknown to its replica, or
    still held there until it expires. Also a crash or a wipe during the section of a holder
    that died before its release said how it ended: its lease died with the data, and only
    that release would have recorded it (``lost``). None if there is none."""
    for restart in restarts:
        if restart["kind"] == "failover":
            if section.end >= restart["t"] - CRASH_WINDOW and section.start <= restart["t_end"]:
                return restart
            continue
        if restart["kind"] not in LOSSY:
            continue
        if restart["t_end"] < section.end:
            if restart["t_end"] >= section.start and not _acknowledged(section):
                return restart  # the lease lived through the crash; its holder did not
            continue
        if restart["kind"] == "wiped" or not _acknowledged(section):
            return restart
        # Asynchronous commit: what the store acknowledged shortly before the crash.
        if restart["t"] - CRASH_WINDOW < _acknowledged_at(section) <= restart["t_end"]:
            return restart
    return None


def _acknowledged(section: Section) -> bool:
    return section.release in ("ok", "lost")


def _acknowledged_at(section: Section) -> float:
    """When the store acknowledged the release of a section (its end, in logs that do not
    say, and for a section its worker did not see released)."""
    return section.end if section.released is None else section.released


#: What may be recorded of a lease whose holder was killed inside its section, or whose
#: release found it gone (the holder's own record is then ``lost``).
KILLED = {"disconnected", "expired", "lost"}


def _lost_record_lost(section: Section, found: list[str]) -> bool:
    """Whether only the holder's own ``lost`` record of a release that found its lease gone
    is missing: the store recorded the lease when it freed it (``disconnected``, ``expired``)
    and a crash lost the ``lost`` record written after (a cut-off holder's release, once
    the network healed just before a Postgres ``-m immediate``: 2026-11-28)."""
    return section.release == "lost" and "lost" not in found and set(found) <= KILLED


def wrong_record(section: Section, found: list[str]) -> str | None:
    """What is wrong with the records of one section's lease, which exist; None if they
    are the right ones."""
    if section.release == "ok" and found != ["succeeded"]:
        return f"{section.key}: fence {section.fence} released ok, recorded {found}"
    if section.release == "lost" and ("lost" not in found or not set(found) <= KILLED):
        return f"{section.key}: fence {section.fence} released lost, recorded {found}"
    if section.killed and not section.ended and not set(found) <= KILLED:
        return f"{section.key}: fence {section.fence} killed in section, recorded {found}"
    return None


def check_history(
    keyed: dict[str, list[Section]],
    backend: LockBackend,
    events: list[dict[str, Any]],
    report: Report,
) -> None:
    """Invariant 4, for every section: its lease's record is in the store's history."""
    restarts = [event for event in events if event["e"] == "restart"]
    cut = {event["token"] for event in events if event["e"] == "partition"}
    partitioned = _partitioned(keyed, events)
    releases: Counter[str] = Counter()
    cut_outcomes: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    # One pass over the whole history, not one per key: the file store reads every record
    # for each query (a million records: ~30 s a query).
    by_key: dict[str, dict[str, list[str]]] = {}
    for record in backend.history(limit=None):
        tokens = by_key.setdefault(record.key, {})
        tokens.setdefault(record.lease.token, []).append(str(record.outcome))
    for key, sections in sorted(keyed.items()):
        recorded = by_key.get(key, {})
        for section in sections:
            report.records_checked += 1
            found = recorded.get(section.token)
            if section.killed:
                outcomes.update(found or ["missing"])
            if section.token in cut:
                releases.update([section.release or "none"])
                cut_outcomes.update(found or ["missing"])
            if found and "disconnected" in found and _alive(section, restarts, partitioned):
                report.fail(
                    f"{key}: fence {section.fence} recorded disconnected while its holder "
                    f"lived, its store up ({section.log})"
                )
                continue
            if found:
                if (wrong := wrong_record(section, found)) is None:
                    continue
                excuse = _excuse(section, restarts)
                if excuse is not None and excuse["kind"] == "failover":
                    report.excused_records += 1  # a release the failover undid: expired
                elif excuse is not None and _lost_record_lost(section, found):
                    _excused(report, excuse, section)
                else:
                    report.fail(wrong)
            elif (excuse := _excuse(section, restarts)) is not None:
                _excused(report, excuse, section)
            else:
                report.lost_records += 1
                what = "killed holder" if section.killed else f"{section.release} release"
                report.fail(f"{key}: no record of fence {section.fence} ({what}, {section.log})")
    report.killed_outcomes = dict(sorted(outcomes.items()))
    report.cut_releases = dict(sorted(releases.items()))
    report.cut_outcomes = dict(sorted(cut_outcomes.items()))


def _partitioned(keyed: dict[str, list[Section]], events: list[dict[str, Any]]) -> set[str]:
    """The tokens of every lease a partition cut off: the one its event names and the
    others its worker held during it (``--together``: the rest of the set)."""
    cuts = [event for event in events if event["e"] == "partition"]
    tokens = {event["token"] for event in cuts}
    for sections in keyed.values():
        for section in sections:
            until = _acknowledged_at(section)
            if any(
                event.get("log") == section.log
                and section.start <= event.get("t_heal", event["t"])
                and until >= event["t"]
                for event in cuts
            ):
                tokens.add(section.token)
    return tokens


def _alive(section: Section, restarts: list[dict[str, Any]], cut: set[str]) -> bool:
    """Whether the holder of ``section`` lived, and reached its store, until its release:
    not killed, not cut off, and no store restart (which ends lock sessions) from its grant
    to its release, and the release reached the store. Its lease is then never
    ``disconnected``. A release that failed (``error``: the file store's disk full) leaves
    the lease held, its release deferred to the process's next one: the holder killed
    before that, the lease is rightly ``disconnected`` (2026-11-29, ``--short``: a worker's
    two releases failed on the full disk, it was killed 1.6 s later, and both its leases were
    recorded ``disconnected``)."""
    until = _acknowledged_at(section)
    restarted = any(r["t"] <= until and r.get("t_end", r["t"]) >= section.start for r in restarts)
    failed = section.release == "error"
    return not (section.killed or section.token in cut or restarted or failed)


def _excused(report: Report, excuse: dict[str, Any], section: Section) -> None:
    """Count a record of ``section`` that ``excuse`` lost, and how long before a crash the
    store had acknowledged it."""
    report.excused_records += 1
    if excuse["kind"] == "immediate" and _acknowledged(section):
        loss = excuse["t"] - _acknowledged_at(section)
        report.crash_loss = max(report.crash_loss, loss)


def check(directory: Path, store: str, backend: LockBackend, ledger: Ledger) -> Report:
    """Check every invariant over the run in ``directory``."""
    report = Report(store)
    events = load_events(directory)
    keyed = _by_key(load_sections(directory, events, report))
    check_ledger(keyed, ledger, report)
    check_sections(keyed, events, report)
    check_history(keyed, backend, events, report)
    return report


COLUMNS = (
    ("store", "store"),
    ("acquisitions", "acquisitions"),
    ("kills", "kills"),
    ("in section", "killed_in_section"),
    ("pauses", "pauses"),
    ("restarts", "restarts"),
    ("partitions", "partitions"),
    ("disk fulls", "diskfulls"),
    ("freed after s", "freed_after"),
    ("overlaps", "overlaps"),
    ("fenced overlaps", "fenced_overlaps"),
    ("refused stale writes", "refused"),
    ("lost records", "lost_records"),
    ("violations", "violations"),
    ("duration s", "duration"),
)


def table(reports: list[Report]) -> str:
    """The results as a Markdown table."""
    rows = [[title for title, _ in COLUMNS]]
    for report in reports:
        cells = []
        for _, name in COLUMNS:
            value = getattr(report, name)
            if isinstance(value, list):
                cells.append(", ".join(f"{item:.1f}" for item in value) or "-")
            else:
                cells.append(f"{value:.1f}" if isinstance(value, float) else str(value))
        rows.append(cells)
    widths = [max(len(row[n]) for row in rows) for n in range(len(COLUMNS))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
