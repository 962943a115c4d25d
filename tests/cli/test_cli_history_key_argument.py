"""``history`` took its key only as ``--key``, while ``leases``, ``release``, ``forget`` and
``run`` take theirs as an argument: ``celery-dlock history job:order:42``, what a user types
first, failed with click's "Got unexpected extra argument". The key may now come either way."""

from __future__ import annotations

from celery_dlock import Lock, Outcome
from tests.cli.clitools import CliStore, history_keys, run_cli


def test_history_takes_its_key_as_an_argument_as_it_does_as_key(store: CliStore) -> None:
    for key in ("job:order:41", "job:order:42"):
        lock = Lock(store.backend, key)
        lock.acquire()
        lock.release()
    alone = history_keys(store, "job:order:42")
    assert alone == [("job:order:42", Outcome.SUCCEEDED.value)]
    assert alone == history_keys(store, "--key", "job:order:42")
    assert alone == history_keys(store, "job:order:42", "--key", "job:order:42")
    table = run_cli("--backend", store.url, "history", "job:order:41")
    assert table.returncode == 0, table.stderr
    assert [line.split()[2] for line in table.stdout.splitlines()[1:]] == ["job:order:41"]


def test_history_refuses_two_different_keys_naming_both(store: CliStore) -> None:
    result = run_cli("--backend", store.url, "history", "job:order:1", "--key", "job:order:2")
    assert result.returncode == 2
    assert "two keys given, 'job:order:1' and --key 'job:order:2'" in result.stderr
    assert result.stdout == ""


def test_history_hints_the_full_key_given_as_an_argument(store: CliStore) -> None:
    lock = Lock(store.backend, "job:order:7")
    lock.acquire()
    lock.release()
    result = run_cli("--backend", store.url, "history", "order:7")
    assert result.returncode == 0, result.stderr
    assert "did you mean 'job:order:7'?" in result.stdout
