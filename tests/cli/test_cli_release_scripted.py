"""``release`` tried as an operator (or an operator's script) would use it: a script can pin
the lease it chose, and a question nobody answers, or Ctrl-C at it, ends as documented."""

from __future__ import annotations

import json
import os
import signal

from celery_dlock.records import Holder, Lease
from tests.cli.clitools import COMMAND_TIMEOUT, CliStore, popen_cli, run_cli

KEY = "job:order:42"


def hold(store: CliStore) -> Lease:
    lease = store.backend.try_acquire(KEY, Holder.current(task_name="tests.charge"), None)
    assert lease is not None
    return lease


def test_fence_releases_only_the_lease_the_script_chose(store: CliStore) -> None:
    """Found by trying: a script that picked a gone holder's lease from `leases --json` and
    ran `release --force KEY` released whatever lease was on KEY by then, a live holder's
    after a takeover; nothing let it say which lease it meant."""
    live = hold(store)
    stale = live.fence + 1000  # the fence of a lease that is no longer on the key
    refused = run_cli("--backend", store.url, "release", "--force", "--fence", str(stale), KEY)
    assert refused.returncode == 1, refused.stderr
    assert f"has fence {live.fence}, not {stale}" in refused.stderr
    assert store.backend.get(KEY) == live
    data = json.loads(
        run_cli(
            "--backend", store.url, "release", "--force", "--fence", str(stale), "--json", KEY
        ).stdout
    )
    assert (data["status"], data["released"], data["current"]["token"]) == (
        "changed",
        False,
        live.token,
    )
    released = run_cli(
        "--backend", store.url, "release", "--force", "--fence", str(live.fence), KEY
    )
    assert released.returncode == 0, released.stderr
    assert store.backend.get(KEY) is None


def test_an_unanswered_question_is_a_no_that_json_reports(file_store: CliStore) -> None:
    """Found by trying: with stdin closed (cron, a script without --force) `--json` printed
    no JSON at all, only click's 'Aborted!'."""
    live = hold(file_store)
    result = run_cli("--backend", file_store.url, "release", "--json", KEY, input="")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert (data["status"], data["released"]) == ("declined", False)
    assert data["lease"]["token"] == live.token
    assert file_store.backend.get(KEY) == live


def test_ctrl_c_at_the_question_exits_130_and_releases_nothing(file_store: CliStore) -> None:
    """Found by trying: click turned the Ctrl-C into 'Aborted!' and exit 1; the README
    promises 130 after Ctrl-C."""
    live = hold(file_store)
    process = popen_cli("--backend", file_store.url, "release", KEY)
    assert process.stdout is not None
    shown = b""
    while b"[y/N]" not in shown:
        chunk = os.read(process.stdout.fileno(), 4096)
        assert chunk, shown
        shown += chunk
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=COMMAND_TIMEOUT)
    assert process.returncode == 130
    assert file_store.backend.get(KEY) == live
