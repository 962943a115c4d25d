"""A worker whose ``dlock_*`` settings are bad refuses to start, naming the problem: it
used to start, and fail every task for good, its message consumed and the work lost. A real
``celery worker`` process on the test app."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.celery.prefork import HERE
from tests.celery.test_dedupe import producer_env


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
    env = producer_env(tmp_path, redis_url, lock_url)  # a queue no other worker reads
    args = [sys.executable, "-m", "celery", "-A", "workerapp", "worker", "--pool=solo",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    try:
        done = subprocess.run(args, check=False, env=env, cwd=HERE, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the worker started and ran for 60 s: {exc.stderr!r}")
    output = (done.stdout + done.stderr).decode()
    assert done.returncode != 0
    assert message in output
