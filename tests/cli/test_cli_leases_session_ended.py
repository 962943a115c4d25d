"""On PostgreSQL with session liveness, a lease whose holder's lock session has ended (its
process killed, its connection cut) is dead by the store's own rule, and the listings say so
before the janitor's ``reap`` runs: ``get()`` and ``leases()`` give it a holder that
``is_gone()``, ``leases --json`` has ``holder_gone`` with ``holder_gone_because`` ``lock
session ended``, and the table marks it ``[gone] (lock session ended)``. That holds for a
holder of another host, whose process no check on this one can judge, and for a holder
whose process lives on while its session is gone. A live holder's lease is not marked; with
``liveness=ttl`` (no sessions) a lease lives by its ttl and nothing is marked either."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import backend_from_url
from celery_dlock.backends.base import LockBackend
from celery_dlock.records import Lease, Outcome
from tests.cli.clitools import CliStore, environment, run_cli
from tests.support import eventually
from tests.support.holders import kill, spawn_holder
from tests.support.services import lease_session_pids, postgres_admin, with_options

HOLD_ELSEWHERE = Path(__file__).parent / "hold_elsewhere.py"
ENDED = "lock session ended"


@pytest.fixture
def admin() -> Iterator[Any]:
    connection = postgres_admin()
    yield connection
    connection.close()


def hold_elsewhere(url: str, key: str) -> tuple[subprocess.Popen[str], Lease]:
    """A process holding ``key`` as a holder of another host, and its lease."""
    process = subprocess.Popen(
        [sys.executable, str(HOLD_ELSEWHERE), url, key],
        stdout=subprocess.PIPE,
        text=True,
        env=environment(None),  # the checkout under test, as the commands get
    )
    assert process.stdout is not None
    data = json.loads(process.stdout.readline() or "null")
    if data is None:
        kill(process)
        raise AssertionError(f"the holder process did not get {key!r}")
    return process, Lease.from_dict(data)


def session_gone(admin: Any, store: CliStore, lease: Lease) -> None:
    """Wait until no session holds ``lease``'s advisory lock (the server has seen its end)."""
    schema = store.backend.schema  # type: ignore[attr-defined]
    eventually(
        lambda: not lease_session_pids(admin, schema, lease.fence),
        f"the server ended the lock session of {lease.key}",
    )


def listed(url: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``leases --all --json`` by key, and the rows of ``leases --all`` by key."""
    as_json = run_cli("--backend", url, "leases", "--all", "--json")
    assert as_json.returncode == 0, as_json.stderr
    table = run_cli("--backend", url, "leases", "--all")
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    return {entry["key"]: entry for entry in json.loads(as_json.stdout)["leases"]}, rows


def api_gone(backend: LockBackend) -> dict[str, bool]:
    """Whether each listed lease's holder is gone, by ``leases()`` and by ``get()``."""
    by_listing = {lease.key: lease.holder.is_gone() for lease in backend.leases("")}
    by_get = {}
    for key in by_listing:
        lease = backend.get(key)
        assert lease is not None
        by_get[key] = lease.holder.is_gone()
    assert by_get == by_listing
    return by_listing


def test_a_killed_holder_of_another_host_is_listed_gone_before_any_reap(
    pg_store: CliStore, admin: Any
) -> None:
    dead_process, dead = hold_elsewhere(pg_store.url, "job:order:1")
    live_process, _ = spawn_holder(pg_store.url, "job:order:2")
    try:
        kill(dead_process)
        session_gone(admin, pg_store, dead)

        assert api_gone(pg_store.backend) == {"job:order:1": True, "job:order:2": False}
        by_key, rows = listed(pg_store.url)
        assert (by_key["job:order:1"]["holder_gone"], by_key["job:order:1"]["token"]) == (
            True,
            dead.token,
        )
        assert by_key["job:order:1"]["holder_gone_because"] == ENDED
        assert by_key["job:order:1"]["holder"] == dead.holder.to_dict()
        assert f"[gone] ({ENDED})" in rows["job:order:1"], rows
        assert by_key["job:order:2"]["holder_gone"] is False
        assert by_key["job:order:2"]["holder_gone_because"] is None
        assert "[gone]" not in rows["job:order:2"], rows

        # Listed, not cleared: the lease and its fence are there, nothing is recorded yet...
        still = pg_store.backend.get("job:order:1")
        assert still is not None and (still.token, still.fence) == (dead.token, dead.fence)
        assert pg_store.backend.history(key="job:order:1") == []
        # ...and the janitor's step agrees with the listing.
        reaped = {record.key: record for record in pg_store.backend.reap()}
        assert set(reaped) == {"job:order:1"}
        assert reaped["job:order:1"].outcome is Outcome.DISCONNECTED
        assert reaped["job:order:1"].lease.token == dead.token
    finally:
        kill(live_process)


def test_a_holder_whose_session_was_cut_while_its_process_lives_is_listed_gone(
    pg_store: CliStore, admin: Any
) -> None:
    process, lease = spawn_holder(pg_store.url, "job:order:3")
    try:
        schema = pg_store.backend.schema  # type: ignore[attr-defined]
        [pid] = lease_session_pids(admin, schema, lease.fence)
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        session_gone(admin, pg_store, lease)
        assert process.poll() is None  # the holder's process runs on

        assert api_gone(pg_store.backend) == {"job:order:3": True}
        by_key, rows = listed(pg_store.url)
        assert by_key["job:order:3"]["holder_gone"] is True
        assert by_key["job:order:3"]["holder_gone_because"] == ENDED
        assert f"[gone] ({ENDED})" in rows["job:order:3"], rows
    finally:
        kill(process)


def test_with_liveness_ttl_a_killed_holder_is_not_listed_gone(pg_store: CliStore) -> None:
    url = with_options(pg_store.url, liveness="ttl", ttl=3600)
    with backend_from_url(url) as backend:
        process, lease = hold_elsewhere(url, "job:order:4")
        kill(process)
        held = backend.get("job:order:4")
        assert held is not None and held.token == lease.token
        assert held.expires_at is not None  # it lives by its ttl, whatever became of it

        assert api_gone(backend) == {"job:order:4": False}
        by_key, rows = listed(url)
        assert by_key["job:order:4"]["holder_gone"] is False
        assert by_key["job:order:4"]["holder_gone_because"] is None
        assert 0 < by_key["job:order:4"]["expires_in"] <= 3600
        assert "[gone]" not in rows["job:order:4"], rows
        assert backend.reap() == []  # nor does the janitor clear it before its ttl
