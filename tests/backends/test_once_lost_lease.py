"""``once`` never forgets a success, whatever happened to the lease: the double charge that a
Postgres restart during charges once caused (a body whose lease was lost succeeded, its
success was not kept, and a duplicate charged again).

For every store that processes share: a ``once`` task's body runs in a process of its own
(``tests/support/once_runner.py``), its lease is lost while the body runs, by the store's own rule
(Postgres: the lock session is terminated; the lease stores and the file store with a ttl:
the process is stopped past its ttl, as a long GC pause or a frozen VM would), the body
returns, and the duplicate that comes after replays the stored result without running the
body. The Postgres server restart is in ``test_postgres_restart.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import Outcome
from tests.backends.storecase import StoreCase
from tests.support import eventually
from tests.support.services import lease_session_pids, postgres_admin

pytestmark = pytest.mark.slow

RUNNER = Path(__file__).parent.parent / "support" / "once_runner.py"
TASK = "t.lost_charge"
TTL = 1.0


def runner(url: str, namespace: str, tmp: Path, order: str, **options: Any) -> list[str]:
    args = [sys.executable, str(RUNNER), url, namespace, str(tmp), order]
    if options.get("ttl") is not None:
        args += ["--ttl", str(options["ttl"])]
    if options.get("hold"):
        args.append("--hold")
    return args


def result_of(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def runs(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "runs"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def lose_lease(store: StoreCase, process: subprocess.Popen[str], held: dict[str, Any]) -> str:
    """Lose the held lease by the store's own rule while the body waits; how, in words."""
    backend = store.backend
    if backend.capabilities.liveness == "session":
        schema = backend.schema  # type: ignore[attr-defined]
        admin = postgres_admin()
        try:
            [pid] = lease_session_pids(admin, schema, held["fence"])
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            eventually(lambda: not lease_session_pids(admin, schema, held["fence"]), "session gone")
        finally:
            admin.close()
        return "lock session terminated"
    os.kill(process.pid, signal.SIGSTOP)
    try:
        time.sleep(TTL + 1.5)  # the lease expires while its holder is stopped
    finally:
        os.kill(process.pid, signal.SIGCONT)
    return "expired while stopped"


def test_a_success_after_a_lost_lease_is_kept_and_the_duplicate_replays_it(
    store: StoreCase, tmp_path: Path
) -> None:
    if store.url is None:
        pytest.skip("not applicable: the memory store lives in one process")
    backend = store.backend
    ttl = None if backend.capabilities.liveness == "session" else TTL
    namespace = f"lost{uuid.uuid4().hex[:8]}"
    key = f"{namespace}:order:42"
    with subprocess.Popen(  # the pipes are closed on the way out, whatever failed
        runner(store.url, namespace, tmp_path, "42", ttl=ttl, hold=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as first:
        try:
            eventually((tmp_path / "held").exists, "the body runs", timeout=60)
            held = json.loads((tmp_path / "held").read_text())
            lose_lease(store, first, held)
            (tmp_path / "go").touch()
            charged = result_of(first)
        finally:
            if first.poll() is None:
                first.kill()

    # The lease was lost: the release says so in the history, naming what it could not record.
    lost = [r for r in backend.history(key=key, limit=None) if r.lease.token == held["token"]]
    assert Outcome.LOST in [r.outcome for r in lost], lost
    [record] = [r for r in lost if r.outcome is Outcome.LOST]
    assert record.details is not None
    assert record.details.startswith("succeeded not recorded"), record.details
    assert "kept for once" in record.details
    # ... and the success is kept all the same.
    success = backend.last_success(key, TASK)
    assert success is not None and success.lease.token == held["token"]
    assert success.result == {"value": charged}

    duplicate = subprocess.run(
        runner(store.url, namespace, tmp_path, "42", ttl=ttl),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert duplicate.returncode == 0, duplicate.stderr[-3000:]
    assert json.loads(duplicate.stdout.strip().splitlines()[-1]) == charged
    assert [run["token"] for run in runs(tmp_path)] == [held["token"]]  # one body, ever
    skipped = backend.history(key=key, outcome=Outcome.SKIPPED)
    assert [r.problem for r in skipped] == ["once"]
