"""``history`` tried with filters that contradict each other."""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_dlock.records import Holder, Outcome
from tests.cli.clitools import CliStore, run_cli


def test_problems_with_an_outcome_that_is_no_problem_is_a_usage_error(
    file_store: CliStore,
) -> None:
    """Found by trying: `--problems --outcome succeeded` said 'no history records match'
    (exit 0) on a store full of successes, as if there were none."""
    lease = file_store.backend.try_acquire("job:a", Holder.current(task_name="t"), None)
    assert lease is not None
    file_store.backend.release(lease, Outcome.SUCCEEDED)
    result = run_cli("--backend", file_store.url, "history", "--problems", "--outcome", "succeeded")
    assert result.returncode == 2
    assert "--outcome succeeded is not a problem: --problems shows failed, revoked" in result.stderr
    kept = run_cli("--backend", file_store.url, "history", "--problems", "--outcome", "failed")
    assert kept.returncode == 0 and "no history records match" in kept.stdout


def test_the_page_refuses_the_same_contradiction(file_store: CliStore, tmp_path: Path) -> None:
    """The page's filters had the same fault: an empty history, status 200."""
    pytest.importorskip("flask")
    pytest.importorskip("waitress")
    from tests.cli.test_cli_serve import Server

    server = Server(file_store.url, tmp_path)
    try:
        status, text = server.get("/?problems=1&outcome=succeeded")
        assert status == 400, text
        assert "outcome: succeeded is not a problem" in text
        assert server.get("/?problems=1&outcome=failed")[0] == 200
    finally:
        server.stop()
