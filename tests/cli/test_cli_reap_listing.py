"""``reap`` says which leases it cleared: one line each (the first 20, then how many more),
every one under ``cleared`` with ``--json``, and no bare janitor log line per lease on
stderr (with no handler set up, each used to reach stderr unformatted: 1,000 lines for
1,000 leases)."""

from __future__ import annotations

import json
import time

from celery_dlock.records import Holder
from tests.cli.clitools import CliStore, run_cli


def expire(store: CliStore, keys: list[str]) -> None:
    """Leases on ``keys`` whose ttl has run out (their holder, this process, lives)."""
    for key in keys:
        assert store.backend.try_acquire(key, Holder.current(), 0.05) is not None
    time.sleep(0.1)


def test_reap_lists_what_it_cleared_and_logs_no_line_per_lease(file_store: CliStore) -> None:
    keys = [f"job:reap:{n:02d}" for n in range(25)]
    expire(file_store, keys)
    result = run_cli("--backend", file_store.url, "reap")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    cleared = sorted(line.split()[1] for line in lines[:20])
    assert all(
        line.startswith("cleared job:reap:") and line.endswith(": expired") for line in lines[:20]
    )
    assert len(set(cleared)) == 20 and set(cleared) <= set(keys)
    assert lines[20:] == [
        "... and 5 more (--json lists every one)",
        "leases reaped: 25 (0 disconnected, 25 expired); history not pruned",
    ]
    assert all(file_store.backend.get(key) is None for key in keys)


def test_reap_json_lists_every_lease_it_cleared(file_store: CliStore) -> None:
    keys = [f"job:reap:json:{n:02d}" for n in range(25)]
    expire(file_store, keys)
    result = run_cli("--backend", file_store.url, "reap", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data["reaped"] == data["expired"] == 25
    assert sorted(entry["key"] for entry in data["cleared"]) == keys
    assert {entry["outcome"] for entry in data["cleared"]} == {"expired"}
    fences = {file_store.backend.history(key=key)[0].fence for key in keys}
    assert {entry["fence"] for entry in data["cleared"]} == fences
    again = run_cli("--backend", file_store.url, "reap", "--json")
    nothing = json.loads(again.stdout)
    assert (nothing["reaped"], nothing["cleared"]) == (0, [])
