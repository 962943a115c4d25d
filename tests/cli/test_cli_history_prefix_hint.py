"""``history --key`` is one key in full; given the start of several keys (as ``leases``,
``timeline --key`` and the page take it) it matched nothing and said only that. It says
which keys of the newest records start with it, and where to see them together."""

from __future__ import annotations

from celery_dlock import Lock
from tests.cli.clitools import CliStore, run_cli


def test_a_prefix_given_to_history_key_is_named_with_the_keys_it_starts(
    file_store: CliStore,
) -> None:
    for name in ("backup", "nightly", "report", "sync"):
        lock = Lock(file_store.backend, f"job:cron:{name}")
        lock.acquire()
        lock.release()
    result = run_cli("--backend", file_store.url, "history", "--key", "job:cron:")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"no history records match in {file_store.url}")
    assert "4 keys of the newest records start with it" in result.stdout
    assert "job:cron:backup, job:cron:nightly, job:cron:report, ..." in result.stdout
    assert "`timeline --key job:cron:`" in result.stdout
    exact = run_cli("--backend", file_store.url, "history", "--key", "job:cron:sync")
    assert "job:cron:sync" in exact.stdout and "start with it" not in exact.stdout
    nothing = run_cli("--backend", file_store.url, "history", "--key", "job:other:")
    assert nothing.stdout.strip() == f"no history records match in {file_store.url}"
