"""Every benchmark the README tells users to rerun starts: ``--help`` of each script in
``bench/`` exits 0 (an import that moved broke ``bench_objectstore.py`` unnoticed, since
no test ran it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(path.name for path in BENCH.glob("bench_*.py") if "__main__" in path.read_text())


def test_the_readme_s_benchmarks_are_all_here() -> None:
    readme = (BENCH.parent / "README.md").read_text()
    assert {name for name in SCRIPTS if f"bench/{name}" in readme} >= {
        "bench_file.py",
        "bench_postgres.py",
        "bench_redis.py",
        "bench_objectstore.py",
        "bench_celery.py",
        "bench_dedupe.py",
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_starts(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
