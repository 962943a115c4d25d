"""``celery-dlock run`` tried as an operator would: a forced release must stop the command on
every store within seconds (not at the next renewal, nor never), and ``--lost-grace`` takes
only a duration it can keep."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from celery_dlock.records import Outcome
from tests.cli.clitools import CliStore, run_cli
from tests.cli.test_cli_run_trial import KEY, finish, sleeper, start
from tests.support import eventually


def test_a_forced_release_stops_a_command_run_without_ttl_within_seconds(
    store: CliStore, tmp_path: Path
) -> None:
    """Found by trying: without --ttl the file store's runner never learnt of the forced
    release (its command ran to its end beside the next holder, exit 0), and Redis's only at
    the next renewal, 20 s later with the URL's default ttl of 60 s."""
    started = tmp_path / "started"
    runner = start(store, KEY, "--", *sleeper(started))
    try:
        eventually(started.exists, "the command started")
        forced = json.loads(
            run_cli("--backend", store.url, "release", "--force", "--json", KEY).stdout
        )
        code = runner.wait(timeout=10)  # old: the file store's never, Redis's after 20 s
    finally:
        err = finish(runner)
    assert forced["released"] and code == 128 + signal.SIGTERM
    assert b"was lost while the command runs" in err
    token = forced["lease"]["token"]
    ended = {r.outcome for r in store.backend.history(key=KEY) if r.lease.token == token}
    assert ended == {Outcome.FORCED, Outcome.LOST}
    assert store.backend.get(KEY) is None


def test_a_command_that_ends_by_itself_is_not_taken_for_a_lost_lease(
    store: CliStore,
) -> None:
    """The runner's own release after the command exits is not a lost lease."""
    result = run_cli("--backend", store.url, "run", KEY, "--", "sleep", "2.5")
    assert result.returncode == 0, result.stderr
    assert "lost" not in result.stderr
    [record] = store.backend.history(key=KEY)
    assert record.outcome is Outcome.SUCCEEDED


@pytest.mark.parametrize("grace", ["inf", "nan", "1e300", "-1"])
def test_lost_grace_that_no_timer_can_keep_is_a_usage_error(
    file_store: CliStore, grace: str
) -> None:
    """Found by trying: inf and 1e300 were taken, and when the lease was lost the SIGKILL
    timer died with an OverflowError traceback (a command ignoring SIGTERM ran on beside the
    next holder); nan killed at once, saying 'SIGKILL in nan s'."""
    result = run_cli("--backend", file_store.url, "run", "--lost-grace", grace, KEY, "--", "true")
    assert result.returncode == 2
    assert "--lost-grace" in result.stderr and "Traceback" not in result.stderr
    assert file_store.backend.history(key=KEY) == []  # nothing run


def test_lost_grace_takes_a_duration(file_store: CliStore) -> None:
    result = run_cli("--backend", file_store.url, "run", "--lost-grace", "2m", KEY, "--", "true")
    assert result.returncode == 0, result.stderr
