"""The torture checker's overlap rule and its rule for a lease's records
(``bench/torture/check.py``), on sections made by hand: which it excuses and which it
reports; and the run's check that the file store's disk did not stay full."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from bench.torture import worker
from bench.torture.check import (
    Report,
    Section,
    check_history,
    check_sections,
    load_sections,
    wrong_record,
)
from bench.torture.ledger import open_ledger
from bench.torture.run import check_disk, check_faults, settle
from bench.torture.servers import FileStore, disk_mib
from celery_dlock import Holder, Lease, Lock, Outcome, backend_from_url
from tests.backends.conftest import STORES
from tests.support import unavailable

KEY = "torture:k:0"


def paused_then_killed() -> tuple[Section, list[dict[str, Any]]]:
    """A holder paused in its section past its ttl (fence 10), killed just as it woke up,
    before its write: its section runs from its grant to the kill."""
    earlier = Section(KEY, "a", 10, start=100.0, log="w01.0001.jsonl", end=104.01)
    earlier.killed = True
    pause = {"e": "pause", "log": "w01.0001.jsonl", "t": 100.0001, "in_section": True}
    return earlier, [pause]


def overlap(earlier: Section, events: list[dict[str, Any]], later: Section) -> Report:
    report = Report("file")
    check_sections({KEY: [earlier, later]}, events, report)
    return report


def later_holder(fence: int = 11) -> Section:
    """The next holder, granted once the paused one's lease expired; it read and wrote."""
    later = Section(KEY, "b", fence, start=103.0, log="w02.0001.jsonl", end=103.001)
    later.ended, later.read, later.accepted, later.release, later.landed = (
        True, 7, True, "ok", True,
    )  # fmt: skip
    return later


def test_a_holder_killed_before_its_write_after_losing_its_lease_to_a_pause_is_excused() -> None:
    earlier, events = paused_then_killed()
    report = overlap(earlier, events, later_holder())
    assert (report.violations, report.overlaps, report.serialized_overlaps) == (0, 0, 1)


@pytest.mark.parametrize("case", ["no fault", "lower fence", "its write landed unread"])
def test_other_overlaps_with_a_killed_holder_are_reported(case: str) -> None:
    earlier, events = paused_then_killed()
    later = later_holder()
    if case == "no fault":  # nothing took its lease: two holders at once
        events = []
    elif case == "lower fence":
        later = later_holder(fence=9)
    else:  # it wrote before it died, and the later one read an older counter
        earlier.landed, earlier.read = True, 7
    report = overlap(earlier, events, later)
    assert report.violations >= 1 and report.overlaps == 1, report.problems


@pytest.mark.parametrize(("release", "violations"), [("lost", 0), ("error", 0), ("ok", 1)])
def test_a_fenced_overlap_is_excused_unless_the_earlier_lease_outlived_it(
    release: str, violations: int
) -> None:
    """The later holder's higher fence refused the earlier one's write: a lease that
    expired or was lost. But if the earlier one's release then found its lease still there
    (``ok``), the store held both at once: a double grant, whatever the fence stopped."""
    earlier = Section(KEY, "a", 10, start=100.0, log="w01.0001.jsonl", end=100.5)
    earlier.ended, earlier.read, earlier.accepted, earlier.release = True, 7, False, release
    later = Section(KEY, "b", 11, start=100.2, log="w02.0001.jsonl", end=100.201)
    later.ended, later.read, later.accepted, later.release, later.landed = (
        True, 7, True, "ok", True,
    )  # fmt: skip
    report = overlap(earlier, [], later)
    assert (report.violations, report.fenced_overlaps) == (violations, 1 - violations)
    assert report.overlaps == violations, report.problems


@pytest.mark.parametrize(
    ("release", "found", "right"),
    [
        ("ok", ["succeeded"], True),
        ("ok", ["expired", "succeeded"], False),  # one token, two leases (a Redis retry)
        ("lost", ["lost"], True),
        ("lost", ["expired", "lost"], True),  # the finder's record and the holder's
        ("lost", ["expired"], False),
        ("lost", ["lost", "succeeded"], False),  # a release that landed, reported lost
    ],
)
def test_a_lease_s_records_must_match_how_its_release_ended(
    release: str, found: list[str], right: bool
) -> None:
    section = Section(KEY, "a", 10, start=100.0, log="w01.0001.jsonl", end=100.001)
    section.ended, section.release = True, release
    assert (wrong_record(section, found) is None) is right


@pytest.mark.parametrize(
    ("kind", "killed", "excused"),
    [
        ("immediate", True, True),
        ("wiped", True, True),
        ("fast", True, False),  # a clean shutdown loses no lease
        ("immediate", False, False),  # its release ran after the crash: it recorded it
    ],
)
def test_a_lease_a_crash_took_from_a_holder_killed_after_it_may_have_no_record(
    kind: str, killed: bool, excused: bool
) -> None:
    """A long section (renewed) granted before a Postgres ``-m immediate``, its holder
    killed after the restart and before its release: the lease died with the UNLOGGED
    locks table, and only that release would have recorded it ``lost`` (a 90 s run with
    ttl 1 and sections up to 2.5 s, 2026-11-26). Not so after a clean restart, nor for a
    holder whose release said how it ended."""
    section = Section(KEY, "a", 557, start=100.0, log="w04.0005.jsonl", end=101.9)
    if killed:
        section.killed = True
    else:
        section.ended, section.accepted, section.release = True, False, "lost"
    restart = {"e": "restart", "kind": kind, "t": 100.9, "t_end": 101.2}
    report = Report("postgres")
    backend = backend_from_url(f"memory://torture-check-{kind}-{killed}")
    try:
        check_history({KEY: [section]}, backend, [restart], report)
    finally:
        backend.close()
    assert (report.excused_records, report.lost_records) == (int(excused), int(not excused))
    assert report.violations == int(not excused), report.problems


def _cut_off_release(tmp_path: Path, released: float | None) -> tuple[Section, Any]:
    """A holder cut off in its section (Postgres, fence 779) until 598.0: the server ended
    its session and recorded the lease ``disconnected``; its release, once the network
    healed, found the lease gone and wrote its own ``lost`` record, which is not in the
    history. The section as its worker logged it (the release's time, when given), and the
    store."""
    backend = backend_from_url(f"memory://torture-check-cut-off-{released}")
    lease = backend.try_acquire(KEY, Holder.current(), None)
    assert lease is not None
    backend.release(lease, Outcome.DISCONNECTED, "disconnected", "its session ended")
    log_lines = [
        {"e": "begin", "key": KEY, "token": lease.token, "fence": 779, "t": 577.5},
        {"e": "end", "token": lease.token, "read": 17, "accepted": False, "t": 598.0},
        {"e": "rel", "token": lease.token, "release": "lost"}
        | ({} if released is None else {"t": released}),
    ]
    log = tmp_path / "w16.0017.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in log_lines))
    [section] = load_sections(tmp_path, [], Report("postgres"))
    return section, backend


@pytest.mark.parametrize(
    ("released", "kind", "excused"),
    [
        (609.6, "immediate", True),  # acknowledged 0.4 s before the crash began
        (None, "immediate", False),  # a log without the release's time: its end, 12 s before
        (605.5, "immediate", False),  # acknowledged 4.5 s before: committed by then
        (610.5, "immediate", False),  # after the restart: written to the new server
        (609.6, "fast", False),  # a clean shutdown loses nothing acknowledged
    ],
)
def test_a_lost_record_a_crash_took_just_after_a_cut_off_release_is_excused(
    tmp_path: Path, released: float | None, kind: str, excused: bool
) -> None:
    # Before: reported "released lost, recorded ['disconnected']" (a run with --together 3,
    # --partitions 2, --restarts 3: the chaos thread healed the network and restarted
    # Postgres -m immediate in the same moment, and the lost records the healed releases
    # wrote were lost with asynchronous commit; the section's end was 1.03 s before the
    # crash there). Here the release waited 11.6 s for the healed network: measured from
    # the section's end, as it was, the crash window would not cover it.
    section, backend = _cut_off_release(tmp_path, released)
    assert section.release == "lost" and section.released == released
    restart = {"e": "restart", "kind": kind, "t": 610.0, "t_end": 610.2}
    partition = {"e": "partition", "token": section.token, "t": 580.0}
    report = Report("postgres")
    try:
        check_history({KEY: [section]}, backend, [partition, restart], report)
    finally:
        backend.close()
    assert (report.excused_records, report.violations) == (int(excused), int(not excused))
    if not excused:
        assert report.problems == [f"{KEY}: fence 779 released lost, recorded ['disconnected']"]


def test_a_file_store_disk_left_full_by_its_history_fails_the_run() -> None:
    """A 300 s run's history (about 450 bytes an acquisition) filled a fixed 8 MiB tmpfs a
    minute in, and every acquire failed from then on: the tmpfs is sized by the run, and a
    disk still full at the end, the filler gone, fails the run."""
    if os.geteuid() != 0:
        unavailable("mounting the file store's tmpfs needs root")
    assert disk_mib(300) >= 8 + 300
    store = FileStore(full_disk=True, size_mib=1)
    backend = backend_from_url(store.url())
    try:
        with Lock(backend, "torture:k:disk", ttl=3):
            pass
        store.fill(0.01)  # a disk full that passed
        report = Report("file")
        check_disk(store, report)
        assert report.violations == 0, report.problems
        grown = os.open(store.directory / "locks" / "history" / "grown", os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError, match="No space left"):
                while True:  # the history grown to the last page
                    os.write(grown, bytes(4096))
        finally:
            os.close(grown)
        check_disk(store, report)
        assert report.violations == 1
        assert str(store.directory) in report.problems[0], report.problems
    finally:
        backend.close()
        store.stop()


def test_a_run_without_a_single_acquisition_fails(tmp_path: Path) -> None:
    # Before: a run whose workers all started after its stop (a loaded machine) passed
    # with "0 violations", having tested nothing.
    (tmp_path / "w01.0001.jsonl").write_text('{"e":"start","t":1.0}\n')
    report = Report("file")
    assert load_sections(tmp_path, [], report) == []
    assert report.violations == 1
    assert "no acquisition" in report.problems[0]


def test_the_begin_lines_of_a_set_are_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: one write per lease, and a SIGSTOP between them made the later leases of a
    # set look granted after the fences others took during the pause (a false violation).
    log_path = tmp_path / "w01.0001.jsonl"
    job = worker.Job(
        "memory://", f"file://{tmp_path}/ledger", [], None, 0.0, 0.0, str(log_path), "stop"
    )
    leases = [Lease(f"{KEY}{n}", f"t{n}", 10 + n, Holder.current(), 1.0) for n in range(3)]
    writes: list[bytes] = []
    real_write = os.write

    def counted(fd: int, data: bytes) -> int:
        writes.append(data)
        return real_write(fd, data)

    monkeypatch.setattr(worker.os, "write", counted)
    ledger = open_ledger(job.ledger)
    ledger.create([lease.key for lease in leases])
    worker.write(job, ledger, leases, worker.Log(str(log_path)))
    monkeypatch.undo()
    begins = [data for data in writes if b'"e":"begin"' in data]
    assert len(begins) == 1 and begins[0].count(b'"e":"begin"') == 3
    report = Report("file")
    sections = load_sections(tmp_path, [], report)
    assert sorted(section.fence for section in sections) == [10, 11, 12]


def test_a_worker_killed_at_the_stop_is_no_fault_asked_for(tmp_path: Path) -> None:
    # Before: counted among the kills, so a run asked for 4 reported 5 when a worker was
    # still starting at the stop (the short run's test asserts the count).
    (tmp_path / "w01.0001.jsonl").write_text(
        '{"e":"begin","key":"k","token":"a","fence":1,"t":1.0}\n'
    )
    (tmp_path / "w02.0001.jsonl").write_text(
        '{"e":"begin","key":"k","token":"b","fence":2,"t":3.0}\n'
    )
    events = [
        {"e": "kill", "log": "w01.0001.jsonl", "t": 2.0, "in_section": True},
        {"e": "kill", "log": "w02.0001.jsonl", "t": 4.0, "in_section": True, "at_stop": True},
    ]
    report = Report("file")
    sections = load_sections(tmp_path, events, report)
    assert report.kills == 1
    assert sorted((s.fence, s.killed, s.end) for s in sections) == [(1, True, 2.0), (2, True, 4.0)]


def test_a_run_that_did_fewer_faults_than_planned_fails() -> None:
    # Before: kills the run ended before were left out silently, and a run asked for 4
    # that did 2 reported "0 violations" as if it had survived 4.
    plan = [(0.5, "kill"), (1.0, "pause"), (1.5, "kill"), (2.0, "kill"), (2.5, "kill")]
    report = Report("file")
    check_faults(plan, {"kill": 2, "pause": 1}, ["kill: RuntimeError('no worker')"], report)
    assert report.violations == 2
    assert report.problems == [
        "chaos: kill: RuntimeError('no worker')",
        "chaos: 2 of 4 kills done, 1 failed: the run ended before the rest (a longer "
        "--seconds, or fewer faults)",
    ]
    every = Report("file")
    check_faults(plan, {"kill": 4, "pause": 1}, [], every)
    assert (every.violations, every.problems) == (0, [])


class _ListedLate:
    """A store whose ``leases`` is called only once ``expiry`` (wall clock) has passed: a
    lease's time running out between ``settle``'s reap and its listing, made certain."""

    def __init__(self, backend: Any, expiry: float) -> None:
        self.backend, self.expiry = backend, expiry

    def reap(self, limit: int) -> list[Any]:
        return list(self.backend.reap(limit=limit))

    def leases(self, prefix: str) -> list[Lease]:
        time.sleep(max(0.0, self.expiry - time.time()) + 0.1)
        return list(self.backend.leases(prefix))


def test_settle_records_a_lease_whose_time_ran_out_after_its_reap(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Before: settle reaped (the lease alive), listed nothing (Redis had dropped the expired
    # lock in between) and stopped: the lease was never recorded, and the checker reported
    # its killed holder's record missing (a CI run of the --limit torture test on Redis).
    with STORES["redis"].open_store(tmp_path, request) as case:
        lease = case.backend.try_acquire("torture:k:0#0", Holder.current(), 0.5)
        assert lease is not None and lease.expires_at is not None
        assert settle(_ListedLate(case.backend, lease.expires_at), "torture:", 10.0) == 0
        [record] = case.backend.history(key=lease.key, limit=None)
        assert (record.lease.token, str(record.outcome)) == (lease.token, "expired")


@pytest.mark.parametrize(
    "fault",
    ["none", "killed", "cut off", "set cut off", "other cut off", "restart", "release failed"],
)
def test_a_lease_recorded_disconnected_while_its_holder_lived_is_reported(
    tmp_path: Path, fault: str
) -> None:
    """A holder that released its lease ok, or found it gone (``lost``), while the store
    had recorded it ``disconnected``: its session ended under it, which only a kill, a
    partition or a store restart in its section explains (the Postgres take-over of a lease
    being handed over, 2026-11-29, did so without any), or a release that failed (the lease
    stays held until its holder dies or releases again)."""
    section, backend = _cut_off_release(tmp_path, 599.0)
    events: list[dict[str, Any]] = []
    if fault == "killed":
        section.killed = True
    elif fault == "cut off":
        events.append({"e": "partition", "token": section.token, "t": 580.0})
    elif fault in ("set cut off", "other cut off"):  # the event names another lease:
        # of its own set (--together), or of another worker
        log = section.log if fault == "set cut off" else "w03.0003.jsonl"
        events.append({"e": "partition", "token": "x", "log": log, "t": 580.0, "t_heal": 598.5})
    elif fault == "restart":
        events.append({"e": "restart", "kind": "fast", "t": 590.0, "t_end": 591.0})
    elif fault == "release failed":  # the lease left held; its holder killed after it
        section.release = "error"
    report = Report("postgres")
    try:
        check_history({KEY: [section]}, backend, events, report)
    finally:
        backend.close()
    alive = f"{KEY}: fence 779 recorded disconnected while its holder lived, its store up"
    reported = any(problem.startswith(alive) for problem in report.problems)
    assert reported == (fault in ("none", "other cut off"))
