"""The Redis store under operator mistakes, on a private ``redis-server``."""

from __future__ import annotations

import pytest

from celery_dlock import BackendError, Lock

redis = pytest.importorskip("redis")

from tests.backends import test_redis_server  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

#: A private ``redis-server`` without persistence, stopped after the test.
server = test_redis_server.server


def guard(server: RedisServer) -> RedisServer:
    """Make ``server`` require the password ``s3cret``."""
    client = server.client()
    client.config_set("requirepass", "s3cret")
    client.close()
    return server


def test_url_without_password_for_a_guarded_redis_says_a_password_is_needed(
    server: RedisServer,
) -> None:
    guarded_server = guard(server)
    with pytest.raises(BackendError) as raised:
        Lock(guarded_server.url("probe"), "report:daily").acquire(wait=0)

    assert "requires a password" in str(raised.value)
    assert isinstance(raised.value.__cause__, redis.AuthenticationError)


def test_url_with_the_password_of_a_guarded_redis_takes_the_key(
    server: RedisServer,
) -> None:
    guarded_server = guard(server)
    url = guarded_server.url("probe").replace("redis://", "redis://:s3cret@")

    with Lock(url, "report:daily") as lease:
        assert lease.key == "report:daily"
