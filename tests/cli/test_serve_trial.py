"""An operator's trial of ``celery-dlock serve``, run for real (the command as a process)
over real stores: hostile text from the store, odd query parameters and methods, a store
that goes away and comes back, ten thousand leases, concurrent requests, and whether
``/metrics`` keeps to the filters it is given."""

from __future__ import annotations

import dataclasses
import http.client
import os
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import Holder, Outcome, backend_from_url
from tests.cli.clitools import REDIS_URL, CliStore, redis_client
from tests.cli.conftest import postgres_store
from tests.cli.conftest import redis_store as redis_store_under
from tests.cli.test_cli_serve import Server
from tests.support.countingproxy import CountingProxy
from tests.support.services import POSTGRES_URL, drop_schema, postgres_admin, with_options

pytest.importorskip("flask")
pytest.importorskip("waitress")


@pytest.fixture
def served(pg_store: CliStore, tmp_path: Path) -> Iterator[Server]:
    server = Server(pg_store.url, tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server over an empty Postgres store for the tests that only ask it (a server a
    test costs a second or more to start)."""
    with postgres_store() as store:
        server = Server(store.url, tmp_path_factory.mktemp("quiet"))
        yield server
        server.stop()


@pytest.fixture
def redis_store() -> Iterator[CliStore]:
    """Redis DB 4 under a fresh key prefix, its keys deleted afterwards."""
    with redis_store_under("strial") as store:
        yield store


def gauges(text: str) -> dict[str, str]:
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")


def record(store: CliStore, key: str, outcome: Outcome = Outcome.SUCCEEDED, **holder: Any) -> None:
    lease = store.backend.try_acquire(key, Holder.current(**holder), None)
    assert lease is not None
    assert store.backend.release(lease, outcome) is not None


def request(server: Server, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request(method, path)
        reply = connection.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        connection.close()


# -- defects found ------------------------------------------------------------------------------


def test_the_picture_alone_stays_well_formed_with_control_characters_in_a_holder(
    pg_store: CliStore, served: Server
) -> None:
    """A task id is whatever the producer sent (``apply_async(task_id=...)``), and the README
    expects control characters there (``\\x1b``). ``/timeline.svg`` is an XML document
    (``image/svg+xml``): one such holder must not make it ill-formed, which blanks the whole
    picture in a browser and breaks every script that parses it."""
    holder: dict[str, Any] = {
        "task_name": "shop.charge",
        "task_id": "id-\x1b[31m-red",
        "worker": "celery@w\x07",
    }
    record(pg_store, "job:ctl:1", Outcome.FAILED, **holder)
    lease = pg_store.backend.try_acquire("job:ctl:2", Holder.current(**holder), None)
    assert lease is not None
    assert "\x1b" in (pg_store.backend.leases("job:ctl:")[0].holder.task_id or "")
    status, svg = served.get("/timeline.svg?since=10m&key=job:ctl:")
    assert status == 200
    root = ET.fromstring(svg)  # ill-formed today: "not well-formed (invalid token)"
    bars = root.findall(".//{http://www.w3.org/2000/svg}rect[@class='lease']")
    assert sorted(bar.get("data-key") or "" for bar in bars) == ["job:ctl:1", "job:ctl:2"]


def test_metrics_with_a_key_filter_count_that_prefix_behind_newer_records_of_others(
    pg_store: CliStore, served: Server
) -> None:
    """``/metrics?key=job:mine:`` gives "gauges of the same filters": the successes of
    ``job:mine:`` in the window, however many newer successes other keys have. The page
    itself finds them (it reads on past a batch of other keys' records); the gauge must
    not say 0."""
    for n in range(3):
        record(pg_store, f"job:mine:{n}")
    for _ in range(5001):
        record(pg_store, "job:busy")
    status, page = served.get("/?key=job:mine:")
    assert status == 200 and page.count('class="record"') == 3
    status, text = served.get("/metrics?key=job:mine:")
    assert status == 200
    assert gauges(text)['dlock_store_records{outcome="succeeded"}'] == "3"


def test_metrics_keep_to_the_until_they_are_given(pg_store: CliStore, served: Server) -> None:
    """``/metrics?since=2h&until=1h`` counts the records released in that hour, like the
    page with the same filters: a success released a moment ago is not in it."""
    record(pg_store, "job:recent:1")
    status, page = served.get("/?since=2h&until=1h")
    assert status == 200 and page.count('class="record"') == 0
    status, text = served.get("/metrics?since=2h&until=1h")
    assert status == 200
    assert gauges(text)['dlock_store_records{outcome="succeeded"}'] == "0"


def test_thousands_of_leases_keep_the_page_bounded(redis_store: CliStore, tmp_path: Path) -> None:
    """A store with 3,000 leases held (a backlog, a stuck deploy): the operator opens the
    page with ``limit=50`` to see what is wrong. The page must stay a page (the oldest 50
    leases, saying how many are held: under 1 MB), not a 2 MB table and a picture 60,000
    units tall that ``limit`` does not touch (10,000 leases made 6.9 MB)."""
    backend = redis_store.backend
    holder = Holder.current(task_name="t.backlog")
    for n in range(3_000):
        assert backend.try_acquire(f"job:backlog:{n}", holder, 600) is not None
    server = Server(redis_store.url, tmp_path)
    try:
        status, page = server.get("/?limit=50")
        assert status == 200
        assert "Held now (3000)" in page
        assert page.count('<tr class="lease">') == 50
        assert "job:backlog:0<" in page and "job:backlog:2999<" not in page  # the oldest
        assert len(page.encode()) < 1_000_000, f"{len(page.encode()):,} bytes"
    finally:
        server.stop()


def test_one_lease_with_an_out_of_range_pid_does_not_take_the_page_down(
    file_store: CliStore, tmp_path: Path
) -> None:
    """A store's entries are written by any client (another language's, a corrupt file): a
    holder naming this host with a pid no process can have (2**31) is at worst shown as
    not provably gone. The page, ``/metrics`` and the picture still answer 200 and list the
    other leases, instead of a 500 for the whole store."""
    backend = file_store.backend
    me = Holder.current(task_name="t.fine")
    assert backend.try_acquire("job:fine", me, None) is not None
    odd = dataclasses.replace(me, pid=2**31, task_name="t.odd", nonce="0123456789abcdef")
    assert backend.try_acquire("job:odd", odd, None) is not None
    server = Server(file_store.url, tmp_path)
    try:
        status, page = server.get("/")
        assert status == 200, page[:300]
        assert "job:fine" in page and "job:odd" in page
        assert server.get("/metrics")[0] == 200
        assert server.get("/timeline.svg")[0] == 200
    finally:
        server.stop()


# -- what held ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_an_outage_of_the_store_is_a_503_and_the_page_comes_back(kind: str, tmp_path: Path) -> None:
    """The store becomes unreachable while the page is served (every connection cut, new
    ones refused): every path answers promptly with a plain-text 503 naming the store's
    failure, not a 500 or a hang; when the store is back, the same server answers 200
    again, without a restart."""
    admin = postgres_admin() if kind == "postgres" else None
    schema = f"dlock_strial_{os.urandom(5).hex()}"
    prefix = f"dlock-strial-{os.urandom(5).hex()}"
    port = 5432 if kind == "postgres" else 6379
    with CountingProxy("127.0.0.1", port) as proxy:
        if kind == "postgres":
            direct = with_options(POSTGRES_URL, schema=schema)
            url = with_options(POSTGRES_URL.replace(":5432/", f":{proxy.port}/"), schema=schema)
            with backend_from_url(direct) as backend:
                backend.migrate()  # type: ignore[attr-defined]
        else:
            url = f"{REDIS_URL.replace(':6379/', f':{proxy.port}/')}?prefix={prefix}"
        assert f":{proxy.port}/" in url
        server = Server(url, tmp_path)
        try:
            paths = ("/", "/metrics", "/timeline.svg")
            for path in paths:
                assert server.get(path)[0] == 200
            proxy.refuse()
            for path in paths:
                status, headers, body = request(server, "GET", path)
                assert status == 503, body
                assert headers["content-type"].startswith("text/plain")
                assert b"the lock store failed" in body and b"Traceback" not in body
            proxy.accept()
            for path in paths:
                assert server.get(path)[0] == 200
            assert server.process.poll() is None
        finally:
            server.stop()
            if admin is not None:
                drop_schema(admin, schema)
                admin.close()
            if kind == "redis":
                client = redis_client()
                for name in client.scan_iter(match=f"*{prefix}*", count=1000):
                    client.delete(name)
                client.close()


HOSTILE = '"><img src=x onerror=alert(1)></script><script>alert(2)</script>'


def test_hostile_text_from_the_store_and_the_url_is_shown_not_run(
    pg_store: CliStore, served: Server
) -> None:
    """Holder names, problems, details and keys that carry HTML and quotes (stored by any
    client) and a key filter crafted into a link: all shown as text on the page, in the
    picture's attributes and in the form's value; none becomes markup."""
    backend = pg_store.backend
    holder = Holder.current(task_name=HOSTILE, task_id=HOSTILE, worker=HOSTILE)
    lease = backend.try_acquire("job:\"q'<b>", holder, None)
    assert lease is not None
    backend.release(lease, Outcome.FAILED, HOSTILE, f"{HOSTILE}\nTraceback {HOSTILE}")
    held = backend.try_acquire("job:held:<i>", holder, None)
    assert held is not None
    status, page = served.get("/?since=10m")
    assert status == 200
    for markup in ("<img", "<script>alert", "<b>", "<i>"):
        assert markup not in page
    assert page.count("&lt;img src=x onerror=alert(1)&gt;") >= 4
    status, svg = served.get("/timeline.svg?since=10m")
    assert status == 200
    root = ET.fromstring(svg)
    holders = {rect.get("data-holder") for rect in root.iter("{http://www.w3.org/2000/svg}rect")}
    assert any(h and HOSTILE in h for h in holders)
    assert not root.findall(".//{http://www.w3.org/2000/svg}script")
    status, page = served.get("/?key=%22%3E%3Cscript%3Ealert(3)%3C/script%3E")
    assert status == 200 and "<script>alert(3)" not in page
    assert 'value="&#34;&gt;&lt;script&gt;alert(3)&lt;/script&gt;"' in page


def test_like_wildcards_in_a_key_filter_match_only_themselves(
    pg_store: CliStore, served: Server
) -> None:
    """On Postgres a prefix becomes a LIKE pattern: ``%`` and ``_`` typed in the key filter
    must match those characters only, on the page and in ``/metrics``."""
    held = pg_store.backend.try_acquire("job:abc", Holder.current(), None)
    assert held is not None
    record(pg_store, "job:abd")
    for prefix in ("%25", "job:%25", "job:_", "job:ab_"):
        status, page = served.get(f"/?since=10m&key={prefix}")
        assert status == 200 and "Held now (0)" in page and 'class="record"' not in page
        status, text = served.get(f"/metrics?key={prefix}")
        assert gauges(text)["dlock_store_leases_held"] == "0"
        assert gauges(text)['dlock_store_records{outcome="succeeded"}'] == "0"


@pytest.mark.parametrize(
    ("path", "status", "named"),
    [
        ("/?limit=", 400, "limit"),
        ("/?limit=-1", 400, "limit"),
        ("/?limit=0", 400, "limit"),
        ("/?limit=1e3", 400, "limit"),
        ("/metrics?limit=99999999999999999999999", 400, "limit"),
        ("/?since=0001-01-01", 400, "since"),
        ("/?since=99999999999w", 400, "since"),
        ("/?since=2026-01-01T00:00%2B25:00", 400, "since"),
        ("/?since=%ED%A0%80", 400, "since"),
        ("/timeline.svg?until=9999-12-31&since=9999-12-31T23:59", 400, "until"),
        ("/?since=1970-01-01T00:00:01Z", 200, ""),
        ("/?until=2999-01-01", 200, ""),
        ("/?key=" + "%E2%82%AC" * 1024, 200, ""),
        ("/metrics?key=" + "%E2%82%AC" * 1024, 200, ""),
        ("/?key=" + "x" * 1025, 400, "key"),
        ("/?key=%7F%C2%85%ED%A0%80", 200, ""),
        ("/?outcome=&problems=1", 200, ""),
        ("/?problems=1&outcome=succeeded", 400, "outcome"),
    ],
)
def test_odd_parameters_are_a_400_naming_them_or_a_page_never_a_500(
    quiet: Server, path: str, status: int, named: str
) -> None:
    """Query strings an operator or a crawler might send: out-of-range, malformed,
    overflowing, invalid UTF-8, 1,024 three-byte characters, a window of 56 years or
    ending in 2999. Each is either a 400 that names the parameter or a page: never a 500."""
    got, text = quiet.get(path)
    assert got == status, text[:300]
    assert named in text and "Traceback" not in text


def test_methods_and_paths_get_plain_answers(quiet: Server) -> None:
    """HEAD is a GET without a body, OPTIONS lists the methods, anything else on a page is
    a plain-text 405; unknown and traversal paths are plain-text 404s, and there is no
    static directory to walk out of."""
    status, headers, body = request(quiet, "HEAD", "/")
    assert status == 200 and body == b"" and headers["content-type"].startswith("text/html")
    status, headers, _ = request(quiet, "OPTIONS", "/metrics")
    assert status == 200 and set(headers["allow"].split(", ")) == {"GET", "HEAD", "OPTIONS"}
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, body = request(quiet, method, "/")
        assert status == 405 and headers["content-type"].startswith("text/plain"), method
    for path in (
        "/static/../../../etc/passwd",
        "/..%2f..%2f..%2fetc%2fpasswd",
        "/static/web.py",
        "//etc/passwd",
    ):
        status, headers, body = request(quiet, "GET", path)
        assert status == 404 and b"root:" not in body, path
        assert headers["content-type"].startswith("text/plain")


def test_concurrent_requests_all_answer_right(pg_store: CliStore, served: Server) -> None:
    """Eight operators' browsers and a Prometheus scrape at once (waitress's four threads
    sharing one Postgres backend): 80 requests, every one a 200 with the right content."""
    record(pg_store, "job:conc:1", Outcome.FAILED)
    held = pg_store.backend.try_acquire("job:conc:2", Holder.current(), None)
    assert held is not None
    failures: list[str] = []

    def browse(n: int) -> None:
        for i in range(10):
            path = ("/?since=10m", "/metrics", "/timeline.svg?since=10m")[(n + i) % 3]
            status, text = served.get(path)
            if status != 200:
                failures.append(f"{path}: {status} {text[:200]}")
            elif path == "/metrics" and gauges(text)["dlock_store_leases_held"] != "1":
                failures.append(f"{path}: {text}")
            elif path.startswith("/?") and "job:conc:1" not in text:
                failures.append(f"{path}: no record")

    threads = [threading.Thread(target=browse, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
