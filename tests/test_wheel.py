"""What a user who has only the package gets: the wheel built from this checkout holds every
module of ``celery_dlock`` and its ``py.typed``, declares the ``celery-dlock`` command, and
works from its own files (a lock taken and recorded through the command, over a file store),
not from the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sources() -> set[str]:
    """The package's files in the checkout, as paths inside a wheel."""
    package = ROOT / "celery_dlock"
    found = {
        path.relative_to(ROOT).as_posix()
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }
    assert "celery_dlock/py.typed" in found
    return found


def test_the_wheel_holds_the_whole_package_and_runs_from_its_own_files(tmp_path: Path) -> None:
    # Built from a copy: setuptools leaves build/ in the tree it builds, whose stale files
    # a later build of the checkout would package.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "celery_dlock", source / "celery_dlock",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )  # fmt: skip
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    [wheel] = tmp_path.glob("celery_dlock-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [entry_points] = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
        archive.extractall(tmp_path / "site")
    packaged = {name for name in names if name.startswith("celery_dlock/")}
    assert packaged == _sources(), (_sources() - packaged, packaged - _sources())
    assert "celery-dlock = celery_dlock.cli:main" in scripts

    locks = tmp_path / "locks"
    locks.mkdir()
    code = (
        "import sys, celery_dlock\n"
        "from celery_dlock.cli import main\n"
        "print(celery_dlock.__file__, file=sys.stderr)\n"
        "sys.argv = ['celery-dlock', *sys.argv[1:]]\n"
        "main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "PYTHONSAFEPATH": "1"}

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, "--backend", f"file://{locks}", *args],
            check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
        )  # fmt: skip

    ran = command("run", "job:wheel:1", "--", sys.executable, "-c", "pass")
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.splitlines()[0] == str(tmp_path / "site" / "celery_dlock" / "__init__.py")
    history = command("history", "job:wheel:1")
    assert history.returncode == 0, history.stderr
    [row] = history.stdout.splitlines()[1:]
    assert row.split()[2:4] == ["job:wheel:1", "succeeded"]
