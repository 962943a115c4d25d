"""A dedupe mark handed over to its queued message (``LockBackend.hand_over``) whose producer
has ended: ``leases``, ``leases --json`` and the page show it held for its message, not
``[gone]`` (its holder still names the producer's pid, which an operator would take for a
dead holder to ``release --force``, letting a duplicate through), and the janitor leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from celery_dlock.celery.dedupe import mark_key
from celery_dlock.celery.revoking import REVOKING
from tests.cli.clitools import CliStore, run_cli
from tests.cli.test_cli_serve import Server
from tests.support.holders import kill, spawn_holder

#: Long enough that nothing in the test outlives it by accident.
HANDED_TTL = 3600.0


def gone_producer_mark(store: CliStore) -> tuple[str, str]:
    """A mark handed over to its message by a producer process that has ended, and the
    revoker's guard beside it, held by a process that has ended too: their keys."""
    key = mark_key("job:cust2:31", "tests.hold")  # the holder's task, as for every mark
    producer, _ = spawn_holder(store.url, key, None, hand_over=HANDED_TTL)
    kill(producer)
    revoker, _ = spawn_holder(store.url, f"{key}{REVOKING}", 60.0)
    kill(revoker)
    return key, f"{key}{REVOKING}"


def test_a_mark_whose_producer_ended_is_held_for_its_message_not_gone(store: CliStore) -> None:
    key, guard = gone_producer_mark(store)
    held = store.backend.get(key)
    assert held is not None

    shown = run_cli("--backend", store.url, "leases")
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line for line in shown.stdout.splitlines()[1:]}
    assert "[queued message]" in rows[key] and "[gone]" not in rows[key], shown.stdout
    assert "[gone]" in rows[guard]  # a revoker's guard is its process's: judged as ever

    listed = run_cli("--backend", store.url, "leases", "--json")
    assert listed.returncode == 0, listed.stderr
    by_key = {entry["key"]: entry for entry in json.loads(listed.stdout)["leases"]}
    assert (by_key[key]["holder_gone"], by_key[key]["queued_message"]) == (False, True)
    assert (by_key[guard]["holder_gone"], by_key[guard]["queued_message"]) == (True, False)

    reaped = store.backend.reap()  # the janitor's step
    assert key not in [record.key for record in reaped]
    after = store.backend.get(key)
    assert after is not None and (after.token, after.fence) == (held.token, held.fence)


def test_the_page_shows_a_mark_whose_producer_ended_held_for_its_message(
    pg_store: CliStore, tmp_path: Path
) -> None:
    pytest.importorskip("flask")
    pytest.importorskip("waitress")
    key, guard = gone_producer_mark(pg_store)
    server = Server(pg_store.url, tmp_path)
    try:
        status, page = server.get("/")
    finally:
        server.stop()
    assert status == 200
    cells = page.split('<td class="key">')[1:]
    rows = {cell.partition("<")[0]: cell for cell in cells}
    assert '<td class="holder">' in rows[key] and "[queued message]" in rows[key], page
    assert '<td class="holder gone">' in rows[guard], page
