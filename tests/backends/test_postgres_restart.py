"""Postgres restarted during a contention run: no two live leases overlap, and a holder
whose session died with the server sees its lease lost.

This test restarts the local cluster (``pg_ctlcluster ... restart -m fast``), which cuts every
session on the machine for a second or two; it is marked slow and makes sure the server is
up again when it ends. Set ``DLOCK_PG_RESTART`` to the command for another setup, or to an
empty string to skip.

Run as a script, this file is the contender and the long holder that the test starts.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _default_restart() -> str:
    """The Debian cluster's restart command, for the version installed here."""
    versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    if not versions:
        return ""
    return f"pg_ctlcluster --skip-systemctl-redirect {versions[-1]} main restart -m fast"


RESTART = os.environ.get("DLOCK_PG_RESTART", _default_restart())

# Restarting the Postgres every test shares: run while no other test does.
pytestmark = pytest.mark.exclusive
CONTENDERS = 4


# -- the processes the test starts -----------------------------------------------------------


def contend(url: str, key: str, log: Path, stop: Path) -> None:
    """Take and release ``key`` until ``stop`` exists; log each lease with its times and
    whether its release found it still ours (``ok``), lost (``lost``) or failed (``error``)."""
    from celery_dlock import BackendError, Lock, LockNotAcquiredError, backend_from_url

    backend = backend_from_url(url)
    with log.open("a") as out:
        while not stop.exists():
            lock = Lock(backend, key, wait=1.0)
            try:
                lease = lock.acquire()
            except LockNotAcquiredError:
                continue
            except BackendError:
                time.sleep(0.05)  # the server is restarting: try again shortly
                continue
            acquired = time.time()  # wall clock: compared with the server's start time
            releasing = time.time()
            try:
                result = "ok" if lock.release() is not None else "lost"
            except BackendError:
                result = "error"
            line = {"fence": lease.fence, "token": lease.token, "result": result}
            line |= {"acquired": acquired, "released": releasing, "pid": os.getpid()}
            out.write(json.dumps(line) + "\n")
            out.flush()
    backend.close()


def hold(url: str, key: str, ready: Path, go: Path) -> None:
    """Take ``key``, write the lease to ``ready``, release when ``go`` exists; the result
    goes to ``go`` + ``.result``."""
    from celery_dlock import BackendError, Lock, LockNotAcquiredError, backend_from_url

    backend = backend_from_url(url)
    lock = Lock(backend, key, wait=1.0)
    while True:
        try:
            lease = lock.acquire()
            break
        except (LockNotAcquiredError, BackendError):
            continue
    acquired = time.time()
    whole(ready, {**lease.to_dict(), "acquired": acquired})
    while not go.exists():
        time.sleep(0.01)
    releasing = time.time()
    try:
        result = "ok" if lock.release() is not None else "lost"
    except BackendError as exc:
        result = f"error: {exc}"
    whole(Path(f"{go}.result"), {"result": result, "released": releasing})
    backend.close()


# -- the test -------------------------------------------------------------------------------


def whole(path: Path, value: dict[str, Any]) -> None:
    """Write ``value`` to ``path`` whole or not at all: the test polls for the file."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value))
    os.replace(part, path)


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def server_up(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True


def restart_server(command: str = RESTART) -> tuple[float, float, float]:
    """Restart the server (``RESTART``, or ``command``); (before, its new start, after) on
    the wall clock."""
    from tests.backends.stores.postgres import SERVER_URL, admin_connection
    from tests.support import eventually  # not at the top: this file is also a script

    before = time.time()
    subprocess.run(shlex.split(command), check=True, capture_output=True, timeout=120)
    eventually(lambda: server_up(SERVER_URL), "the server back")
    after = time.time()
    admin = admin_connection()
    row = admin.execute("SELECT extract(epoch FROM pg_postmaster_start_time())").fetchone()
    admin.close()
    return before, float(row[0]), after


def ensure_server_up() -> None:
    from tests.backends.stores.postgres import SERVER_URL
    from tests.support import eventually  # not at the top: this file is also a script

    if not server_up(SERVER_URL):
        start = RESTART.replace(" restart", " start").replace(" -m fast", "")
        subprocess.run(shlex.split(start), check=False, timeout=120)
        eventually(lambda: server_up(SERVER_URL), "the server up again")


def stop_all(processes: list[subprocess.Popen[bytes]], *touch: Path) -> None:
    for path in touch:
        path.touch()
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def check_leases(leases: list[dict[str, Any]], before: float, started: float) -> None:
    """No lease whose release found it ours overlapped any other lease; fences in order."""
    for lease in leases:
        if lease["acquired"] < before and lease["released"] > started:
            assert lease["result"] != "ok", lease  # held across the restart: cannot be ours
        # A lost lease ended with its session. A fast shutdown ends the sessions one by one
        # from the moment it begins (``before``): a session still alive may then take over a
        # key whose holder's session is already gone, rightly, while that holder runs on
        # until its release says ``lost`` (the fence is for that holder's late writes).
        ended = lease["released"] if lease["result"] == "ok" else before
        lease["valid_until"] = min(lease["released"], ended)
    ok = sorted((e for e in leases if e["result"] == "ok"), key=lambda e: e["acquired"])
    assert len(ok) >= CONTENDERS * 6
    for lease in ok:
        overlapping = [
            other
            for other in leases
            if other is not lease
            and other["acquired"] < lease["valid_until"]
            and lease["acquired"] < other["valid_until"]
        ]
        assert overlapping == [], (lease, overlapping)
    backwards = [(a, b) for a, b in itertools.pairwise(ok) if a["fence"] >= b["fence"]]
    assert backwards == []


@pytest.fixture
def store() -> Iterator[tuple[str, Any]]:
    """A migrated schema of its own: its URL and a backend on it (not at the top: this
    file is also a script); skipped where the server cannot be restarted."""
    if not RESTART:
        pytest.skip("DLOCK_PG_RESTART is empty: no way to restart the server here")
    from celery_dlock.backends.postgres import PostgresBackend
    from tests.backends.stores.postgres import (
        SERVER_URL,
        admin_connection,
        drop_schema,
        with_options,
    )

    schema = f"dlock_t_{os.urandom(6).hex()}"
    url = with_options(SERVER_URL, schema=schema)
    checker = PostgresBackend.from_url(url)
    checker.migrate()
    try:
        yield url, checker
    finally:
        ensure_server_up()
        checker.close()
        admin = admin_connection()
        drop_schema(admin, schema)
        admin.close()


@pytest.mark.slow
def test_restart_during_contention_loses_leases_and_never_overlaps(
    tmp_path: Path, store: tuple[str, Any]
) -> None:
    from celery_dlock import Outcome
    from tests.support import eventually  # not at the top: this file is also a script

    url, checker = store
    key, stop, go, ready = "job:restart", tmp_path / "stop", tmp_path / "go", tmp_path / "ready"
    logs = [tmp_path / f"contender-{n}.jsonl" for n in range(CONTENDERS)]
    me = str(Path(__file__))
    processes = [
        subprocess.Popen([sys.executable, me, "contend", url, key, str(log), str(stop)])
        for log in logs
    ]
    result = Path(f"{go}.result")
    try:
        eventually(lambda: all(len(lines(log)) >= 3 for log in logs), "contention before")
        processes.append(
            subprocess.Popen([sys.executable, me, "hold", url, key, str(ready), str(go)])
        )
        held = eventually(lambda: ready.exists() and json.loads(ready.read_text()), "the holder")
        before, started, after = restart_server()
        assert before < started < after

        def taken_over() -> bool:
            try:
                records = checker.history(key=key, limit=None)
            except Exception:
                return False
            return any(r.lease.token == held["token"] for r in records)

        eventually(taken_over, "the dead holder's lease taken over")
        go.touch()
        released = eventually(
            lambda: result.exists() and json.loads(result.read_text()), "the holder's release"
        )
        eventually(
            lambda: all(sum(e["acquired"] > after for e in lines(log)) >= 3 for log in logs),
            "contention after",
        )
    finally:
        stop_all(processes, stop, go)
        ensure_server_up()
    assert released["result"] == "lost"  # its session died with the server
    records = checker.history(key=key, limit=None)
    ended = {r.outcome: r for r in records if r.lease.token == held["token"]}
    # Taken over as disconnected; the holder's own release, after, recorded lost.
    assert set(ended) == {Outcome.DISCONNECTED, Outcome.LOST}
    assert ended[Outcome.LOST].released_at > ended[Outcome.DISCONNECTED].released_at
    leases = [entry for log in logs for entry in lines(log)]
    leases.append({**held, "released": released["released"], "result": "lost"})
    check_leases(leases, before, started)


@pytest.mark.slow
def test_a_once_success_across_a_restart_is_kept_and_the_duplicate_replays_it(
    tmp_path: Path, store: tuple[str, Any]
) -> None:
    """The double charge found by a restart during charges: the body's lock session dies
    with the server, the body succeeds after it, and the duplicate that comes after must
    replay that success instead of charging again."""
    from celery_dlock import Outcome
    from tests.support import eventually

    url, checker = store
    runner = [sys.executable, str(Path(__file__).parent.parent / "support" / "once_runner.py")]
    first = subprocess.Popen(
        [*runner, url, "job", str(tmp_path), "42", "--hold"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        held = eventually(
            lambda: (tmp_path / "held").exists() and json.loads((tmp_path / "held").read_text()),
            "the body runs",
            timeout=60,
        )
        restart_server()
        (tmp_path / "go").touch()
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, err[-3000:]
        charged = json.loads(out.strip().splitlines()[-1])
        duplicate = subprocess.run(
            [*runner, url, "job", str(tmp_path), "42"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert duplicate.returncode == 0, duplicate.stderr[-3000:]
        assert json.loads(duplicate.stdout.strip().splitlines()[-1]) == charged
        runs = (tmp_path / "runs").read_text().splitlines()
        assert [json.loads(run)["token"] for run in runs] == [held["token"]]  # charged once
        kept = checker.last_success("job:order:42", "t.lost_charge")
        assert kept is not None and kept.lease.token == held["token"]
        [lost] = checker.history(key="job:order:42", outcome=Outcome.LOST)
        assert str(lost.details).startswith("succeeded not recorded")
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()


@pytest.mark.slow
def test_a_release_the_crashed_server_refused_is_recorded_lost_at_the_next_release(
    store: tuple[str, Any],
) -> None:
    """The server crashes (``-m immediate``) while a lease is held and is down when the
    holder releases: the release raises, and the crash empties the locks table, so no
    taker and no janitor will ever see that lease. Its record comes from this process's
    next release that reaches the server: ``lost``, naming the outcome it could not record
    (before: no record at all)."""
    from celery_dlock import BackendError, Lock, Outcome, backend_from_url
    from tests.support import eventually

    url, checker = store
    backend = backend_from_url(url)
    lock = Lock(backend, "job:crashed")
    lease = lock.acquire()
    stop = RESTART.replace(" restart", " stop").replace("-m fast", "-m immediate")
    subprocess.run(shlex.split(stop), check=True, capture_output=True, timeout=120)
    try:
        with pytest.raises(BackendError):
            lock.release(Outcome.FAILED, "Boom", "the report failed")
    finally:
        ensure_server_up()
    assert checker.history(key="job:crashed") == []  # the crash took the lease row with it
    # The next release this process makes reaches the server, and settles the earlier one.
    eventually(lambda: _released(backend, Lock), "a release after the crash")
    [record] = checker.history(key="job:crashed")
    assert record.lease.token == lease.token and record.outcome is Outcome.LOST
    assert str(record.details).startswith("failed not recorded")
    assert "Boom" in str(record.details)
    backend.close()


@pytest.mark.slow
def test_idle_sessions_a_crash_restart_ended_are_replaced_before_the_next_acquire(
    store: tuple[str, Any],
) -> None:
    """A crash restart (``-m immediate``, as when another session crashes) tells each
    session by a WARNING with a shutdown's SQLSTATE (57P01), not by a FATAL: the idle lock
    sessions, blocking and asyncio, were taken as alive, and the first acquire on each
    failed with a ``BackendError`` (a producer's ``apply_async`` raised; a worker's task
    was re-queued). Each is replaced, and the acquire after the restart is granted."""
    import asyncio

    from celery_dlock import AsyncLock, Lock, Outcome, backend_from_url

    url, checker = store
    backend = backend_from_url(url)
    crash = RESTART.replace("-m fast", "-m immediate")

    async def on_a_loop() -> list[Any]:
        async with AsyncLock(backend, "job:loop:before"):
            pass  # this loop's session: idle from here
        with Lock(backend, "job:before"):
            pass  # the blocking session: idle from here
        try:
            restart_server(crash)
        finally:
            ensure_server_up()
        async with AsyncLock(backend, "job:loop:after") as looped:
            pass
        with Lock(backend, "job:after") as blocking:
            pass
        return [looped, blocking]

    leases = asyncio.run(on_a_loop())
    assert [lease.key for lease in leases] == ["job:loop:after", "job:after"]
    for lease in leases:
        [record] = checker.history(key=lease.key)
        assert (record.lease.token, record.outcome) == (lease.token, Outcome.SUCCEEDED)
    backend.close()


def _released(backend: Any, lock_type: Any) -> bool:
    from celery_dlock import BackendError

    try:
        with lock_type(backend, "job:after-the-crash"):
            return True
    except BackendError:
        return False  # still starting up


if __name__ == "__main__":
    logging.getLogger("celery_dlock").setLevel(logging.CRITICAL)
    mode, *arguments = sys.argv[1:]
    if mode == "contend":
        contend(arguments[0], arguments[1], Path(arguments[2]), Path(arguments[3]))
    else:
        hold(arguments[0], arguments[1], Path(arguments[2]), Path(arguments[3]))
