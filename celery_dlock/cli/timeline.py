"""``timeline``: a picture of who held which key when, as an SVG (or an HTML page holding
it), for a ticket or a postmortem::

    celery-dlock --backend URL timeline --key job:order: --since 1h -o timeline.svg

One row per key, one bar per lease from its acquisition to its release, coloured by outcome;
a lease still held runs to now, hatched. Each bar's tooltip (``<title>``) names the outcome,
fence, holder, times and problem; its ``data-*`` attributes carry the same for scripts.

The window: ``--since`` as typed; without one, the last hour, its start moved up to just
before the oldest lease in it (a minute of activity fills the picture instead of a sliver
at its right edge). It ends now. The caption says which window is shown and why.

Size: the ``.svg`` file is :data:`VIEW_WIDTH` px wide with a ``viewBox``; on a page (``serve``
or ``-o FILE.html``) the picture takes its container's width, but no less than
:data:`MIN_WIDTH` px (text stays 9 px or larger): a narrower container scrolls the picture
sideways in its own box, never the page.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax import saxutils

import click
from click.core import ParameterSource

from celery_dlock.backends.base import LockBackend
from celery_dlock.cli.env import Env, UsageFailure, guarded
from celery_dlock.cli.render import (
    MOST,
    SINCE,
    human_duration,
    lease_json,
    local_time,
    record_json,
)
from celery_dlock.records import Lease, Outcome, Record

__all__ = ["COLOURS", "MIN_WIDTH", "VIEW_WIDTH", "Bar", "Window", "render_svg", "timeline"]

#: Bar colours by outcome; ``held`` is a lease not released yet.
COLOURS = {
    Outcome.SUCCEEDED.value: "#2e7d32",
    Outcome.FAILED.value: "#c62828",
    Outcome.SKIPPED.value: "#9e9e9e",
    Outcome.RETRIED.value: "#1565c0",
    Outcome.REVOKED.value: "#ef6c00",
    Outcome.DISCONNECTED.value: "#6a1b9a",
    Outcome.EXPIRED.value: "#795548",
    Outcome.FORCED.value: "#ad1457",
    Outcome.LOST.value: "#212121",
    Outcome.DEQUEUED.value: "#00838f",
    Outcome.ABANDONED.value: "#f9a825",
    Outcome.FORGOTTEN.value: "#455a64",
    "held": "#64b5f6",
}
#: The picture's width in its own units (``viewBox``): a ``.svg`` file opens this wide.
VIEW_WIDTH = 1000
#: The narrowest a picture on a page gets, in CSS px: its 13-unit text is 9 px there.
MIN_WIDTH = 700
_FONT = 13
_LABEL = 240  # key labels; the time axis runs from here to VIEW_WIDTH - _RIGHT
_RIGHT = 32  # half a tick's label: the last one is not cut off
_WIDTH = VIEW_WIDTH - _LABEL - _RIGHT
_ROW = 20
_TOP = 58
#: A fitted window is at least this long, and starts this share of it before the oldest lease.
_SHORTEST = 5.0
_MARGIN = 0.05

#: What XML 1.0 forbids in text: C0 controls but tab, newline and return; lone surrogates;
#: U+FFFE and U+FFFF. One of them in a holder or a problem would make the picture no XML.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _shown(text: str) -> str:
    """``text`` with what XML forbids written as its escape (``\\x1b``)."""
    return _NOT_XML.sub(lambda found: ascii(found.group())[1:-1], text)


def _escape(text: str) -> str:
    """``text`` as XML character data."""
    return saxutils.escape(_shown(text))


def _quoteattr(text: str) -> str:
    """``text`` as a quoted XML attribute value."""
    return saxutils.quoteattr(_shown(text))


@dataclass(frozen=True)
class Bar:
    """One lease on the picture: from ``start`` to ``end`` (store clock seconds)."""

    lease: Lease
    start: float
    end: float
    outcome: str  # an Outcome's value, or "held"
    problem: str | None = None

    @classmethod
    def of(cls, record: Record) -> Bar:
        start = record.lease.acquired_at
        outcome = record.outcome.value
        return cls(record.lease, start, record.released_at, outcome, record.problem)

    def title(self) -> str:
        held = human_duration(max(self.end - self.start, 0.0))
        until = "still held" if self.outcome == "held" else f"until {local_time(self.end)}"
        lines = [
            f"{self.lease.key}: {self.outcome}" + (f" ({self.problem})" if self.problem else ""),
            f"fence {self.lease.fence}, held {held}, from {local_time(self.start)} {until}",
            f"holder {self.lease.holder.describe()}",
        ]
        return "\n".join(lines)


@dataclass(frozen=True)
class Window:
    """The stretch of time a picture shows, ``start`` to ``end`` (store clock seconds).

    ``asked`` is where the records were read from (``--since``); ``fitted`` says ``start``
    was moved up from it to just before the oldest lease."""

    start: float
    end: float
    asked: float
    fitted: bool = False

    @classmethod
    def fit(cls, since: float, until: float, bars: Sequence[Bar]) -> Window:
        """``since`` to ``until``, its start moved up to just before the oldest bar when that
        is later: by 5 % of the window (at least 0.5 s), the window at least 5 s long."""
        oldest = min((bar.start for bar in bars), default=since)
        if oldest <= since:
            return cls(since, until, since)
        start = oldest - max((until - oldest) * _MARGIN, 0.5)
        start = max(since, min(start, until - _SHORTEST))
        return cls(start, until, since, start > since)

    def caption(self, bars: Sequence[Bar]) -> str:
        keys = len({bar.lease.key for bar in bars})
        return (
            f"celery-dlock leases from {local_time(self.start)} to {local_time(self.end)} "
            f"({human_duration(self.end - self.start)}): {len(bars)} leases on {keys} keys"
        )

    def note(self) -> str:
        """Why the window starts where it does, if not where it was asked to ("" then)."""
        if not self.fitted:
            return ""
        return (
            f"fitted to the leases since {local_time(self.asked)}: it starts just before the "
            "oldest (a since you give is kept as given)"
        )


def render_svg(bars: Sequence[Bar], window: Window, *, fluid: bool = False) -> str:
    """The picture of ``bars`` in ``window`` as an SVG document: ``VIEW_WIDTH`` px wide, or,
    ``fluid`` (inside a page), as wide as its container and at least ``MIN_WIDTH`` px."""
    since, until = window.start, window.end
    keys = sorted({bar.lease.key for bar in bars})
    rows = {key: n for n, key in enumerate(keys)}
    span = max(until - since, 1e-6)
    height = _TOP + _ROW * max(len(keys), 1) + 40

    def x(at: float) -> float:
        return _LABEL + _WIDTH * (min(max(at, since), until) - since) / span

    size = (
        f'width="100%" style="display: block; min-width: {MIN_WIDTH}px; height: auto"'
        if fluid
        else f'width="{VIEW_WIDTH}" height="{height}"'
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {VIEW_WIDTH} {height}" {size} '
        f'font-family="sans-serif" font-size="{_FONT}" data-start="{since:.6f}" '
        f'data-end="{until:.6f}" data-axis="{_LABEL} {_LABEL + _WIDTH}">',
        '<defs><pattern id="held" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="3" height="6" fill="{COLOURS["held"]}"/>'
        "</pattern></defs>",
        f'<text x="4" y="17" font-weight="bold">{_escape(window.caption(bars))}</text>',
    ]
    if window.note():
        parts.append(
            f'<text class="window" x="4" y="35" fill="#555">{_escape(window.note())}</text>'
        )
    parts += _axis(since, until, x, height)
    for key, n in rows.items():
        y = _TOP + _ROW * n
        parts.append(
            f'<text class="key" x="{_LABEL - 6}" y="{y + 15}" text-anchor="end">'
            f"{_escape(_clip(key))}<title>{_escape(key)}</title></text>"
        )
    for bar in sorted(bars, key=lambda bar: (bar.lease.key, bar.start)):
        y = _TOP + _ROW * rows[bar.lease.key] + 2
        left = x(bar.start)
        width = max(x(bar.end) - left, 1.0)
        fill = "url(#held)" if bar.outcome == "held" else COLOURS.get(bar.outcome, "#000")
        attributes = {
            "class": "lease",
            "data-key": bar.lease.key,
            "data-fence": str(bar.lease.fence),
            "data-token": bar.lease.token,
            "data-outcome": bar.outcome,
            "data-holder": bar.lease.holder.describe(),
        }
        attrs = " ".join(f"{name}={_quoteattr(value)}" for name, value in attributes.items())
        parts.append(
            f'<rect {attrs} x="{left:.2f}" y="{y}" width="{width:.2f}" height="{_ROW - 4}" '
            f'fill="{fill}"><title>{_escape(bar.title())}</title></rect>'
        )
    parts += _legend(height - 14)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _clip(key: str, limit: int = 32) -> str:
    return key if len(key) <= limit else "…" + key[-(limit - 1) :]


def _axis(since: float, until: float, x: Callable[[float], float], height: int) -> list[str]:
    """Ticks at a round step, at most ten across."""
    span = until - since
    steps = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
    step = next((s for s in steps if span / s <= 10), 86400 * math.ceil(span / 86400 / 10))
    first = math.ceil(since / step) * step
    parts = []
    tick = first
    while tick <= until:
        left = x(tick)
        parts.append(
            f'<line x1="{left:.1f}" y1="{_TOP - 6}" x2="{left:.1f}" y2="{height - 34}" '
            'stroke="#e0e0e0"/>'
            f'<text x="{left:.1f}" y="{_TOP - 10}" text-anchor="middle" fill="#555">'
            f"{_escape(time.strftime('%H:%M:%S', time.localtime(tick)))}</text>"
        )
        tick += step
    return parts


def _legend(y: int) -> list[str]:
    parts = []
    left = 4
    for name, colour in COLOURS.items():
        fill = "url(#held)" if name == "held" else colour
        parts.append(
            f'<rect x="{left}" y="{y - 10}" width="12" height="12" fill="{fill}"/>'
            f'<text x="{left + 16}" y="{y}">{_escape(name)}</text>'
        )
        left += 22 + 8 * len(name)
    return parts


def page(svg: str, title: str) -> str:
    """An HTML page holding a fluid SVG (tooltips show on hover); below its ``MIN_WIDTH``
    the picture scrolls sideways in its own box."""
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"/>'
        '<meta name="viewport" content="width=device-width, initial-scale=1"/>'
        f"<title>{_escape(title)}</title></head><body>\n"
        f'<div class="timeline" style="overflow-x: auto">{svg}</div></body></html>\n'
    )


def newest_matching(
    backend: LockBackend,
    prefix: str,
    *,
    outcome: Outcome | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int,
) -> list[Record]:
    """The newest ``limit`` records of keys starting with ``prefix`` (and released by
    ``until``), newest first. The store filters by exact key only: asked for ``limit``
    records, it may return other keys' only; then the whole window is read."""

    def kept(batch: list[Record]) -> list[Record]:
        return [
            record
            for record in batch
            if record.key.startswith(prefix) and (until is None or record.released_at <= until)
        ]

    batch = backend.history(outcome=outcome, since=since, limit=limit)
    found = kept(batch)
    if len(found) < limit and len(batch) == limit:  # other keys' records filled the batch
        found = kept(backend.history(outcome=outcome, since=since, limit=None))
    return found[:limit]


@click.command()
@click.option("--key", "prefix", help="Only keys starting with this (default: the namespace).")
@click.option("--since", type=SINCE, default="1h", show_default=True,
              help="From: 10m, 2h or ISO. Not given: the last hour, from just before its oldest "
              "lease.")  # fmt: skip
@click.option("--limit", type=click.IntRange(min=1, max=MOST), default=5000, show_default=True,
              help="At most this many released leases, the newest.")  # fmt: skip
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="The file to write: .svg, or .html for a page holding the picture.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True,
              help="Print its records and leases as JSON (stable keys) for scripts.")  # fmt: skip
@guarded
def timeline(
    env: Env, *, prefix: str | None, since: float, limit: int, output: Path | None, as_json: bool
) -> None:
    """Draw who held which key when, as an SVG or HTML file (-o), or print it as JSON.

    One row per key, one bar per lease from acquisition to release, coloured by outcome; a
    lease still held is hatched up to now. Hover a bar for its fence, holder and times.
    Without --since the window starts just before the oldest lease of the last hour.
    """
    if output is None and not as_json:
        raise UsageFailure("timeline needs -o FILE.svg (or .html), or --json")
    if output is not None and output.suffix.lower() not in (".svg", ".html", ".htm"):
        raise UsageFailure(f"-o {output}: write a .svg or an .html file")
    chosen = env.target.prefix if prefix is None else prefix
    backend = env.backend
    until = time.time()
    if since >= until:  # the picture would run backwards: every bar squeezed to its edge
        raise UsageFailure(f"--since {local_time(since)} is not in the past")
    records = newest_matching(backend, chosen, since=since, limit=limit)
    bars = [Bar.of(record) for record in records]
    bars += [Bar(lease, lease.acquired_at, until, "held") for lease in backend.leases(chosen)]
    typed = click.get_current_context().get_parameter_source("since") != ParameterSource.DEFAULT
    window = Window(since, until, since) if typed else Window.fit(since, until, bars)
    if output is not None:
        html = output.suffix.lower() != ".svg"
        svg = render_svg(bars, window, fluid=html)
        text = page(svg, window.caption(bars)) if html else svg
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from None
        if not as_json:
            keys = len({bar.lease.key for bar in bars})
            note = f"; {window.note()}" if window.fitted else ""
            env.echo(
                f"wrote {output}: {len(bars)} leases on {keys} keys from "
                f"{local_time(window.start)} to {local_time(window.end)}{note}"
            )
    if as_json:  # the shapes of `history --json` (records) and `leases --json` (leases, now)
        env.emit_json(
            {
                "backend": env.url,
                "prefix": chosen,
                "since": since,
                "now": until,
                "window": {"start": window.start, "end": window.end, "fitted": window.fitted},
                "output": None if output is None else str(output),
                "records": [record_json(record) for record in records],
                "leases": [lease_json(bar.lease, until) for bar in bars if bar.outcome == "held"],
            }
        )
