"""``timeline`` tried with a window that cannot be drawn."""

from __future__ import annotations

from pathlib import Path

from tests.cli.clitools import CliStore, run_cli


def test_a_since_in_the_future_is_a_usage_error(file_store: CliStore, tmp_path: Path) -> None:
    """Found by trying: `--since 2200-01-01` wrote a picture whose time axis ran backwards
    (every held lease squeezed to its edge) and said 'wrote ...: N leases', exit 0."""
    picture = tmp_path / "t.svg"
    result = run_cli(
        "--backend", file_store.url, "timeline", "--since", "2200-01-01", "-o", str(picture)
    )
    assert result.returncode == 2
    assert "--since 2200-01-01 00:00:00 is not in the past" in result.stderr
    assert not picture.exists()
