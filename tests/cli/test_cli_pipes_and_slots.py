"""The CLI as an operator meets it: ``history --key K`` of a key taken with a limit (its
records are on the slots ``K#0`` .. ``K#<n-1>``: it showed nothing), and a long listing piped
into ``| head`` (with ``PYTHONUNBUFFERED=1``, as Docker images set it, the rest of the table
was dropped and the command exited 0 where ``cat`` exits 141). Real commands as
subprocesses, real stores (the ``store`` fixture of ``conftest.py``)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from celery_dlock import Lock, backend_from_url
from celery_dlock.cli.commands import SLOT_GAP, records_of
from celery_dlock.records import Holder, Outcome
from tests.cli.clitools import (
    BIN,
    COMMAND_TIMEOUT,
    HERE,
    CliStore,
    environment,
    run_cli,
)

EXIT_PIPE = 141  # 128 + SIGPIPE: what the shell reports for `cat` cut short by `head`
#: The commands run the package this test imports (a worktree's, with PYTHONPATH).
PATHS = {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(HERE)]))}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=PATHS)


def history_json(store: CliStore, *args: str) -> Any:
    done = cli("--backend", store.url, "history", "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# -- history --key of a key taken with a limit --------------------------------------------


def test_history_of_a_key_taken_with_a_limit_shows_its_slots_records(store: CliStore) -> None:
    key = f"job:export:{os.urandom(3).hex()}"
    pool = Lock(store.backend, key, limit=3)
    for _ in range(6):
        pool.acquire()
        pool.release()
    held = Lock(store.backend, key, limit=3)
    held.acquire()
    try:
        slots = [f"{key}#{n}" for n in range(3)]
        kept = {slot: store.backend.history(key=slot) for slot in slots}
        used = [slot for slot in slots if kept[slot] or slot == held.lease.key]

        table = cli("--backend", store.url, "history", "--key", key)
        assert table.returncode == 0, table.stderr
        rows = table.stdout.splitlines()[1:]
        assert sorted(row.split()[2] for row in rows) == sorted(
            slot for slot in slots for _ in kept[slot]
        )  # every record of every slot, each once (column 3: date and time come first)
        assert "a key taken with a limit" in table.stderr
        assert ", ".join(used) in table.stderr

        data = history_json(store, "--key", key)
        assert data["slots"] == used
        assert len(data["records"]) == 6
    finally:
        held.release()


def test_history_finds_a_slot_used_after_unused_ones(store: CliStore) -> None:
    """Slots are taken in a random order: with a limit of 6 and one run, the run may have
    had ``#4`` while ``#0`` .. ``#3`` were never used."""
    key = f"job:report:{os.urandom(3).hex()}"
    lease = store.backend.try_acquire(f"{key}#4", Holder.current(task_name="tests.report"), None)
    assert lease is not None
    store.backend.release(lease, Outcome.FAILED, "ValueError", "ValueError: no data")

    data = history_json(store, "--key", key, "--problems")
    assert data["slots"] == [f"{key}#4"]
    assert [record["key"] for record in data["records"]] == [f"{key}#4"]
    none = cli("--backend", store.url, "history", "--key", key, "--outcome", "succeeded")
    assert none.returncode == 0
    assert "no history records match" in none.stdout
    assert f"no record matches in it or in its slots {key}#4" in none.stderr


def test_history_of_a_key_with_records_of_its_own_searches_no_slots(store: CliStore) -> None:
    key = f"job:order:{os.urandom(3).hex()}"
    with Lock(store.backend, key):
        pass
    assert [r["key"] for r in history_json(store, "--key", key)["records"]] == [key]
    filtered = history_json(store, "--key", key, "--problems")  # its records are filtered out
    assert filtered["records"] == [] and filtered["slots"] == []


def test_history_of_a_key_with_runs_of_its_own_asks_for_no_slot() -> None:
    """Found by a review: ``history --key K`` asked for ``K#0`` .. ``K#2`` by exact key
    whatever K was, and on Redis each such query scans the stream (0.42 s against 0.10 s
    for a plain key among 30,000 records). A key with runs of its own (fence > 0) and no
    slot held or seen now costs the store the same round trips with slots or without:
    those of K, the slots held and the newest records, and none per slot."""
    from tests.backends.stores.redis import delete_prefix, store_url
    from tests.support.countingproxy import CountingProxy

    prefix = f"cli-slots-{os.urandom(4).hex()}"
    with CountingProxy("127.0.0.1", 6379) as proxy:
        url = store_url(prefix, f"redis://127.0.0.1:{proxy.port}/4")
        backend = backend_from_url(url)
        try:
            with Lock(backend, "job:plain", holder=Holder.current(task_name="t.plain")):
                pass
            skipped = Lock(backend, "job:limited", limit=2)
            skipped.record_skip("busy", "every slot was busy")

            def trips(key: str) -> int:
                proxy.reset()
                records, slots = records_of(
                    backend, key, lambda **kw: backend.history(limit=50, **kw), limit=50
                )
                assert slots == []
                assert records and records[0].key == key
                return proxy.round_trips

            assert trips("job:limited") - trips("job:plain") == SLOT_GAP
        finally:
            backend.close()
            delete_prefix(url, prefix)


# -- a reader that goes away mid-output ---------------------------------------------------


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A file store whose listings are far longer than a pipe holds (64 KiB): 2,000 leases
    and 2,000 records (a table row is about 100 bytes)."""
    url = f"file://{tmp_path_factory.mktemp('crowded')}/locks"
    holder = Holder.current(task_name="tests.fill")
    with backend_from_url(url) as backend:
        for n in range(2000):
            assert backend.try_acquire(f"job:held:{n:04}", holder, None) is not None
            done = backend.try_acquire(f"job:done:{n:04}", holder, None)
            assert done is not None
            backend.release(done, Outcome.SUCCEEDED)
    return url


@pytest.mark.parametrize("unbuffered", ["1", None], ids=["PYTHONUNBUFFERED=1", "buffered"])
@pytest.mark.parametrize(
    "command", [["leases"], ["history", "--limit", "2000"], ["leases", "--json"]], ids=" ".join
)
def test_a_listing_cut_short_by_head_exits_141_quietly(
    crowded: str, command: list[str], unbuffered: str | None
) -> None:
    """``celery-dlock leases | head -1``: a real pipeline. ``head`` reads the first line and
    exits while the listing is still being written."""
    env = environment(PATHS)
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered is not None:
        env["PYTHONUNBUFFERED"] = unbuffered
    listing = subprocess.Popen(
        [str(BIN / "celery-dlock"), "--backend", crowded, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert listing.stdout is not None and listing.stderr is not None
    head = subprocess.Popen(["head", "-1"], stdin=listing.stdout, stdout=subprocess.PIPE)
    listing.stdout.close()  # head alone reads it now
    first, _ = head.communicate(timeout=COMMAND_TIMEOUT)
    errors = listing.stderr.read()
    listing.stderr.close()
    assert listing.wait(timeout=COMMAND_TIMEOUT) == EXIT_PIPE, errors
    assert errors == b""  # no traceback, no "Error:" line
    assert first.strip() in (b"{", b"") or first.split()[0] in (b"KEY", b"RELEASED")
