"""The torture checker's overlap rule and its rule for a lease's records
(``bench/torture/check.py``), on sections made by hand: which it excuses and which it
reports."""

from __future__ import annotations

from typing import Any

import pytest

from bench.torture.check import Report, Section, check_sections, wrong_record

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
