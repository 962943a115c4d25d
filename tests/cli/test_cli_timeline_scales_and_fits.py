"""``timeline``: a picture that scales to its page, and a window fitted to the leases.

Reported by a new user: the SVG was a fixed 1280 px wide (a horizontal scrollbar on a narrower
window, wasted space on a wider one), and the default window, the last hour, drew a minute of
activity as slivers at its right edge. Run for real on the file store and read back as XML:
the picture's size attributes, its window (``data-start``/``data-end`` and the JSON's
``window``), and every bar's x and width against that window."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from celery_dlock.cli.render import local_time
from celery_dlock.records import Holder, Outcome
from tests.cli.clitools import CliStore, run_cli

SVG = "{http://www.w3.org/2000/svg}"


def picture(path: Path) -> ET.Element:
    root = ET.parse(path).getroot()
    return root if root.tag == f"{SVG}svg" else root.find(f".//{SVG}svg")  # type: ignore[return-value]


def drawn(store: CliStore, path: Path, *args: str) -> tuple[ET.Element, dict[str, Any]]:
    """``timeline ARGS --json -o PATH``: the picture and the JSON."""
    result = run_cli("--backend", store.url, "timeline", *args, "--json", "-o", str(path))
    assert result.returncode == 0, result.stderr
    return picture(path), json.loads(result.stdout)


def assert_bars_are_placed_in_the_window(
    root: ET.Element, window: dict[str, Any], spans: dict[str, tuple[float, float]]
) -> tuple[float, float]:
    """The picture says it shows ``window`` (the JSON's); each bar's x and width are its
    lease's times on the picture's axis (``data-axis``) across it; returns the axis's ends."""
    start, end = window["start"], window["end"]
    assert abs(float(root.get("data-start", "nan")) - start) < 1e-5
    assert abs(float(root.get("data-end", "nan")) - end) < 1e-5
    axis = root.get("data-axis")
    assert axis is not None, "the picture says where its time axis runs"
    left, right = (float(part) for part in axis.split())

    def x(at: float) -> float:
        return left + (right - left) * (min(max(at, start), end) - start) / (end - start)

    rects = [rect for rect in root.iter(f"{SVG}rect") if rect.get("class") == "lease"]
    assert {rect.get("data-token") for rect in rects} == set(spans)
    for rect in rects:
        acquired, released = spans[rect.get("data-token") or ""]
        assert abs(float(rect.get("x", "nan")) - x(acquired)) < 0.02
        width = max(x(released) - x(acquired), 1.0)
        assert abs(float(rect.get("width", "nan")) - width) < 0.05
    return left, right


def test_the_svg_file_has_a_size_of_its_own_and_the_html_page_fills_its_window(
    file_store: CliStore, tmp_path: Path
) -> None:
    lease = file_store.backend.try_acquire("job:order:1", Holder.current(), None)
    assert lease is not None
    file_store.backend.release(lease, Outcome.SUCCEEDED)

    alone = tmp_path / "t.svg"
    assert run_cli("--backend", file_store.url, "timeline", "-o", str(alone)).returncode == 0
    root = picture(alone)
    view = root.get("viewBox", "").split()
    assert len(view) == 4 and view[:2] == ["0", "0"], root.attrib  # scales where embedded
    assert root.get("width") == view[2] and root.get("height") == view[3]  # 1 unit = 1 px
    assert 700 <= float(view[2]) <= 1280  # opens at a sensible size on its own

    page = tmp_path / "t.html"
    assert run_cli("--backend", file_store.url, "timeline", "-o", str(page)).returncode == 0
    html = ET.parse(page).getroot()
    [box] = [div for div in html.iter("div") if div.find(f"{SVG}svg") is not None]
    assert "overflow-x: auto" in (box.get("style") or "")  # below its minimum, it scrolls
    inner = picture(page)
    assert inner.get("viewBox") == root.get("viewBox")
    assert inner.get("width") == "100%" and inner.get("height") is None
    assert "min-width: 700px" in (inner.get("style") or "")


def test_without_since_the_window_starts_just_before_the_oldest_lease(
    file_store: CliStore, tmp_path: Path
) -> None:
    backend = file_store.backend
    held = backend.try_acquire("job:order:0", Holder.current(), 600)
    assert held is not None
    spans: dict[str, tuple[float, float]] = {}
    for n in (1, 2, 3):  # about six seconds of activity: past the shortest window (5 s)
        time.sleep(1.5)
        lease = backend.try_acquire(f"job:order:{n}", Holder.current(), None)
        assert lease is not None
        time.sleep(0.5)
        record = backend.release(lease, Outcome.SUCCEEDED)
        assert record is not None
        spans[lease.token] = (lease.acquired_at, record.released_at)

    root, data = drawn(file_store, tmp_path / "fitted.svg")
    window, now = data["window"], data["now"]
    spans[held.token] = (held.acquired_at, now)
    assert window["fitted"] is True and window["end"] == now
    # It starts before the oldest lease, by a margin of 5 % of the window (at least 0.5 s).
    margin = window["start"] - held.acquired_at
    assert -max(0.06 * (now - held.acquired_at), 0.51) < margin < 0
    left, right = assert_bars_are_placed_in_the_window(root, window, spans)
    bars = {rect.get("data-token"): rect for rect in root.iter(f"{SVG}rect")}
    oldest = bars[held.token]
    assert float(oldest.get("x", "nan")) - left < 0.1 * (right - left)  # not a sliver
    assert abs(float(oldest.get("x", "nan")) + float(oldest.get("width", "nan")) - right) < 0.05
    texts = [text.text or "" for text in root.iter(f"{SVG}text")]
    assert f"from {local_time(window['start'])} to {local_time(now)}" in texts[0]
    assert "fitted to the leases since" in texts[1]

    # A --since the user typed is the window, as given, even the default's value.
    for typed in ("1h", "30s"):
        root, data = drawn(file_store, tmp_path / f"since-{typed}.svg", "--since", typed)
        window = data["window"]
        assert window == {"start": data["since"], "end": data["now"], "fitted": False}
        spans[held.token] = (held.acquired_at, data["now"])
        left, right = assert_bars_are_placed_in_the_window(root, window, spans)
        texts = [text.text or "" for text in root.iter(f"{SVG}text")]
        assert f"from {local_time(data['since'])} to {local_time(data['now'])}" in texts[0]
        assert not any("fitted" in text for text in texts)
        if typed == "1h":  # the hour, as typed: this activity at its right edge
            [oldest] = [
                rect for rect in root.iter(f"{SVG}rect") if rect.get("data-token") == held.token
            ]
            assert float(oldest.get("x", "nan")) - left > 0.99 * (right - left)
    backend.release(held, Outcome.SUCCEEDED)
