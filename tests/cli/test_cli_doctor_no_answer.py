"""``doctor`` tried against a store that takes connections and never answers (a hung
server, a firewall that accepts and drops): it must say so after one wait, not two."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.cli.clitools import run_cli


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener's queue takes connections that nobody ever answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


@pytest.mark.parametrize(
    "scheme",
    [
        # Timeouts just past the doctor's NO_ANSWER (5 s): the drivers' defaults (10 s, 15 s)
        # only make the test longer.
        "postgresql://postgres@127.0.0.1:{}/test?connect_timeout=6",
        "redis://127.0.0.1:{}/13?socket_timeout=6&socket_connect_timeout=6&retries=0",
    ],
    ids=["postgres", "redis"],
)
def test_doctor_waits_once_for_a_store_that_does_not_answer(silent_port: int, scheme: str) -> None:
    """Found by trying: after the connect check timed out (10 s on Postgres, 15 s on Redis)
    the store's own checks connected again and timed out again, so the doctor took twice as
    long as `leases` to say the same thing."""
    url = scheme.format(silent_port)
    started = time.monotonic()
    listed = run_cli("--backend", url, "leases")
    once = time.monotonic() - started
    assert listed.returncode == 1
    started = time.monotonic()
    result = run_cli("--backend", url, "doctor", "--json")
    took = time.monotonic() - started
    assert result.returncode == 1
    assert took < 1.5 * once, (took, once)
    [check] = json.loads(result.stdout)["checks"]
    assert check["name"] == "connect" and check["status"] == "fail"
    assert "the store's own checks not run" in check["detail"]
