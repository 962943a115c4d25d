"""The torture harness (``python -m bench.torture``) in its short mode, one test per store,
and once on a deliberately broken lock to show that its checker can fail.

Each run is real: private servers on free ports (never the shared ones), 16 worker processes
through the public ``Lock``, real SIGKILLs, SIGSTOPs and store restarts. Run one store alone
with ``pytest tests/test_torture.py -k redis``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import unavailable

REPO = Path(__file__).resolve().parents[1]
PG_BIN = Path(os.environ.get("DLOCK_TORTURE_PG_BIN", "/usr/lib/postgresql/15/bin"))

pytestmark = pytest.mark.slow


def require(store: str) -> None:
    """Skip (visibly) where the store's private server cannot be started, or the shared
    PostgreSQL that holds the Postgres run's ledger is not there."""
    if store == "redis" and shutil.which("redis-server") is None:
        unavailable("redis-server is not installed (apt-get install redis-server)")
    if store == "postgres":
        if not (PG_BIN / "initdb").exists():
            unavailable(f"no initdb in {PG_BIN} (set DLOCK_TORTURE_PG_BIN)")
        from tests.support.services import postgres_admin

        postgres_admin().close()


def torture(tmp_path: Path, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    """Run the harness; its exit code, its JSON reports and its output."""
    out = tmp_path / "reports.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.torture", *args, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert out.exists(), output
    return done.returncode, json.loads(out.read_text()), output


@pytest.mark.parametrize("store", ["file", "postgres", "redis"])
def test_short_run_keeps_every_invariant(store: str, tmp_path: Path) -> None:
    require(store)
    code, [report], output = torture(tmp_path, "--store", store, "--short")
    assert report["problems"] == [], output
    assert (report["violations"], code) == (0, 0), output
    assert report["acquisitions"] >= 1000, output
    faults = (report["kills"], report["pauses"], report["restarts"])
    assert faults == (4, 1, 0 if store == "file" else 2), output
    assert report["killed_in_section"] >= 1, output
    assert report["records_checked"] == report["acquisitions"], output


def test_checker_reports_violations_of_a_broken_lock(tmp_path: Path) -> None:
    code, [report], output = torture(
        tmp_path, "--store", "file", "--broken", "--seconds", "4", "--kills", "0", "--pauses", "0"
    )
    assert code == 1, output
    assert report["violations"] > 0
    assert report["overlaps"] > 0
    assert any("accepted writes" in problem for problem in report["problems"]), output
