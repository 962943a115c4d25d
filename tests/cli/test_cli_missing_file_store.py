"""A file store URL that names no store (a mistyped path, another user's default
``$TMPDIR/celery-dlock-<uid>``): the commands that read say so, and create nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.clitools import run_celery, run_cli

READING = [
    ["leases"],
    ["history"],
    ["release", "--force", "job:x"],
    ["reap"],
    ["doctor"],
    ["timeline", "--json"],
]


@pytest.mark.parametrize("command", READING, ids=lambda words: words[0])
def test_a_missing_file_store_is_named_and_not_created(tmp_path: Path, command: list[str]) -> None:
    """Found by trying: each of these created an empty store at the mistyped path and
    reported it: 'no leases', a doctor whose checks all passed, exit 0."""
    missing = tmp_path / "dlok"
    result = run_cli("--backend", f"file://{missing}", *command)
    assert result.returncode == 2, result.stdout
    assert f"no file store at {missing} (no such directory" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not missing.exists()


def test_a_directory_that_holds_no_store_is_named_and_left_alone(tmp_path: Path) -> None:
    """A parent directory given for the store's (file:///var/lib for /var/lib/dlock)."""
    (tmp_path / "mine").write_text("data")
    result = run_cli("--backend", f"file://{tmp_path}", "leases")
    assert result.returncode == 2
    assert f"no file store at {tmp_path} (it has no locks directory" in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine"]


def test_under_celery_the_message_names_where_the_url_came_from(tmp_path: Path) -> None:
    missing = tmp_path / "dlok"
    result = run_celery(f"file://{missing}", "leases")
    assert result.returncode == 2
    assert "the URL from dlock_backend" in result.stderr
    assert not missing.exists()


def test_run_and_migrate_still_create_the_store(tmp_path: Path) -> None:
    store = tmp_path / "fresh"
    ran = run_cli("--backend", f"file://{store}", "run", "job:x", "--", "true")
    assert ran.returncode == 0, ran.stderr
    assert (store / "locks").is_dir()
    other = tmp_path / "other"
    migrated = run_cli("--backend", f"file://{other}", "migrate")
    assert migrated.returncode == 0, migrated.stderr
    listed = run_cli("--backend", f"file://{other}", "leases")
    assert listed.returncode == 0 and "no leases" in listed.stdout
