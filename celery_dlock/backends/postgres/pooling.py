"""A pooler between a lock session and the server: how opening one finds it out.

Session liveness (advisory locks held by the lock session) needs one server connection for
the session's whole life: a direct connection or session pooling. A transaction-mode
pooler shows itself by a backend pid that changes between two transactions (not always: an
idle pool hands the server connection just freed back), and one that passes the startup
options over (PgBouncer's ``ignore_startup_parameters = options``, a common setting) by
the setting :data:`~celery_dlock.backends.postgres.sql.LOCK_SESSION` missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_dlock.backends.postgres.config import Config
from celery_dlock.backends.postgres.sql import LOCK_SESSION
from celery_dlock.errors import ConfigurationError

__all__ = ["opened", "pooled"]

_TTL_INSTEAD = (
    "Session advisory locks need a direct connection or session pooling; or add "
    "liveness=ttl&ttl=SECONDS to the URL: leases then live by their ttl alone, which works "
    "through a pooler"
)


def pooled(config: Config, pid: int, other: int) -> ConfigurationError:
    """The error for a lock session whose backend pid changed between two transactions."""
    return ConfigurationError(
        f"the lock session's backend pid changed between two transactions ({pid} -> "
        f"{other}): a transaction-mode pooler (PgBouncer pool_mode=transaction?) is in the "
        f"way. {_TTL_INSTEAD} [{config.url}]"
    )


def opened(config: Config, row: Sequence[Any]) -> int:
    """The backend pid of a lock session just opened, from the row of ``statements.open``;
    under session liveness, refused when its startup options did not reach the server."""
    if config.liveness == "session" and row[2] != "on":
        raise ConfigurationError(
            f"the lock session's startup options did not reach the server ({LOCK_SESSION} "
            "is not set): a pooler passes them over (PgBouncer ignore_startup_parameters = "
            f"options?), and may pool the session's server connection. {_TTL_INSTEAD} "
            f"[{config.url}]"
        )
    return int(row[0])
