"""The CLI's text helpers: durations, ``--since`` and the password mask (in process)."""

from __future__ import annotations

import time

import click
import pytest

from celery_dlock.cli.env import Env, Target
from celery_dlock.cli.render import SINCE, human_duration, parse_duration, table


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.23, "230ms"),
        (3.9, "3s"),
        (252, "4m12s"),
        (2 * 3600 + 5 * 60 + 9, "2h05m"),
        (3 * 86400 + 4 * 3600, "3d04h"),
        (-2, "0ms"),
    ],
)
def test_human_duration(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("90s", 90.0),
        ("10m", 600.0),
        ("1h30m", 5400.0),
        ("2d", 172800.0),
        ("250ms", 0.25),
        ("1.5h", 5400.0),
        ("-5", None),
        ("inf", None),
        ("10 minutes", None),
    ],
)
def test_parse_duration(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


def test_since_takes_a_duration_back_or_an_iso_time() -> None:
    assert abs(SINCE.convert("1h", None, None) - (time.time() - 3600)) < 60
    assert SINCE.convert("2024-05-01T10:00:00Z", None, None) == 1714557600.0
    assert SINCE.convert("2024-05-01T12:00:00+02:00", None, None) == 1714557600.0
    with pytest.raises(click.BadParameter):
        SINCE.convert("last week", None, None)


def test_table_aligns_columns_without_trailing_spaces() -> None:
    assert table(("key", "fence"), [["job:a", "1"], ["job:long", "12"]]).splitlines() == [
        "KEY       FENCE",
        "job:a     1",
        "job:long  12",
    ]


@pytest.mark.parametrize(
    ("url", "forms"),
    [
        ("redis://:s3cret@cache:6379/1", ["s3cret"]),
        ("postgresql://app:s3cret@db/app?schema=x", ["s3cret"]),
        ("redis://:s3%40cret@cache:6379/1", ["s3%40cret", "s3@cret"]),
        ("redis://:s3cret@[::1:6379/1", ["s3cret"]),  # unparsable: found all the same
        ("postgresql://app@db/app?password=s3%40cret", ["s3%40cret", "s3@cret"]),
    ],
)
def test_scrub_masks_the_password_in_any_text(url: str, forms: list[str]) -> None:
    env = Env(lambda: Target(url=url, source="--backend", namespace="job"))
    assert "***" in env.url or env.url == "<unparsable URL>"
    quoted = f"failed: {url!r}; auth with {' / '.join(forms)} refused; {url}"
    scrubbed = env.scrub(quoted)
    assert all(form not in scrubbed for form in forms), scrubbed


def test_a_wide_key_is_shown_whole_and_pads_no_other_row() -> None:
    wide = "job:" + "x" * 120
    lines = table(("key", "fence"), [["job:a", "1"], [wide, "12"]]).splitlines()
    assert lines == ["KEY    FENCE", "job:a  1", f"{wide}  12"]
    assert lines[2].split() == [wide, "12"]  # still two spaces between cells: copy-paste whole


def test_a_column_of_mostly_wide_cells_widens_so_the_next_column_stays_aligned() -> None:
    task = "shop.sync[0c35e1b2-8f4e-4d55-9a51-2d1c7e0f3a61] on celery@vm (pid 22900 on vm)"
    rows = [[task, "1s"], [task.replace("sync", "sync2"), "2s"], ["pid 7 on vm", "3s"]]
    header, *lines = table(("holder", "age"), rows).splitlines()
    assert header.index("AGE") == len(task) + 3  # the widest holder, and two spaces
    assert [line.index(f"{n}s") for n, line in enumerate(lines, 1)] == [len(task) + 3] * 3
