"""Earlier releases of this code, run for real: the tree of a commit of this repository."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def commit_tree(commit: str, tree: Path) -> Path:
    """The files of ``commit`` extracted into ``tree``, a new directory (``git archive``:
    the repository is untouched); a skip where this checkout does not have the commit (no
    git history), a failure where it has history and ``DLOCK_REQUIRE_ALL=1``."""
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit], capture_output=True, check=False
    )
    if archive.returncode != 0:
        why = f"no commit {commit[:7]} here: {archive.stderr.decode().strip()}"
        if os.environ.get("DLOCK_REQUIRE_ALL") == "1" and (REPO / ".git").exists():
            # A checkout with history lacks it: the pinned commit is wrong (one that never
            # landed), and the test would skip for good.
            pytest.fail(why)
        pytest.skip(why)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree
