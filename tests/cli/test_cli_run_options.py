"""``celery-dlock run``'s ``--ttl`` and ``--wait`` take durations as the other options do
(``2m``; ``--wait forever``), and a value out of range is a usage error naming the option;
a busy key says so once (the key was named twice)."""

from __future__ import annotations

import pytest

from celery_dlock import Holder, Outcome
from celery_dlock.cli.run import EXIT_BUSY
from tests.cli.clitools import CliStore, run_cli


@pytest.mark.parametrize("wait", ["2m", "forever", "1.5"])
def test_wait_takes_a_duration_or_forever(file_store: CliStore, wait: str) -> None:
    result = run_cli("--backend", file_store.url, "run", "--wait", wait, "job:opt:w", "--", "true")
    assert result.returncode == 0, result.stderr
    [record] = file_store.backend.history(key="job:opt:w")
    assert record.outcome is Outcome.SUCCEEDED


def test_ttl_takes_a_duration(file_store: CliStore) -> None:
    result = run_cli("--backend", file_store.url, "run", "--ttl", "10m", "job:opt:t", "--", "true")
    assert result.returncode == 0, result.stderr
    [record] = file_store.backend.history(key="job:opt:t")
    assert record.lease.expires_at is not None
    assert 599 <= record.lease.expires_at - record.lease.acquired_at <= 601


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--ttl", "0", "--ttl: ttl must be a positive number"),
        ("--wait", "-1", "Invalid value for '--wait'"),
        ("--ttl", "soon", "Invalid value for '--ttl'"),
    ],
)
def test_a_bad_ttl_or_wait_is_a_usage_error_naming_the_option(
    file_store: CliStore, option: str, value: str, said: str
) -> None:
    result = run_cli("--backend", file_store.url, "run", option, value, "job:opt:bad", "--", "true")
    assert result.returncode == 2, result.stderr
    assert said in result.stderr
    assert file_store.backend.history(key="job:opt:bad") == []


def test_a_busy_key_is_named_once_with_its_holder(file_store: CliStore) -> None:
    held = file_store.backend.try_acquire("job:opt:busy", Holder.current(), None)
    assert held is not None
    try:
        result = run_cli(
            "--backend", file_store.url, "run", "--wait", "0.2", "job:opt:busy", "--", "true"
        )
    finally:
        file_store.backend.release(held, Outcome.SUCCEEDED)
    assert result.returncode == EXIT_BUSY
    line = result.stderr.strip().splitlines()[-1]
    assert line == (
        f"job:opt:busy is busy after 0.2 s, held by {held.holder.describe()}: "
        "the command was not run"
    )
