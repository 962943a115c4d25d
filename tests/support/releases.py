"""Earlier releases of this code, run for real: the tree of a commit of this repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def commit_tree(commit: str, tree: Path) -> Path:
    """The files of ``commit`` extracted into ``tree``, a new directory (``git archive``:
    the repository is untouched); a skip where this checkout does not have the commit."""
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit], capture_output=True, check=False
    )
    if archive.returncode != 0:
        pytest.skip(f"no commit {commit[:7]} here: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree
