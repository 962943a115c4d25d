"""The test run's own gate (``tests.support.exclusive``): under pytest-xdist the tests run
side by side, except one marked ``exclusive``, which runs while no other test does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

CASES = textwrap.dedent(
    """
    import json, os, time
    from pathlib import Path

    import pytest

    LOG = Path(os.environ["GATE_LOG"])


    def spend(name):
        started = time.monotonic()
        time.sleep(0.4)
        line = {"name": name, "start": started, "end": time.monotonic()}
        with LOG.open("a") as out:
            out.write(json.dumps(line) + "\\n")


    @pytest.mark.parametrize("n", range(4))
    def test_a(n):
        spend(f"shared{n}")


    @pytest.mark.exclusive
    def test_b():
        spend("alone0")


    @pytest.mark.parametrize("n", range(4, 8))
    def test_c(n):
        spend(f"shared{n}")


    @pytest.mark.exclusive
    def test_d():
        spend("alone1")


    @pytest.mark.parametrize("n", range(8, 10))
    def test_e(n):
        spend(f"shared{n}")
    """
)


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


@pytest.mark.slow
def test_an_exclusive_test_runs_alone_while_the_others_run_side_by_side(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(CASES)
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "GATE_LOG": str(log), "DLOCK_TEST_GATE": str(tmp_path / "gate")}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("PYTEST_XDIST_WORKER", None)
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.support.exclusive"]
    command += ["-p", "no:randomly", "-p", "no:cacheprovider", "-c", os.devnull, str(tmp_path)]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 12
    alone = [r for r in runs if r["name"].startswith("alone")]
    shared = [r for r in runs if r["name"].startswith("shared")]
    # Neither exclusive test overlapped any other test...
    together = [(a["name"], r["name"]) for a in alone for r in runs if r is not a and overlap(a, r)]
    assert together == []
    # ...while the shared ones did run side by side (the check above could fail).
    assert any(overlap(a, b) for a in shared for b in shared if a is not b)
    # The exclusive tests ran first, one after the other: one wait for both (at most for the
    # other process's first test), and no other test between them.
    block = {"start": min(a["start"] for a in alone), "end": max(a["end"] for a in alone)}
    assert [r["name"] for r in shared if overlap(r, block)] == []
    assert len([r for r in shared if r["start"] < block["start"]]) <= 1  # the other process's first
