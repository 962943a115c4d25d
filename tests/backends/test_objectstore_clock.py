"""Expiry by the object store's clock: the window :class:`ServerClock` keeps on it, and
clients whose own clock is an hour off on real servers."""

from __future__ import annotations

import time

import pytest

from celery_dlock import Holder, Outcome
from celery_dlock.backends import backend_from_url
from celery_dlock.backends.objectstore import ObjectStoreBackend, ServerClock, Stamp
from celery_dlock.testing import FakeClock
from tests.support import eventually
from tests.support.objectstore_servers import (  # noqa: F401 - fixtures
    Server,
    object_server,
    object_url,
    unique_prefix,
)

# -- the window on the server's clock (no server needed: responses are made up) ----------------

SERVER = 1_800_000_000.0  # the server's clock when the local clock reads 0
LOCAL_START = 0.0


def response(
    clock: FakeClock, server_clock: ServerClock, server: float = SERVER, rtt: float = 0.002
) -> None:
    """A response made by the server (its clock reads ``server`` + the local clock) halfway
    through a round trip starting now."""
    sent = clock()
    clock.advance(rtt / 2)
    date = float(int(server + clock()))  # HTTP dates are whole seconds, truncated
    clock.advance(rtt / 2)
    server_clock.observe(Stamp(date), sent, clock())


def truth(clock: FakeClock, server: float = SERVER) -> float:
    return server + clock()


def test_nothing_is_known_before_a_response() -> None:
    assert ServerClock(FakeClock(LOCAL_START)).now() is None


def test_one_date_bounds_the_server_clock_within_a_second() -> None:
    clock = FakeClock(0.3)
    server_clock = ServerClock(clock)
    response(clock, server_clock)
    now = server_clock.now()
    assert now is not None
    assert now.low <= truth(clock) <= now.high
    assert now.high - now.low <= 1.01


def test_dates_on_both_sides_of_a_second_narrow_the_window_to_the_gap() -> None:
    clock = FakeClock(0.95)
    server_clock = ServerClock(clock)
    for _ in range(5):  # 0.95 .. 1.05: the Date turns over between two of these
        response(clock, server_clock)
        clock.advance(0.02)
    now = server_clock.now()
    assert now is not None
    assert now.low <= truth(clock) <= now.high
    assert now.high - now.low <= 0.03


def test_an_exact_server_time_bounds_the_clock_by_the_round_trip() -> None:
    clock = FakeClock(0.5)
    server_clock = ServerClock(clock)
    sent = clock()
    clock.advance(0.001)
    written_at = truth(clock)  # GCS ``updated`` of our own write
    clock.advance(0.001)
    server_clock.observe(Stamp(float(int(written_at)), written_at), sent, clock())
    now = server_clock.now()
    assert now is not None and now.low <= truth(clock) <= now.high
    assert now.high - now.low <= 0.0021


def test_a_stepped_local_clock_starts_the_window_over() -> None:
    clock = FakeClock(0.95)
    server_clock = ServerClock(clock)
    for _ in range(5):
        response(clock, server_clock)
        clock.advance(0.02)
    clock.advance(3600)  # the local clock jumps; the server's does not
    stepped = SERVER - 3600  # the server's clock, seen from the stepped local clock
    response(clock, server_clock, stepped)
    now = server_clock.now()
    assert now is not None and now.low <= truth(clock, stepped) <= now.high
    assert now.high - now.low <= 1.01


def test_a_slow_response_teaches_nothing() -> None:
    clock = FakeClock(0.5)
    server_clock = ServerClock(clock)
    server_clock.observe(Stamp(SERVER), 0.0, 30.0)
    assert server_clock.now() is None


def test_the_window_widens_with_time_without_responses() -> None:
    clock = FakeClock(0.95)
    server_clock = ServerClock(clock)
    for _ in range(5):
        response(clock, server_clock)
        clock.advance(0.02)
    before = server_clock.uncertainty
    clock.advance(1000)
    now = server_clock.now()
    assert now is not None and now.low <= truth(clock) <= now.high
    assert now.high - now.low == pytest.approx(before + 2 * 1e-4 * 1000, rel=0.05)


# -- on real servers -----------------------------------------------------------------------------


def test_calibration_narrows_the_window_by_dates_alone(object_url: str) -> None:  # noqa: F811
    backend = backend_from_url(object_url, clock=lambda: time.monotonic() + 0.0)
    assert isinstance(backend, ObjectStoreBackend)
    backend.get("job:x")  # one response: a window of about a second
    assert backend.server_clock.uncertainty > 0.5

    def calibrated() -> bool:
        backend.objects.calibrate()
        return backend.server_clock.uncertainty <= 0.1

    # One calibrate() reads for at most 2.5 s: against moto (one request at a time) on a
    # loaded 2-core CI machine that once in five runs left 109 ms. Each call narrows further.
    eventually(calibrated, "the window narrowed to 0.1 s by calibration")
    now = backend.server_clock.now()
    assert now is not None and now.low - 0.01 <= time.time() <= now.high + 0.01


#: Seconds a lease that is to die lives.
DYING = 3.0


@pytest.mark.parametrize("skew", [3600.0, -3600.0], ids=["ahead-1h", "behind-1h"])
def test_a_client_an_hour_off_neither_steals_a_live_lease_nor_keeps_a_dead_one(
    object_server: Server,  # noqa: F811
    skew: float,
) -> None:
    url = object_server.url(unique_prefix())
    steady = backend_from_url(url)
    skewed = backend_from_url(url, clock=lambda: time.time() + skew)
    assert skewed.capabilities.server_clock

    # Leases that will die: one of a steady client, one of the skewed client. Their ttl
    # leaves a loaded machine's slow first request (a new client's) time to be answered
    # before the lease's end: a write answered after it grants nothing.
    dead = steady.try_acquire("job:dead", Holder.current(), DYING)
    mine = skewed.try_acquire("job:mine", Holder.current(), DYING)
    assert dead is not None and dead.expires_at is not None
    assert mine is not None and mine.expires_at is not None
    assert abs(mine.expires_at - (time.time() + DYING)) < 3  # by the server's clock

    # A live lease of a steady client: the skewed one cannot take it, nor reap it.
    live = steady.try_acquire("job:live", Holder.current(), 30)
    assert live is not None
    assert skewed.try_acquire("job:live", Holder.current(), None) is None
    assert "job:live" not in [record.key for record in skewed.reap()]
    held = steady.get("job:live")
    assert held is not None and held.token == live.token

    # The steady client's dead lease: the skewed one takes it once it expired, by the
    # server's clock.
    taken = eventually(lambda: skewed.try_acquire("job:dead", Holder.current(), 30), "takeover")
    [record] = steady.history(key="job:dead")
    assert record.outcome is Outcome.EXPIRED and record.lease.token == dead.token
    assert dead.expires_at <= record.released_at < time.time() + 2
    assert taken.expires_at is not None and abs(taken.expires_at - (time.time() + 30)) < 3

    # The skewed client's own dead lease: a steady client takes it, and the skewed one
    # can neither renew nor release it.
    eventually(lambda: steady.try_acquire("job:mine", Holder.current(), 60), "takeover")
    assert skewed.renew(mine, 60) is None
    assert skewed.release(mine, Outcome.SUCCEEDED) is None
    current = steady.get("job:mine")
    assert current is not None and current.token != mine.token
