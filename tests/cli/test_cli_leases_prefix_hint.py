"""``leases PREFIX`` tried with a prefix given without the namespace."""

from __future__ import annotations

from celery_dlock.records import Holder
from tests.cli.clitools import CliStore, run_cli


def test_a_prefix_without_the_namespace_hints_the_full_one(store: CliStore) -> None:
    """Found by trying: `leases order:` said only 'no leases under order:' while job:order:42
    was held; `history --key` and `release` already hinted the full key."""
    assert store.backend.try_acquire("job:order:42", Holder.current(task_name="t"), 60) is not None
    result = run_cli("--backend", store.url, "leases", "order:")
    assert result.returncode == 0, result.stderr
    assert "no leases under 'order:'" in result.stdout
    assert "did you mean 'job:order:'?" in result.stdout
    unrelated = run_cli("--backend", store.url, "leases", "invoice:")
    assert "did you mean" not in unrelated.stdout
