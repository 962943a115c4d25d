"""How often ``celery-dlock run`` reads its lease back while the command runs, per store, and
that a forced release still stops the command within the documented time: 10 s between reads
on an object store (each request is billed), none on Postgres without a ttl (the lock
session's watcher reports a forced release within about a second), 1 s elsewhere.

Reads are counted where they arrive: an HTTP proxy in front of the object-store server, a
TCP proxy in front of PostgreSQL. Each window is measured; the runner's reads are paced by
its own timer, so a slow machine only makes fewer of them."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from celery_dlock import backend_from_url
from celery_dlock.cli.lost import WATCH_OBJECT_STORE
from celery_dlock.records import Outcome
from tests.cli.clitools import CliStore, run_cli
from tests.cli.test_cli_run_trial import KEY, finish, sleeper, start
from tests.support import eventually
from tests.support.countingproxy import CountingProxy
from tests.support.objectstore_servers import (  # noqa: F401 - fixtures
    HTTPProxy,
    Logged,
    Server,
    object_server,
    proxy,
    unique_prefix,
)

#: A ttl whose first renewal (ttl/3 = 100 s) comes after every wait of these tests: a
#: command stopped sooner was stopped by a read of the lease, not by a renewal.
LONG_TTL = ["--ttl", "300"]
#: Seconds a runner is given to stop its command after a forced release: more than the
#: longest documented delay (10 s), less than a renewal of ``LONG_TTL`` (100 s).
STOPPED_WITHIN = 30


def is_lock_read(request: Logged) -> bool:
    """A GET of a lock object (S3 GetObject; GCS media or metadata)."""
    return request.method in {"GET", "HEAD"} and "/locks/" in unquote(urlsplit(request.path).path)


def counted_for(seconds: float, count: Callable[[], int]) -> tuple[int, float]:
    """What ``count()`` grows by over a window of ``seconds``, and the window's measured
    length (from just before the first count to just after the last)."""
    began = time.monotonic()
    before = count()
    time.sleep(seconds)  # the window being measured, not a wait for something to settle
    after = count()
    return after - before, time.monotonic() - began


def force_and_wait(url: str, runner: subprocess.Popen[bytes]) -> tuple[dict[str, Any], int]:
    """``release --force`` the key as an operator does; the forced release's JSON and the
    runner's exit code once it stopped (its command SIGTERMed)."""
    forced = json.loads(run_cli("--backend", url, "release", "--force", "--json", KEY).stdout)
    return forced, runner.wait(timeout=STOPPED_WITHIN)


def through(url: str) -> CliStore:
    """The store behind a proxy, for ``start`` (which uses its URL only; no connection)."""
    return CliStore("through a proxy", url, backend_from_url(url))


def test_an_object_store_run_reads_its_lease_every_10_s_and_a_forced_release_stops_it(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Before: a GET of the lock object every second for as long as the command ran (86,400
    billed requests a day per command, tens of ms each on S3 or GCS)."""
    prefix = unique_prefix()
    direct = backend_from_url(object_server.url(prefix))
    started = tmp_path / "started"
    runner = start(
        through(object_server.url(prefix, proxy.endpoint)), *LONG_TTL, KEY, "--", *sleeper(started)
    )
    try:
        eventually(started.exists, "the command started")
        reads, seconds = counted_for(12, lambda: sum(map(is_lock_read, proxy.since(0))))
        forced, code = force_and_wait(object_server.url(prefix), runner)
    finally:
        err = finish(runner)
    assert reads <= math.floor(seconds / WATCH_OBJECT_STORE) + 1, (reads, seconds)  # old: ~12
    assert forced["released"] and code == 128 + signal.SIGTERM, err
    assert b"was lost while the command runs" in err
    token = forced["lease"]["token"]
    ended = {r.outcome for r in direct.history(key=KEY) if r.lease.token == token}
    assert ended == {Outcome.FORCED, Outcome.LOST}


def test_watch_sets_how_often_an_object_store_run_reads_its_lease(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
    tmp_path: Path,
) -> None:
    """``--watch 1``: a read a second, for an operator who pays for a shorter delay."""
    prefix = unique_prefix()
    started = tmp_path / "started"
    url = object_server.url(prefix, proxy.endpoint)
    runner = start(through(url), *LONG_TTL, "--watch", "1", KEY, "--", *sleeper(started))
    try:
        eventually(started.exists, "the command started")
        reads, seconds = counted_for(5, lambda: sum(map(is_lock_read, proxy.since(0))))
    finally:
        finish(runner)
    assert 1 <= reads <= math.floor(seconds) + 1, (reads, seconds)


@pytest.mark.parametrize("watch", ["0", "50ms"])
def test_watch_shorter_than_a_tenth_of_a_second_is_a_usage_error(
    file_store: CliStore, watch: str
) -> None:
    result = run_cli("--backend", file_store.url, "run", "--watch", watch, KEY, "--", "true")
    assert result.returncode == 2
    assert "--watch" in result.stderr and "Traceback" not in result.stderr
    assert file_store.backend.history(key=KEY) == []  # nothing run


def test_a_postgres_run_without_ttl_leaves_the_reads_to_its_session_watcher(
    pg_store: CliStore, tmp_path: Path
) -> None:
    """Before: the runner read its lease once a second on top of the lock session's sweep
    (one round trip a second while it holds a lease without a ttl), which already reports a
    forced release: two round trips a second where one does. A forced release still stops
    the command (the sweep finds the lease gone: within about a second)."""
    started = tmp_path / "started"
    with CountingProxy("127.0.0.1", 5432) as counter:
        url = pg_store.url.replace("127.0.0.1:5432", f"127.0.0.1:{counter.port}")
        assert url != pg_store.url
        runner = start(through(url), KEY, "--", *sleeper(started))
        try:
            eventually(started.exists, "the command started")
            trips, seconds = counted_for(6, lambda: counter.round_trips)
            forced, code = force_and_wait(pg_store.url, runner)
        finally:
            err = finish(runner)
    assert trips <= math.floor(seconds) + 1, (trips, seconds)  # old: two a second
    assert forced["released"] and code == 128 + signal.SIGTERM, err
    assert b"was lost while the command runs" in err
    token = forced["lease"]["token"]
    ended = {r.outcome for r in pg_store.backend.history(key=KEY) if r.lease.token == token}
    assert ended == {Outcome.FORCED, Outcome.LOST}


def test_a_postgres_run_with_a_ttl_still_reads_its_lease_and_stops_at_a_forced_release(
    pg_store: CliStore, tmp_path: Path
) -> None:
    """With --ttl the lease is renewed, not watched by the lock session: the runner's reads
    (once a second) are what stop the command long before the next renewal (100 s)."""
    started = tmp_path / "started"
    runner = start(pg_store, *LONG_TTL, KEY, "--", *sleeper(started))
    try:
        eventually(started.exists, "the command started")
        forced, code = force_and_wait(pg_store.url, runner)
    finally:
        err = finish(runner)
    assert forced["released"] and code == 128 + signal.SIGTERM, err
    assert b"was lost while the command runs" in err


def test_an_object_store_run_renewed_as_often_as_it_would_read_makes_no_reads_of_its_own(
    object_server: Server,  # noqa: F811
    proxy: HTTPProxy,  # noqa: F811
    tmp_path: Path,
) -> None:
    """--ttl 6: a renewal every 2 s, each a conditional write that finds a lease gone, so a
    read every 3 s (--watch 3) would learn nothing sooner: the runner's requests are its
    renewals'."""
    prefix = unique_prefix()
    started = tmp_path / "started"
    url = object_server.url(prefix, proxy.endpoint)
    runner = start(through(url), "--ttl", "6", "--watch", "3", KEY, "--", *sleeper(started))
    try:
        eventually(started.exists, "the command started")
        first = proxy.count()
        time.sleep(7)  # the window being measured: three renewals or so
        during = proxy.since(first)
        forced, code = force_and_wait(object_server.url(prefix), runner)
    finally:
        err = finish(runner)
    reads = sum(map(is_lock_read, during))
    writes = len(during) - reads
    assert writes >= 1  # renewed meanwhile
    assert reads == 0, reads  # with reads: two or more (old: seven)
    assert forced["released"] and code == 128 + signal.SIGTERM, err
