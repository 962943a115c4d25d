"""A lock holder in a process of its own (``hold.py``), for tests that SIGKILL it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from celery_dlock.backends.base import LockBackend
from celery_dlock.records import Lease
from tests.support import eventually

HOLD = Path(__file__).parent / "hold.py"


def spawn_holder(
    url: str,
    key: str,
    ttl: float | None = None,
    hand_over: float | None = None,
    renew_first: float | None = None,
) -> tuple[subprocess.Popen[str], Lease]:
    """Start ``hold.py`` on ``url`` and return it with the lease it holds on ``key``
    (handed over to live by ``hand_over`` seconds alone, if given; after a renewal to
    ``renew_first`` seconds, if given, and then ``if_unchanged``)."""
    args = [sys.executable, str(HOLD), url, key, "-" if ttl is None else str(ttl)]
    if hand_over is not None:
        args.append(str(hand_over))
    if renew_first is not None:
        assert hand_over is not None, "renew_first is for a hand-over after a renewal"
        args.append(str(renew_first))
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    data = json.loads(line) if line else None
    if data is None:
        process.kill()
        process.wait()
        raise AssertionError(f"the holder process did not get {key!r}")
    return process, Lease.from_dict(data)


def kill(process: subprocess.Popen[str]) -> None:
    """SIGKILL ``process`` (no handler, no cleanup) and reap it."""
    process.kill()
    process.wait()
    if process.stdout is not None:
        process.stdout.close()


def gone(backend: LockBackend, leases: list[Lease], timeout: float = 30.0) -> None:
    """Wait until the store finds the holder of each of ``leases`` gone, by the test the
    janitor makes. A killed holder's Postgres lock session ends when its server process has
    seen the connection close and exited, a little after the kill on a loaded machine;
    until then it is alive to the store, whatever the pid says: there the reason must be
    the store's own (``lock session ended``), not ``process ended`` (this host's pid check,
    which a killed holder passes at once: with it this waited for nothing, and a janitor
    trial reaped 2 of 3 holders in CI)."""
    by_session = backend.capabilities.liveness == "session"

    def judged() -> bool:
        found = [backend.get(lease.key) for lease in leases]
        reasons = [None if lease is None else lease.holder.gone_because() for lease in found]
        if by_session:
            return all(reason == "lock session ended" for reason in reasons)
        return all(reason is not None for reason in reasons)

    eventually(judged, "the store finds the killed holders gone", timeout)
