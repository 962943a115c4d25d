"""Tests that must run alone while the others run in parallel (pytest-xdist).

A test marked ``exclusive`` does something to a server every test shares: it restarts the
local PostgreSQL, which cuts every connection to it. It runs while no other test of this
run does, in any worker process; the others run side by side. A test marked ``heavy`` takes
much of the machine (the torture runs: 16 processes and private servers): it runs beside the
others, but never beside another heavy one.

A readers-writer lock over two ``flock`` files, preferring the writer: every test passes a
turnstile (``EX``, at once let go) and holds the gate ``SH``; an exclusive test keeps the
turnstile while it takes the gate ``EX``, so no new test starts while it waits for the running
ones to end. A heavy test holds a third file ``EX`` as well. The files are per checkout (or
at ``DLOCK_TEST_GATE``, a path prefix); without xdist nothing ever waits. A plugin:
``tests/conftest.py`` loads it.

Each exclusive test costs the run its own time on one process and, before it, the wait for the
tests running beside it to end (the other processes idle meanwhile): a CI run spent about 200 s
of its 700 in those waits, its 24 exclusive tests coming one by one among the others. Under
xdist the exclusive tests are collected first, then the heavy ones (pytest-xdist hands each
process a first chunk of the collection in order, so they land on one and run one after
another), and a process keeps the gate from one exclusive test to the next: one wait in all.
(``--dist loadgroup`` would say it plainly, but groups nothing under pytest 9: xdist 3.8
renames ``item._nodeid``, which pytest 9 no longer reads.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["MARKER", "pytest_collection_modifyitems", "pytest_runtest_protocol", "running"]

MARKER = "exclusive"
HEAVY = "heavy"
_CHECKOUT = hashlib.sha256(str(Path(__file__).resolve()).encode()).hexdigest()[:12]
_BASE = os.environ.get("DLOCK_TEST_GATE") or str(
    Path(tempfile.gettempdir()) / f"celery-dlock-tests-{_CHECKOUT}"
)


_kept: list[contextlib.ExitStack] = []  # the gate held alone, for the next test


def _exclusive(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker(MARKER) is not None


def _heavy(item: pytest.Item) -> bool:
    return item.get_closest_marker(HEAVY) is not None


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle, in the same order everywhere
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, collect the exclusive tests first, then the heavy ones (each in the
    order they came)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: (not _exclusive(item), not _heavy(item)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Run a test marked ``exclusive`` alone, the others side by side; keep the gate from
    one exclusive test to the next when they come one after the other."""
    if _kept:  # held alone since the exclusive test before this one
        gate = _kept.pop()
    else:
        gate = contextlib.ExitStack()
        gate.enter_context(running(_exclusive(item), _heavy(item)))
    try:
        return (yield)
    finally:
        if _exclusive(item) and _exclusive(nextitem):
            _kept.append(gate)
        else:
            gate.close()


@contextlib.contextmanager
def running(exclusive: bool, heavy: bool = False) -> Iterator[None]:
    """Hold the gate for one test: shared, or alone if ``exclusive``; and if ``heavy``, the
    heavy tests' own lock first."""
    with contextlib.ExitStack() as held:
        if heavy:
            fcntl.flock(held.enter_context(_opened("heavy")), fcntl.LOCK_EX)
        yield held.enter_context(_gate(exclusive))


@contextlib.contextmanager
def _gate(exclusive: bool) -> Iterator[None]:
    with _opened("turnstile") as turnstile, _opened("gate") as gate:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(gate, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # closing the files lets go of both locks


@contextlib.contextmanager
def _opened(name: str) -> Iterator[int]:
    fd = os.open(f"{_BASE}.{name}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)
