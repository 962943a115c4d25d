"""How the CLI writes and reads times: durations (``4m12s``), local timestamps, aligned
tables, the JSON form of leases and records, and the ``--since``/duration parameters."""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import click

from celery_dlock.keys import is_mark
from celery_dlock.records import Lease, Outcome, Record

__all__ = [
    "DURATION",
    "LONGEST",
    "MOST",
    "PROBLEM_OUTCOMES",
    "SINCE",
    "display_width",
    "expires_text",
    "for_queued_message",
    "gone_because",
    "holder_gone",
    "holder_text",
    "human_duration",
    "lease_json",
    "lease_lines",
    "local_time",
    "record_json",
    "table",
    "with_metadata",
]

if TYPE_CHECKING:
    _FloatParam = click.ParamType[float]
else:  # click < 8.2 has no generic ParamType at run time
    _FloatParam = click.ParamType

#: Outcomes worth an operator's look (``history --problems``, the page's filter).
PROBLEM_OUTCOMES = (
    Outcome.FAILED,
    Outcome.REVOKED,
    Outcome.DISCONNECTED,
    Outcome.EXPIRED,
    Outcome.FORCED,
    Outcome.LOST,
    Outcome.ABANDONED,  # a Lock dropped while held, or a process that ended holding it
    Outcome.FORGOTTEN,  # an operator undid what once keeps: the next run runs its body
)

#: The longest duration an option takes (100 years): past it, stores and clocks overflow.
LONGEST = 100 * 365.25 * 86400
#: The most records or leases a ``--limit`` asks for.
MOST = 1_000_000
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d|w))+")


def human_duration(seconds: float) -> str:
    """``230ms``, ``3s``, ``4m12s``, ``2h05m``, ``3d04h``: short, and exact enough to act on."""
    if not math.isfinite(seconds) or seconds < 0:
        seconds = 0.0
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def local_time(timestamp: float) -> str:
    """``2024-05-01 12:00:03``: seconds since the epoch as local time, to the second."""
    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def iso_time(timestamp: float) -> str:
    """The ISO 8601 form with the local offset, for JSON: ``2024-05-01T12:00:03.250+02:00``."""
    return (
        datetime.fromtimestamp(timestamp, timezone.utc).astimezone().isoformat("T", "milliseconds")
    )


def parse_duration(text: str) -> float | None:
    """Seconds in ``90``, ``90s``, ``10m``, ``1h30m``, ``2d``, ``250ms``; None if not one."""
    text = text.strip().lower()
    if _NUMBER.fullmatch(text):
        return float(text)
    if not _DURATION.fullmatch(text):
        return None
    return sum(float(number) * _UNITS[unit] for number, unit in _PART.findall(text))


class DurationType(_FloatParam):
    """A duration on the command line: ``90``, ``10m``, ``1h30m``, ``2d``."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            return value
        seconds = parse_duration(str(value))
        if seconds is None:
            self.fail(f"{value!r} is not a duration such as 90s, 10m, 1h30m or 2d", param, ctx)
        if seconds > LONGEST:
            self.fail(f"{value!r} is longer than 100 years", param, ctx)
        return seconds


class SinceType(_FloatParam):
    """A point in time: a duration back from now (``10m``) or an ISO time (``2024-05-01``,
    ``2024-05-01T12:00``, local unless it carries an offset or ``Z``); seconds since the
    epoch after conversion."""

    name = "duration|iso-time"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            return value
        text = str(value).strip()
        seconds = parse_duration(text)
        if seconds is not None:
            moment = datetime.now(timezone.utc).timestamp() - seconds
        else:
            try:
                iso = text[:-1] + "+00:00" if text.endswith("Z") else text
                moment = datetime.fromisoformat(iso).timestamp()  # naive: local time
            except (ValueError, OverflowError, OSError):
                self.fail(
                    f"{value!r} is neither a duration (10m, 2h, 1d) nor an ISO time "
                    "(2024-05-01T12:00, 2024-05-01T10:00Z)",
                    param,
                    ctx,
                )
        if moment < 0:
            self.fail(f"{value!r} is before 1970", param, ctx)
        return moment


DURATION = DurationType()
SINCE = SinceType()


#: A cell wider than this widens its column only where most of the column's cells are as
#: wide (a Celery task's holder, ``name[uuid] on celery@host (pid N on host)``); else it runs
#: over into the rest of its own row (still two spaces before the next cell), so that one
#: long key pads no other row.
WIDE_CELL = 48


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain columns aligned with two spaces, a header line in capitals, no colour; a cell
    past :data:`WIDE_CELL` columns is shown whole, shifting only its own row unless most
    cells of its column are that wide too (then the column is as wide as its widest).
    Widths are a terminal's columns (:func:`display_width`), not characters."""
    by_column = list(zip(*rows, strict=True)) if rows else [() for _ in headers]
    widths = [_width(header, cells) for header, cells in zip(headers, by_column, strict=True)]
    lines = [[header.upper() for header in headers], *rows]
    return "\n".join(
        "  ".join(_pad(cell, width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def display_width(text: str) -> int:
    """The columns a terminal gives ``text``: two for a wide character (CJK, most emoji),
    none for a combining one (an accent of a decomposed ``é``), one for the rest."""
    if text.isascii():
        return len(text)
    return sum(
        0 if unicodedata.combining(char) else 2 if unicodedata.east_asian_width(char) in "WF" else 1
        for char in text
    )


def _pad(cell: str, width: int) -> str:
    return cell + " " * (width - display_width(cell))


def _width(header: str, cells: Sequence[str]) -> int:
    """A column's width: its widest cell within :data:`WIDE_CELL`, or its widest of all
    when most of its cells are wider."""
    sizes = [display_width(cell) for cell in cells]
    wide = [size for size in sizes if size > WIDE_CELL]
    if 2 * len(wide) > len(cells):
        return max(len(header), *wide)
    return max([len(header)] + [size for size in sizes if size <= WIDE_CELL])


def expires_text(lease: Lease, now: float) -> str:
    """``in 12s``, ``never``, or ``EXPIRED`` (by ``now``, the store's clock where it has one)."""
    if lease.expires_at is None:
        return "never"
    if lease.expires_at <= now:
        return "EXPIRED"
    return f"in {human_duration(lease.expires_at - now)}"


def lease_lines(lease: Lease, now: float) -> str:
    """``lease`` as indented ``name value`` lines, for a person about to act on it."""
    rows = [
        ["key", lease.key],
        ["holder", holder_text(lease)],
        ["fence", str(lease.fence)],
        [
            "acquired",
            f"{local_time(lease.acquired_at)} ({human_duration(now - lease.acquired_at)} ago)",
        ],
        ["expires", expires_text(lease, now)],
    ]
    return "\n".join(f"  {name:<9}{value}" for name, value in rows)


def for_queued_message(lease: Lease) -> bool:
    """True for a dedupe mark: once its message is on the broker it is held for that message
    and lives by its ttl alone (``LockBackend.hand_over``); its holder names the producer
    that sent it, whose end says nothing about the mark."""
    return is_mark(lease.key, lease.holder.task_name)


def holder_gone(lease: Lease) -> bool:
    """True when ``lease`` is held for its holder's process and that holder provably no
    longer exists (``Holder.is_gone``: a process of this host that ended, or a holder the
    store found gone, such as a Postgres one whose lock session ended); never for a mark
    held for a queued message."""
    return not for_queued_message(lease) and lease.holder.is_gone()


def gone_because(lease: Lease) -> str | None:
    """Why ``lease``'s holder is gone (:func:`holder_gone`), or None while it may live:
    ``Holder.gone_because``, what the store found (Postgres: ``lock session ended``, for a
    holder of any host) or ``process ended`` (a process of this host)."""
    return None if for_queued_message(lease) else lease.holder.gone_because()


def holder_text(lease: Lease) -> str:
    """The holder's description, marked ``[gone] (process ended)`` when it is provably dead
    (a process of this host that no longer exists; ``[gone] (lock session ended)`` where the
    store found its session ended), or ``[queued message]`` for a dedupe mark, which lives
    by its ttl for its message whatever became of the producer named."""
    text = lease.holder.describe()
    if for_queued_message(lease):
        return f"{text} [queued message]"
    because = lease.holder.gone_because()
    return text if because is None else f"{text} [gone] ({because})"


#: Characters of a lease's metadata shown in a table cell (``--json`` has all of it).
METADATA_CELL = 60


def with_metadata(
    headers: Sequence[str], rows: list[list[str]], leases: Sequence[Lease]
) -> tuple[Sequence[str], list[list[str]]]:
    """``headers`` and ``rows`` with a ``metadata`` column if any of ``leases`` has some."""
    if all(lease.metadata is None for lease in leases):
        return headers, rows
    cells = [
        "-" if lease.metadata is None else _clip(json.dumps(lease.metadata, sort_keys=True))
        for lease in leases
    ]
    return (*headers, "metadata"), [[*row, cell] for row, cell in zip(rows, cells, strict=True)]


def _clip(text: str) -> str:
    return text if len(text) <= METADATA_CELL else text[: METADATA_CELL - 1] + "…"


def lease_json(lease: Lease, now: float) -> dict[str, Any]:
    """``Lease.to_dict()`` plus ``holder_text``, ``holder_gone``, ``holder_gone_because``
    (:func:`gone_because`), ``queued_message`` (a dedupe mark, alive by its ttl for its
    message: never ``holder_gone``), ``acquired``, ``age``, ``expires_in`` (seconds, None
    for no expiry), ``expired`` and ``metadata``."""
    data = lease.to_dict()
    because = gone_because(lease)
    data.update(
        metadata=lease.metadata,
        holder_text=lease.holder.describe(),
        holder_gone=because is not None,
        holder_gone_because=because,
        queued_message=for_queued_message(lease),
        acquired=iso_time(lease.acquired_at),
        age=max(now - lease.acquired_at, 0.0),
        expires_in=None if lease.expires_at is None else lease.expires_at - now,
        expired=lease.expires_at is not None and lease.expires_at <= now,
    )
    return data


def record_json(record: Record) -> dict[str, Any]:
    """``Record.to_dict()`` plus ``key``, ``fence``, ``holder_text``, ``released`` (ISO,
    local offset), ``duration`` (seconds held) and ``metadata``."""
    data = record.to_dict()
    data.update(
        metadata=record.lease.metadata,
        key=record.key,
        fence=record.fence,
        holder_text=record.lease.holder.describe(),
        released=iso_time(record.released_at),
        duration=max(record.released_at - record.lease.acquired_at, 0.0),
    )
    return data
