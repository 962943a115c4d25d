"""A worker whose ``dlock_*`` settings are bad refuses to start, naming the problem: it
used to start, and fail every task for good, its message consumed and the work lost. A real
``celery worker`` process on the test app."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.celery.prefork import BROKER_DB, HERE, RESULTS_DB


@pytest.mark.parametrize(
    ("lock_url", "message"),
    [
        ("redsi://127.0.0.1:6379/1", "no lock backend for URL scheme 'redsi'"),
        ("redis://127.0.0.1:6379/1?prefx=oops", "unknown option 'prefx'"),
    ],
)
def test_a_worker_with_a_bad_lock_store_url_refuses_to_start(
    tmp_path: Path, redis_url: str, lock_url: str, message: str
) -> None:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("DLOCK_TEST_")}
    env = {
        **inherited,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "DLOCK_TEST_BROKER": f"{redis_url}/{BROKER_DB}",
        "DLOCK_TEST_RESULTS": f"{redis_url}/{RESULTS_DB}",
        "DLOCK_TEST_LOCKS": lock_url,
        "DLOCK_TEST_LEDGER": str(tmp_path / "ledger.jsonl"),
        "DLOCK_TEST_QUEUE": f"q-refused-{os.getpid()}",
    }
    args = [sys.executable, "-m", "celery", "-A", "workerapp", "worker", "--pool=solo",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    try:
        done = subprocess.run(args, check=False, env=env, cwd=HERE, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the worker started and ran for 60 s: {exc.stderr!r}")
    output = (done.stdout + done.stderr).decode()
    assert done.returncode != 0
    assert message in output
