"""``serve``: the page fits a narrow browser window, and its picture fits the leases.

Reported by a new user: the timeline was a fixed 1280 px wide (the page scrolled sideways in
a narrower window, and wasted a wider one), and its window, the last hour, drew a minute of
activity as slivers at its right edge. Looked at with a headless Chromium (Debian's chromium
and chromedriver, driven by Selenium) on the page of ``celery-dlock serve`` over a file store.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cli.clitools import CliStore
from tests.cli.test_cli_serve import Server, fill
from tests.support import eventually, unavailable

pytest.importorskip("flask")
pytest.importorskip("waitress")

#: The page's width and the picture's, its box's, and the scale of its text, as laid out.
MEASURE = """
const page = document.documentElement, box = document.getElementById('timeline');
const svg = box.querySelector('svg');
return {
  inner: window.innerWidth, scroll: page.scrollWidth, client: page.clientWidth,
  svg: svg.getBoundingClientRect().width, box: box.clientWidth, box_scroll: box.scrollWidth,
  view: svg.viewBox.baseVal.width, font: parseFloat(svg.getAttribute('font-size')),
  start: parseFloat(svg.dataset.start), end: parseFloat(svg.dataset.end),
  texts: Array.from(svg.querySelectorAll(':scope > text')).map(t => t.textContent),
};
"""


def assert_fitted(sizes: dict[str, Any], oldest: float) -> None:
    """The picture's window is from just before the oldest lease of the last hour (by 5 %,
    0.5 s at least), at least 5 s long, to now; its caption says so."""
    span = sizes["end"] - oldest
    assert sizes["start"] < oldest
    assert sizes["end"] - sizes["start"] <= max(5.0, span * 1.06 + 0.5) + 1e-3
    assert "fitted to the leases since" in sizes["texts"][1]


def test_the_page_fits_a_900_px_window_and_its_picture_the_leases(
    file_store: CliStore, tmp_path: Path
) -> None:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        unavailable("needs Debian's chromium and chromium-driver (apt-get install ...)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    held = fill(file_store)
    backend = file_store.backend
    starts = [record.lease.acquired_at for record in backend.history(limit=None)]
    oldest = min(starts + [lease.acquired_at for lease in backend.leases("job:")])
    server = Server(file_store.url, tmp_path)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--window-size=900,900"):
        options.add_argument(argument)
    browser = webdriver.Chrome(service=Service(driver_path), options=options)

    def measured(width: int) -> dict[str, Any]:
        browser.set_window_size(width, 900)
        # the window manager may apply the new size after the call returns (a loaded machine)
        inner = "return window.innerWidth"
        eventually(lambda: browser.execute_script(inner) == width, f"a viewport {width} px wide")
        sizes: dict[str, Any] = browser.execute_script(MEASURE)
        assert sizes["inner"] == width, sizes  # the viewport is the window's width
        assert sizes["scroll"] <= sizes["client"], sizes  # no horizontal scrollbar on the page
        return sizes

    try:
        browser.get(server.base + "/")
        narrow = measured(900)
        assert abs(narrow["svg"] - narrow["box"]) < 1  # the picture fills its box
        assert narrow["font"] * narrow["svg"] / narrow["view"] >= 9  # its text legible
        assert_fitted(narrow, oldest)
        browser.find_element(By.ID, "apply").click()  # the filters again, since left empty
        eventually(lambda: "since=" in browser.current_url, "the filtered page")
        assert_fitted(measured(900), oldest)

        tiny = measured(500)  # below its minimum: it scrolls in its own box, not the page
        assert abs(tiny["svg"] - 700) < 1 and tiny["box_scroll"] > tiny["box"]
        wide = measured(1600)
        assert abs(wide["svg"] - wide["box"]) < 1 and wide["svg"] > 1280

        browser.get(server.base + "/?since=1h")  # a since given: the window as given
        given = measured(900)
        assert abs(given["end"] - given["start"] - 3600) < 5
        assert not any("fitted" in text for text in given["texts"])
    finally:
        browser.quit()
        server.stop()
        held["live"].release()
        held["html"].release()


def test_the_picture_alone_is_fitted_too_and_keeps_its_size(
    file_store: CliStore, tmp_path: Path
) -> None:
    held = fill(file_store)
    server = Server(file_store.url, tmp_path)
    try:
        now = time.time()
        status, svg = server.get("/timeline.svg")
        assert status == 200
        head = svg.split(">", 1)[0]
        assert 'viewBox="0 0 1000 ' in head and 'width="1000"' in head  # a size of its own
        start = float(head.split('data-start="', 1)[1].split('"', 1)[0])
        assert now - 60 < start  # fitted: fill() took seconds, not the hour
        status, svg = server.get("/timeline.svg?since=1h")
        start = float(svg.split('data-start="', 1)[1].split('"', 1)[0])
        assert start < now - 3500
    finally:
        server.stop()
        held["live"].release()
        held["html"].release()
