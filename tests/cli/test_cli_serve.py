"""``serve``: the web page, run for real (``celery-dlock serve`` as a process) over a real
Postgres store, looked at as a person would with a headless Chromium (Debian's chromium and
chromedriver, driven by Selenium), and poked with bad input and release requests."""

from __future__ import annotations

import http.cookiejar
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import Holder, Lock, Outcome
from celery_dlock.cli.timeline import COLOURS
from celery_dlock.records import describe_exception
from tests.cli.clitools import BIN, CliStore, environment, postgres_url, run_cli
from tests.support import eventually, unavailable
from tests.support.holders import kill, spawn_holder

pytest.importorskip("flask")
pytest.importorskip("waitress")

SECRET = "correct horse battery staple"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Server:
    """``celery-dlock --backend URL serve`` on a free port, until stopped."""

    def __init__(self, url: str, tmp_path: Path, *extra: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"serve-{self.port}.log"
        args = [str(BIN / "celery-dlock"), "--backend", url, "serve", "--port", str(self.port)]
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [*args, *extra], stdout=out, stderr=out, env=environment(env)
            )
        try:
            eventually(self._up, f"the server on {self.base}")
        except BaseException:
            self.stop()
            raise

    def _up(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"serve exited: {self.log.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.base}/metrics", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answers (an error of the store's is the test's business)
        except OSError:
            return False

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"{self.base}{path}", timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture
def served(pg_store: CliStore, tmp_path: Path) -> Iterator[Server]:
    server = Server(pg_store.url, tmp_path)
    yield server
    server.stop()


def fill(store: CliStore) -> dict[str, Any]:
    """Leases and history a person would look at: a live lease, one whose holder was killed,
    a success, a failure with a traceback, a revoke, and a key with HTML in it."""
    backend = store.backend
    for key, outcome in [("job:order:1", Outcome.SUCCEEDED), ("job:order:2", Outcome.REVOKED)]:
        lease = backend.try_acquire(key, Holder.current(task_name="shop.charge"), None)
        assert lease is not None
        time.sleep(0.3)  # a bar wide enough to see on a minute's timeline
        backend.release(lease, outcome)
    try:
        raise ValueError("card 4242 declined")
    except ValueError as exc:
        problem, details = describe_exception(exc)
    failing = backend.try_acquire("job:order:3", Holder.current(task_name="shop.charge"), None)
    assert failing is not None
    backend.release(failing, Outcome.FAILED, problem, details)
    live = Lock(backend, "job:order:4", holder=Holder.current(task_name="shop.charge"))
    live.acquire()
    html = Lock(backend, "job:<script>alert(1)</script>")
    html.acquire()
    process, dead = spawn_holder(store.url, "job:order:5")
    kill(process)
    return {"live": live, "html": html, "dead": dead}


def test_a_person_sees_leases_history_colours_and_the_filter_working(
    pg_store: CliStore, served: Server, tmp_path: Path
) -> None:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        unavailable("needs Debian's chromium and chromium-driver (apt-get install ...)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    held = fill(pg_store)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--window-size=1400,1000"):
        options.add_argument(argument)
    browser = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        browser.get(served.base + "/?since=1m")
        leases = browser.find_elements(By.CSS_SELECTOR, "#leases tr.lease")
        keys = [row.find_element(By.CSS_SELECTOR, "td.key").text for row in leases]
        assert keys == sorted(["job:order:4", "job:order:5", "job:<script>alert(1)</script>"])
        gone = [row for row in leases if row.find_elements(By.CSS_SELECTOR, "td.gone")]
        assert [row.find_element(By.CSS_SELECTOR, "td.key").text for row in gone] == ["job:order:5"]
        assert browser.execute_script("return window.alertFired === undefined")  # not run
        rows = browser.find_elements(By.CSS_SELECTOR, "#history tr.record")
        seen = {row.get_attribute("data-outcome") for row in rows}
        assert seen == {"succeeded", "failed", "revoked"}
        for row in rows:
            cell = row.find_element(By.CSS_SELECTOR, "td.outcome")
            colour = COLOURS[row.get_attribute("data-outcome") or ""]
            expected = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
            assert cell.value_of_css_property("background-color") == "rgba({}, {}, {}, 1)".format(
                *expected
            )
        bars = browser.find_elements(By.CSS_SELECTOR, "#timeline rect.lease")
        assert len(bars) == 6  # 3 released, 3 held
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        if os.environ.get("DLOCK_SCREENSHOT_TO"):
            shutil.copy(tmp_path / "dashboard.png", os.environ["DLOCK_SCREENSHOT_TO"])

        # The filter: failed only; its traceback one click away.
        Select(browser.find_element(By.NAME, "outcome")).select_by_visible_text("failed")
        browser.find_element(By.ID, "apply").click()
        eventually(lambda: "outcome=failed" in browser.current_url, "the filtered page")
        rows = browser.find_elements(By.CSS_SELECTOR, "#history tr.record")
        assert [row.get_attribute("data-outcome") for row in rows] == ["failed"]
        problem = rows[0].find_element(By.CSS_SELECTOR, "td.problem")
        assert "ValueError: card 4242 declined" in problem.text
        trace = problem.find_element(By.TAG_NAME, "pre")
        assert not trace.is_displayed()
        problem.find_element(By.TAG_NAME, "summary").click()
        assert trace.is_displayed() and "Traceback" in trace.text
    finally:
        browser.quit()
        held["live"].release()
        held["html"].release()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("/?outcome=nope", "outcome"),
        ("/?since=yesterday-ish", "since"),
        ("/?limit=9999999", "limit"),
        ("/?limit=ten", "limit"),
        ("/?since=1h&until=2h", "until"),
        ("/timeline.svg?until=x", "until"),
        ("/metrics?since=%00", "since"),
        ("/?key=%01", "key"),
        # found by trying: a misspelt filter showed the page unfiltered, with a 200
        ("/?prefix=job:x", "prefix"),
        ("/timeline.svg?bogus=1", "bogus"),
        ("/?problems=maybe", "problems"),
    ],
)
def test_bad_input_is_a_400_that_names_it(served: Server, path: str, named: str) -> None:
    status, text = served.get(path)
    assert status == 400, text
    assert named in text and "Traceback" not in text


def test_an_error_is_plain_text_that_no_browser_renders_as_html(served: Server) -> None:
    try:
        urllib.request.urlopen(f"{served.base}/?key=%01<b>x</b>", timeout=10)
        raise AssertionError("a control character in the key was accepted")
    except urllib.error.HTTPError as exc:
        assert exc.code == 400
        assert exc.headers["Content-Type"].startswith("text/plain")
        assert exc.headers["X-Content-Type-Options"] == "nosniff"


def test_html_in_a_key_is_shown_not_run(pg_store: CliStore, served: Server) -> None:
    held = fill(pg_store)
    try:
        status, page = served.get("/")
        assert status == 200
        assert "<script>alert(1)</script>" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
        status, svg = served.get("/timeline.svg?since=10m")
        assert status == 200 and "<script>" not in svg
    finally:
        held["live"].release()
        held["html"].release()


def test_metrics_are_store_wide_gauges(pg_store: CliStore, served: Server) -> None:
    held = fill(pg_store)
    try:
        status, text = served.get("/metrics")
        assert status == 200
        lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
        assert lines["dlock_store_leases_held"] == "3"
        assert float(lines["dlock_store_oldest_lease_age_seconds"]) >= 0
        assert lines['dlock_store_records{outcome="failed"}'] == "1"
        assert lines['dlock_store_records{outcome="succeeded"}'] == "1"
        assert "password" not in text and "***" not in text
    finally:
        held["live"].release()
        held["html"].release()


def test_the_page_never_shows_the_store_password(tmp_path: Path) -> None:
    url = postgres_url(f"dlock_web_{os.urandom(4).hex()}")
    parts = urllib.parse.urlsplit(url)
    with_password = url.replace(f"{parts.username}@", f"{parts.username}:hunter2hunter2@", 1)
    server = Server(with_password, tmp_path)
    try:
        status, page = server.get("/?since=1m")
        assert status == 503 and "migrate" in page  # no tables in that schema: said, masked
        assert "hunter2hunter2" not in page and "hunter2hunter2" not in server.log.read_text()
    finally:
        server.stop()


def post(server: Server, jar: http.cookiejar.CookieJar, form: dict[str, str]) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    data = urllib.parse.urlencode(form).encode()
    try:
        with opener.open(f"{server.base}/release", data=data, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def session(server: Server) -> tuple[http.cookiejar.CookieJar, str]:
    """A browser's cookie jar after loading the page, and the CSRF token of its forms."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with opener.open(f"{server.base}/", timeout=10) as reply:
        reply.read()
    [cookie] = [c for c in jar if c.name == "dlock_csrf"]
    assert cookie.value
    return jar, cookie.value


def test_releasing_needs_the_flag_the_secret_and_the_csrf_token(
    pg_store: CliStore, tmp_path: Path
) -> None:
    backend = pg_store.backend
    lock = Lock(backend, "job:order:9")
    lease = lock.acquire()
    form = {"key": lease.key, "token": lease.token, "who": "ana", "why": "stuck after deploy"}

    read_only = Server(pg_store.url, tmp_path)
    try:
        jar, csrf = session(read_only)
        status, text = post(read_only, jar, {**form, "csrf": csrf, "secret": SECRET})
        assert status == 403 and "--allow-release" in text
    finally:
        read_only.stop()

    no_secret = subprocess.run(
        [str(BIN / "celery-dlock"), "--backend", pg_store.url, "serve", "--allow-release"],
        env=environment({"DLOCK_RELEASE_SECRET": ""}),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert no_secret.returncode == 2 and "DLOCK_RELEASE_SECRET" in no_secret.stderr

    server = Server(pg_store.url, tmp_path, "--allow-release", env={"DLOCK_RELEASE_SECRET": SECRET})
    try:
        jar, csrf = session(server)
        assert post(server, jar, {**form, "secret": SECRET})[0] == 403  # no CSRF token
        assert post(server, jar, {**form, "csrf": "forged", "secret": SECRET})[0] == 403
        assert (
            post(server, http.cookiejar.CookieJar(), {**form, "csrf": csrf, "secret": SECRET})[0]
            == 403
        )  # a form without the cookie: another site's
        assert post(server, jar, {**form, "csrf": csrf, "secret": "guess"})[0] == 403
        # non-ASCII text was a 500 (compare_digest refuses such str)
        assert post(server, jar, {**form, "csrf": csrf, "secret": "gehëim"})[0] == 403
        assert post(server, jar, {**form, "csrf": "ü", "secret": SECRET})[0] == 403
        good = {**form, "csrf": csrf, "secret": SECRET}
        status, text = post(server, jar, {**good, "who": " "})
        assert status == 400 and "who" in text  # who and why are required
        status, text = post(server, jar, {**good, "key": "job:\x00<b>"})
        assert status == 400 and "key" in text
        assert backend.get("job:order:9") is not None  # nothing released so far
        status, text = post(server, jar, {**form, "csrf": csrf, "secret": SECRET})
        assert status == 200, text
        assert backend.get("job:order:9") is None
        [record] = backend.history(key="job:order:9")
        assert record.outcome is Outcome.FORCED and record.lease.token == lease.token
        assert "ana" in (record.details or "") and "stuck after deploy" in (record.details or "")
        assert post(server, jar, {**form, "csrf": csrf, "secret": SECRET})[0] == 409  # gone
        assert SECRET not in server.log.read_text()
    finally:
        server.stop()
    assert lock.release() is None  # released by the page, recorded there: this one is lost


def test_a_busy_store_s_successes_crowd_out_no_failure_or_filtered_key(
    pg_store: CliStore, served: Server, tmp_path: Path
) -> None:
    # Found by trying the CLI: /metrics counted the newest 5000 records of the window, and
    # the page and the timeline filtered the key prefix after the store's limit, so 20
    # failures under job:other: behind 5000 newer successes showed as none.
    backend = pg_store.backend
    for n in range(20):
        lease = backend.try_acquire(f"job:other:{n}", Holder.current(), None)
        assert lease is not None and backend.release(lease, Outcome.FAILED) is not None
    for _ in range(5001):
        lease = backend.try_acquire("job:busy", Holder.current(), None)
        assert lease is not None and backend.release(lease, Outcome.SUCCEEDED) is not None
    status, text = served.get("/metrics")
    assert status == 200
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    assert lines['dlock_store_records{outcome="failed"}'] == "20"
    status, page = served.get("/?key=job:other:&limit=100")
    assert status == 200 and page.count('class="record"') == 20
    out = tmp_path / "other.svg"
    drawn = run_cli("--backend", pg_store.url, "timeline", "--key", "job:other:", "-o", str(out))
    assert drawn.returncode == 0 and "20 leases on 20 keys" in drawn.stdout


def test_a_problem_its_details_already_name_is_shown_once(
    pg_store: CliStore, served: Server
) -> None:
    """A replayed ``once`` duplicate is recorded problem ``once``, details ``once: already
    succeeded ...``: the page said ``once: once: already succeeded``."""
    lease = pg_store.backend.try_acquire("job:order:77", Holder.current(), None)
    assert lease is not None
    pg_store.backend.release(lease, Outcome.SKIPPED, "once", "once: already succeeded (fence 3)")
    status, page = served.get("/?key=job:order:77")
    assert status == 200
    assert "once: already succeeded (fence 3)" in page
    assert "once: once:" not in page
