"""An adversarial trial of the janitor (``celery_dlock.reap.reap``), its reaping and its
pruning of history, on real stores: the file store, memory, PostgreSQL, Redis and the local
S3 and GCS servers; holders are real processes, killed with SIGKILL."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import Holder, Outcome, backend_from_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.backends.file import FileBackend
from celery_dlock.backends.memory import MemoryBackend
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.reap import janitor_key, reap
from celery_dlock.records import Record
from tests.backends.conftest import STORES
from tests.backends.storecase import StoreCase
from tests.cli.clitools import run_cli as cli
from tests.support import force_release
from tests.support.expiry import expired_leases
from tests.support.holders import gone, kill, spawn_holder
from tests.support.services import postgres_admin

#: The stores of the trial; the first two on the real clock (the suite's own cases of them
#: have a fake one, which ``reap``'s retention, taken from ``time.time``, does not see).
ALL = ["file", "gcs", "memory", "postgres", "redis", "s3"]
OBJECT_STORES = ["gcs", "s3"]
TTL = 0.4
YEAR = 365.25 * 86400
#: A ``dlock_history_retention`` that the settings accept (positive and finite), and one
#: that ``celery-dlock reap --retention 5200w`` gives: both reach back before 1970.
RETENTIONS = [1e11, 100 * YEAR]


@pytest.fixture
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreCase]:
    name = request.param
    if name in ("file", "memory"):
        directory = tmp_path / "locks"
        made: list[LockBackend] = []

        def second() -> LockBackend:
            made.append(FileBackend(str(directory)))
            return made[-1]

        if name == "file":
            backend: LockBackend = FileBackend(str(directory))
            url: str | None = f"file://{directory}"
        else:
            backend, url = MemoryBackend(), None
            second = lambda: backend  # noqa: E731 - one process, one store
        yield StoreCase(backend=backend, url=url, clock=None, second=second)
        for other in made:
            other.close()
        backend.close()
        return
    with STORES[name].open_store(tmp_path, request) as opened:
        try:
            yield opened
        finally:
            opened.backend.close()


def stores(*names: str) -> Any:
    return pytest.mark.parametrize("case", list(names), indirect=True)


def released(backend: LockBackend, key: str, outcome: Outcome = Outcome.SUCCEEDED) -> Record:
    lease = backend.try_acquire(key, Holder.current(), 30.0)
    assert lease is not None
    record = backend.release(lease, outcome)
    assert record is not None
    return record


def outcomes(backend: LockBackend, key: str) -> list[Outcome]:
    return [record.outcome for record in backend.history(key=key, limit=None)]


# -- pruning: retention reaching back before 1970 --------------------------------------------


@stores(*ALL)
@pytest.mark.parametrize("retention", RETENTIONS, ids=["1e11s", "100y"])
def test_a_retention_longer_than_the_epoch_prunes_nothing(
    case: StoreCase, retention: float
) -> None:
    """Nothing was released before 1970: S3 and GCS used to delete the whole history (their
    prune lists names after one of 18 digits, which sorts before every 17-digit name), and
    PostgreSQL failed every run on a date out of range."""
    backend = case.backend
    kept = released(backend, "job:keep:forever")
    counts = reap(backend, retention=retention)
    assert counts["pruned"] == 0
    assert backend.history(key="job:keep:forever") == [kept]


@stores(*OBJECT_STORES)
def test_an_object_store_prune_before_1970_deletes_nothing(case: StoreCase) -> None:
    backend = case.backend
    kept = released(backend, "job:keep:epoch")
    assert backend.prune_history(-1.0) == 0
    assert backend.history(key="job:keep:epoch") == [kept]


@stores("postgres")
def test_a_postgres_prune_before_year_one_deletes_nothing(case: StoreCase) -> None:
    backend = case.backend
    kept = released(backend, "job:keep:year-one")
    assert backend.prune_history(-1e11) == 0
    assert backend.history(key="job:keep:year-one") == [kept]


@stores("file", "memory", "redis")
@pytest.mark.parametrize("retention", [math.nan, math.inf, -math.inf, "30d", True], ids=repr)
def test_reap_refuses_a_retention_that_is_not_seconds_and_deletes_nothing(
    case: StoreCase, retention: Any
) -> None:
    """A NaN retention pruned the whole history of the file store (and failed on Redis and
    PostgreSQL after clearing); ``reap`` is called by users' own code and the CLI."""
    backend = case.backend
    kept = released(backend, "job:keep:bad-retention")
    with pytest.raises(ConfigurationError, match="retention"):
        reap(backend, retention=retention)
    assert backend.history(key="job:keep:bad-retention") == [kept]


@stores(*ALL)
def test_a_zero_retention_prunes_the_past_and_keeps_once_successes(case: StoreCase) -> None:
    """``retention=0``: every record released before the run goes; the success kept for
    ``once`` is not history and still answers ``last_success``, on every store."""
    backend = case.backend
    lease = backend.try_acquire("job:once:7", Holder.current(task_name="tasks.charge"), 30.0)
    assert lease is not None
    success = backend.release(lease, Outcome.SUCCEEDED, result={"charged": 7})
    assert success is not None
    released(backend, "job:once:7", Outcome.FAILED)
    time.sleep(0.05)
    reap(backend, retention=0)
    if backend.name != "file":  # the file store prunes whole days past retention
        assert backend.history(key="job:once:7") == []
    kept = backend.last_success("job:once:7", "tasks.charge")
    assert kept is not None and kept.result == {"charged": 7}
    assert kept.lease.token == lease.token


# -- reaping ---------------------------------------------------------------------------------


@stores("file", "postgres")
def test_the_wait_for_killed_holders_waits_for_the_store_s_own_judgement(
    case: StoreCase,
) -> None:
    """``gone`` (the wait the test below makes between its kills and its reap) asks what
    the janitor asks. A lease taken by this process's live session for the holder of a
    process that has exited: its pid is dead, so on the file store the holder is gone and
    the janitor reaps it, while on Postgres its lock session lives on and the janitor
    leaves it; ``gone`` must not return there. (It returned on the pid alone, at once, and
    the test below reaped 2 of 3 killed holders in CI: one server process had not yet
    ended its session.)"""
    backend = case.backend
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    dead = dataclasses.replace(Holder.current(), pid=int(exited.stdout))
    assert dead.is_gone()
    lease = backend.try_acquire("job:exited", dead, None)
    assert lease is not None
    if backend.name == "postgres":
        with pytest.raises(AssertionError, match="the store finds the killed holders gone"):
            gone(backend, [lease], timeout=0.5)
        assert reap(backend)["reaped"] == 0
        backend.release(lease, Outcome.SUCCEEDED)
    else:
        gone(backend, [lease], timeout=0.5)
        assert reap(backend)["disconnected"] == 1


@stores("file", "postgres")
def test_killed_holders_are_recorded_disconnected_once_and_live_ones_stay(
    case: StoreCase,
) -> None:
    """Holders SIGKILLed on odd keys, cleared one per batch: each is recorded once, as
    ``disconnected``, with its own key, fence, token and holder; leases of live holders
    (with a ttl and without) are left alone."""
    backend, url = case.backend, case.url
    assert url is not None
    keys = ["job:ünï cødé/ключ", 'job:100% {brace} "q" 🔒', "job:" + "x" * 300]
    spawned = [spawn_holder(url, key) for key in keys]
    live = backend.try_acquire("job:live:forever", Holder.current(), None)
    timed = backend.try_acquire("job:live:timed", Holder.current(), 60.0)
    assert live is not None and timed is not None
    for process, _ in spawned:
        kill(process)
    gone(backend, [lease for _, lease in spawned])
    cleared: list[Record] = []
    counts = reap(backend, batch=1, max_batches=10, cleared=cleared.append)
    assert (counts["reaped"], counts["disconnected"], counts["expired"]) == (3, 3, 0)
    assert sorted(record.key for record in cleared) == sorted(keys)
    for _, lease in spawned:
        (record,) = backend.history(key=lease.key, limit=None)
        assert record.outcome is Outcome.DISCONNECTED
        assert record.problem == "disconnected"
        assert (record.key, record.fence, record.lease.token) == (
            lease.key,
            lease.fence,
            lease.token,
        )
        assert record.lease.holder.pid == lease.holder.pid
        assert record.lease.holder.task_name == "tests.hold"
        assert backend.get(lease.key) is None
    for held in (live, timed):
        found = backend.get(held.key)
        assert found is not None and found.token == held.token
    assert reap(backend)["reaped"] == 0


@stores("file", "postgres")
def test_a_holder_alive_on_another_host_is_never_reaped(case: StoreCase) -> None:
    """A holder of another host whose pid is free here: the file store cannot see it, so
    it lives; PostgreSQL judges by the lock session, which is alive, never by the pid."""
    backend = case.backend
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    free_pid = int(child.stdout)
    here = Holder.current()
    elsewhere = Holder(
        "db-7.example",
        free_pid,
        here.started,
        "00000000-0000-0000-0000-000000000000/pid:[4026531836]",
        uuid.uuid4().hex[:16],
        task_name="tasks.remote",
    )
    lease = backend.try_acquire("job:remote:1", elsewhere, None)
    assert lease is not None
    assert reap(backend)["reaped"] == 0
    found = backend.get("job:remote:1")
    assert found is not None and found.token == lease.token
    assert backend.history(key="job:remote:1") == []


@stores(*ALL)
def test_a_release_racing_the_janitor_records_each_lease_once(case: StoreCase) -> None:
    """Holders release leases whose ttl ran out while a janitor clears them: each lease
    ends once, recorded by whichever came first, and a release refused (None) is the
    janitor's ``expired``."""
    backend, other = case.backend, case.second()
    keys = [f"job:race:{n}" for n in range(6)]
    leases = expired_leases(backend, keys, TTL)
    start = threading.Barrier(2)
    answers: dict[str, Record | None] = {}
    cleared: list[Record] = []

    def holders() -> None:
        start.wait()
        for lease in leases:
            answers[lease.key] = other.release(lease, Outcome.SUCCEEDED)

    def janitor() -> None:
        start.wait()
        reap(backend, batch=1, max_batches=20, cleared=cleared.append)

    threads = [threading.Thread(target=holders), threading.Thread(target=janitor)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    reap(backend)  # whatever the holders' refused releases left
    by_janitor = {record.key for record in cleared}
    for lease in leases:
        records = backend.history(key=lease.key, limit=None)
        assert len(records) == 1, records
        assert records[0].lease.token == lease.token
        if lease.key in by_janitor:
            assert answers[lease.key] is None
            assert records[0].outcome is Outcome.EXPIRED
        assert backend.get(lease.key) is None


@stores(*ALL)
def test_a_second_janitor_during_a_run_does_nothing(case: StoreCase) -> None:
    """Beat duplicated: a janitor started (on its own client) while another holds the
    janitor's lock clears nothing and says it skipped; the first clears every dead lease,
    each recorded once."""
    backend, other = case.backend, case.second()
    leases = expired_leases(backend, [f"job:dup:{n}" for n in range(3)], TTL)
    seconds: list[dict[str, int]] = []

    def second_janitor(_: Record) -> None:
        if not seconds:
            seconds.append(reap(other, batch=1))

    counts = reap(backend, batch=1, cleared=second_janitor)
    assert counts["reaped"] == 3 and counts["skipped"] == 0
    assert seconds == [{**dict.fromkeys(counts, 0), "skipped": 1}]
    for lease in leases:
        assert outcomes(backend, lease.key) == [Outcome.EXPIRED]
    assert outcomes(backend, janitor_key("job")) == [Outcome.SUCCEEDED]


@stores(*ALL)
def test_the_janitor_losing_its_own_lock_mid_run_still_clears_and_counts(
    case: StoreCase,
) -> None:
    """An operator force-releases the janitor's lock mid-run: the run finishes its work,
    its counts are right, and the next run is not skipped."""
    backend, other = case.backend, case.second()
    leases = expired_leases(backend, [f"job:lost:{n}" for n in range(3)], TTL)
    forced: list[Record | None] = []

    def operator(_: Record) -> None:
        if not forced:
            forced.append(force_release(other, janitor_key("job"), "stuck janitor"))

    counts = reap(backend, batch=1, cleared=operator)
    assert forced and forced[0] is not None
    assert counts["reaped"] == 3
    for lease in leases:
        assert outcomes(backend, lease.key) == [Outcome.EXPIRED]
    assert backend.get(janitor_key("job")) is None
    assert reap(backend)["skipped"] == 0


# -- the store down, a failed run --------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:1/0?retries=0&socket_connect_timeout=1",
        "postgresql://postgres@127.0.0.1:1/test?connect_timeout=1",
    ],
    ids=["redis", "postgres"],
)
def test_a_janitor_on_a_store_that_is_down_fails_with_a_backend_error(url: str) -> None:
    backend = backend_from_url(url)
    try:
        for quiet_for in (None, 3600.0):
            with pytest.raises(BackendError):
                reap(backend, retention=3600.0, quiet_for=quiet_for)
    finally:
        backend.close()


@stores("postgres")
def test_a_failed_run_does_not_keep_the_next_beat_runs_quiet(case: StoreCase) -> None:
    """Pruning failed (the store refused the delete): the run is recorded ``failed``. Once
    the store is fine again, the next beat run must prune and record a success, not stay
    quiet for the hour because "a run was recorded"."""
    backend, url = case.backend, case.url
    assert url is not None
    schema = url.split("schema=")[1].split("&")[0]
    old = released(backend, "job:old")
    time.sleep(0.05)
    admin = postgres_admin()
    try:
        admin.execute(
            f'CREATE FUNCTION "{schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS '
            "$$BEGIN RAISE EXCEPTION 'no deletes now'; END$$"
        )
        admin.execute(
            f'CREATE TRIGGER refuse BEFORE DELETE ON "{schema}".history '
            f'FOR EACH STATEMENT EXECUTE FUNCTION "{schema}".refuse()'
        )
        with pytest.raises(BackendError):
            reap(backend, retention=0, quiet_for=3600.0)
        assert outcomes(backend, janitor_key("job")) == [Outcome.FAILED]
        admin.execute(f'DROP TRIGGER refuse ON "{schema}".history')
    finally:
        admin.close()
    counts = reap(backend, retention=0, quiet_for=3600.0)
    assert counts["quiet"] == 0
    assert counts["pruned"] >= 2
    assert old not in backend.history(limit=None)
    assert outcomes(backend, janitor_key("job"))[0] is Outcome.SUCCEEDED


# -- the CLI -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--limit", "0"),
        ("--limit", "-5"),
        ("--limit", "x"),
        ("--retention", "-1"),
        ("--retention", "nan"),
        ("--retention", "1y"),
        ("--retention", "200000w"),
    ],
)
def test_cli_reap_refuses_bad_input_and_changes_nothing(
    tmp_path: Path, option: str, value: str
) -> None:
    url = f"file://{tmp_path}/locks"
    backend = FileBackend(f"{tmp_path}/locks")
    kept = released(backend, "job:keep:cli")
    result = cli("--backend", url, "reap", option, value)
    assert result.returncode == 2, result
    assert f"Error: Invalid value for '{option}'" in result.stderr
    assert backend.history(limit=None) == [kept]


def test_cli_reap_clears_no_more_than_its_limit(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/locks"
    backend = FileBackend(f"{tmp_path}/locks")
    for n in range(210):
        assert backend.try_acquire(f"job:many:{n:03d}", Holder.current(), 0.05) is not None
    time.sleep(0.1)
    result = cli("--backend", url, "reap", "--limit", "150", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["reaped"] == len(data["cleared"]) == 150
    assert len(backend.leases()) == 60 + 0
    backend.close()


def test_cli_reap_json_says_what_it_cleared_and_pruned(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/locks"
    backend = FileBackend(f"{tmp_path}/locks")
    lease = backend.try_acquire("job:cli:ünï 🔒", Holder.current(), 0.05)
    assert lease is not None
    time.sleep(0.1)
    result = cli("--backend", url, "reap", "--json", "--retention", "30d")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["reaped"], data["expired"], data["pruned"], data["retention"]) == (
        1,
        1,
        0,
        30 * 86400.0,
    )
    (entry,) = data["cleared"]
    assert (entry["key"], entry["fence"], entry["outcome"]) == (
        lease.key,
        lease.fence,
        "expired",
    )
    assert outcomes(backend, lease.key) == [Outcome.EXPIRED]


@stores("memory", "redis")
def test_reap_clears_no_more_than_its_limit_across_batches(case: StoreCase) -> None:
    """``limit``: the total a run may clear, whatever the batch (the CLI's ``--limit``)."""
    backend = case.backend
    expired_leases(backend, [f"job:cap:{n}" for n in range(7)], TTL)
    assert reap(backend, batch=3, limit=5)["reaped"] == 5
    assert reap(backend, batch=3, limit=5)["reaped"] == 2


@pytest.mark.parametrize(
    "sizes", [{"batch": 0}, {"max_batches": -1}, {"limit": 0}, {"batch": 2.5}, {"limit": True}]
)
def test_reap_refuses_batch_sizes_that_are_not_counts(sizes: dict[str, Any]) -> None:
    backend = MemoryBackend()
    with pytest.raises(ConfigurationError, match=next(iter(sizes))):
        reap(backend, **sizes)
    assert backend.history(limit=None) == []
