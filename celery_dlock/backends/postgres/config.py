"""The Postgres backend's URL: our options, validated, and libpq's, passed through.

No I/O happens here: ``from_url`` runs at import time in Celery apps, before the fork.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

import psycopg
from psycopg.conninfo import make_conninfo

from celery_dlock.backends import mask_url
from celery_dlock.backends.common import flag, url_options
from celery_dlock.backends.postgres.sql import LOCK_SESSION, Names, validate_names
from celery_dlock.backends.postgres.statements import Statements
from celery_dlock.errors import BackendError, ConfigurationError, DLockError

__all__ = ["LIBPQ_PARAMETERS", "Config", "parse_url", "translate"]

#: libpq connection parameters accepted in the URL's query and passed to libpq unchanged.
LIBPQ_PARAMETERS = frozenset(
    {
        "application_name",
        "channel_binding",
        "connect_timeout",
        "dbname",
        "gssencmode",
        "host",
        "hostaddr",
        "krbsrvname",
        "load_balance_hosts",
        "options",
        "passfile",
        "password",
        "port",
        "require_auth",
        "requirepeer",
        "service",
        "ssl_max_protocol_version",
        "ssl_min_protocol_version",
        "sslcert",
        "sslcrl",
        "sslcrldir",
        "sslkey",
        "sslmode",
        "sslpassword",
        "sslrootcert",
        "sslsni",
        "target_session_attrs",
        "user",
    }
)

_SCHEMES = frozenset({"postgresql", "postgresql+psycopg", "postgres"})
#: SQLSTATEs that say the schema is missing.
_NO_SCHEMA = frozenset({"42P01", "3F000"})
#: SQLSTATE insufficient_privilege: a store a DBA can mend while workers run (a
#: ``BackendError``, so tasks are retried, never run unlocked).
_NO_RIGHTS = "42501"
_GRANTS = (
    "the role needs USAGE on the store's schema, SELECT, INSERT, UPDATE, DELETE on its "
    "tables and USAGE, SELECT, UPDATE on its sequence (the doctor's schema check names "
    "each GRANT missing)"
)
_MIGRATE_RIGHTS = (
    "migrate() creates the schema, its tables, sequence and functions: run it as the "
    "schema's owner (or a role with CREATE on the database), then grant the workers' role"
)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a positive number of seconds")
    return value


def _liveness(text: str) -> str:
    if text not in ("session", "ttl"):
        raise ValueError("must be session or ttl")
    return text


_OPTIONS: dict[str, Any] = {
    "schema": str,
    "table_prefix": str,
    "auto_migrate": flag,
    "synchronous_commit": flag,
    "keepalives_idle": _positive,
    "keepalives_interval": _positive,
    "keepalives_count": _positive,
    "tcp_user_timeout": _positive,
    "max_waiters": _positive,
    "liveness": _liveness,
    "ttl": _seconds,
}
_DEFAULTS: dict[str, Any] = {
    "schema": "dlock",
    "table_prefix": "",
    "auto_migrate": False,
    "synchronous_commit": False,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
    "max_waiters": 8,
    "liveness": "session",
    "ttl": None,
}


@dataclass(frozen=True)
class Config:
    """How to connect: libpq conninfo (our own options removed) and our settings."""

    #: Holds the password: kept out of the repr (a debug log, a traceback's locals).
    conninfo: str = field(repr=False)
    url: str
    statements: Statements
    auto_migrate: bool
    synchronous_commit: bool
    keepalives_idle: int
    keepalives_interval: int
    keepalives_count: int
    tcp_user_timeout: int
    max_waiters: int
    #: ``session``, or ``ttl``: leases live by their ttl alone, with no session state.
    liveness: str
    #: The ttl of a lease whose lock gives none (``liveness=ttl`` only).
    ttl: float | None
    user_options: str | None
    has_application_name: bool
    has_connect_timeout: bool

    def connect(self, role: str, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        """A new connection for ``role`` (``lock``, ``waiter`` or ``migrate``).

        Raises:
            BackendError: the server cannot be reached or refuses us.
        """
        try:
            return psycopg.Connection.connect(
                self.conninfo, autocommit=autocommit, **self.connection_options(role)
            )
        except psycopg.Error as exc:
            raise translate(exc, f"connecting ({role})", self.url) from exc

    async def aconnect(self, role: str) -> psycopg.AsyncConnection[Any]:
        """``connect`` for asyncio: a new autocommit ``AsyncConnection`` for ``role``."""
        try:
            return await psycopg.AsyncConnection.connect(
                self.conninfo, autocommit=True, **self.connection_options(role)
            )
        except psycopg.Error as exc:
            raise translate(exc, f"connecting ({role})", self.url) from exc

    def connection_options(self, role: str) -> dict[str, Any]:
        """libpq's parameters for a connection of ``role``, beside the conninfo."""
        server = [
            f"-c tcp_keepalives_idle={self.keepalives_idle}",
            f"-c tcp_keepalives_interval={self.keepalives_interval}",
            f"-c tcp_keepalives_count={self.keepalives_count}",
            f"-c tcp_user_timeout={self.tcp_user_timeout}",
        ]
        if role == "lock":
            server.append(f"-c {LOCK_SESSION}=on")  # read back: the options got through
            server.append("-c idle_in_transaction_session_timeout=0")
            server.append(f"-c synchronous_commit={'on' if self.synchronous_commit else 'off'}")
        elif role == "waiter":
            # A waiter keeps its place in the queue of a key in an open transaction until its
            # thread acquires; one left behind by a thread that never came back ends here.
            server += ["-c statement_timeout=0", "-c idle_in_transaction_session_timeout=60s"]
        else:
            server += ["-c synchronous_commit=on", "-c client_min_messages=warning"]
        if self.user_options:
            server.append(self.user_options)
        kwargs: dict[str, Any] = {
            "keepalives": 1,
            "keepalives_idle": self.keepalives_idle,
            "keepalives_interval": self.keepalives_interval,
            "keepalives_count": self.keepalives_count,
            "tcp_user_timeout": self.tcp_user_timeout,
            "options": " ".join(server),
        }
        if self.liveness == "ttl":
            # Through a transaction-mode pooler: no startup options (PgBouncer refuses
            # them), no server-side prepared statements (psycopg prepares none).
            kwargs["prepare_threshold"] = None
            if self.user_options:
                kwargs["options"] = self.user_options
            else:
                del kwargs["options"]
        if not self.has_application_name:
            kwargs["application_name"] = f"celery_dlock {role}"
        if not self.has_connect_timeout:
            kwargs["connect_timeout"] = 10
        return kwargs


def parse_url(url: str, overrides: dict[str, Any]) -> Config:
    """The connection and settings for ``url``; ``overrides`` win over its query options.

    Raises:
        ConfigurationError: a wrong scheme, an unknown option, a bad value or a URL that
            libpq cannot parse; the message names it (the password masked).
    """
    parts = urlsplit(url)
    if parts.scheme.lower() not in _SCHEMES:
        raise ConfigurationError(
            f"a postgres backend URL starts with postgresql://, postgresql+psycopg:// or "
            f"postgres://, not {mask_url(url)!r}"
        )
    try:
        return _parse(url, parts, overrides)
    except ConfigurationError:
        if "@" in parts.netloc or "@" not in url.partition("://")[2]:
            raise
        # An '@' after the hosts most often ends a password holding a '/', '?' or '#' that
        # is not percent-encoded: the URL was cut inside it, and a piece of it would show
        # in the error as a port, an option's name or a schema.
        raise ConfigurationError(
            f"postgres URL {mask_url(url)!r} holds an '@' after its host: percent-encode a "
            "'/', '?' or '#' in its password (%2F, %3F, %23) and an '@' in an option (%40)"
        ) from None


def _parse(url: str, parts: SplitResult, overrides: dict[str, Any]) -> Config:
    """:func:`parse_url` past the scheme's check."""
    _check_ports(url, parts.netloc)
    known: dict[str, Any] = {**_OPTIONS, **dict.fromkeys(LIBPQ_PARAMETERS, str)}
    given = url_options("postgres", parts.query, known, overrides)
    ours = {**_DEFAULTS, **{k: v for k, v in given.items() if k in _OPTIONS}}
    libpq = {k: str(v) for k, v in given.items() if k not in _OPTIONS}
    try:
        validate_names(ours["schema"], ours["table_prefix"])
    except ValueError as exc:
        raise ConfigurationError(f"{exc} [{mask_url(url)}]") from None
    if ours["schema"].startswith("pg_") or ours["schema"] == "information_schema":
        # The server refuses to create pg_* schemas only at migrate(), and a superuser's
        # migrate() puts the tables among information_schema's views.
        raise ConfigurationError(
            f"schema {ours['schema']!r} is the server's own (pg_* and information_schema): "
            f"name a schema of the store's own, such as dlock [{mask_url(url)}]"
        )
    user_options = libpq.pop("options", None)
    # The user and password go to libpq as parameters, as Python reads them (up to the last
    # '@'): libpq ends the password at the first '@', so p@ss was the password p and the
    # host ss@db, and a '%' not encoded failed with the password in the error. Not
    # urlunsplit: it drops the '//' of an empty host (postgresql:///db?host=/run/pg).
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            libpq.setdefault("user", unquote(user))
        if colon:
            libpq.setdefault("password", unquote(password))
    base = f"postgresql://{hosts}{parts.path}"
    try:
        conninfo = make_conninfo(base, **libpq)
    except psycopg.Error as exc:
        raise ConfigurationError(f"bad postgres URL {mask_url(url)!r}: {exc}") from None
    named = {name for name, _ in parse_qsl(parts.query)} | set(libpq)
    if (ours["liveness"] == "ttl") != (ours["ttl"] is not None):
        raise ConfigurationError(
            "liveness=ttl needs ttl=SECONDS, the lease length of a lock that gives no ttl "
            f"(renewed every ttl/3 while held), and ttl= applies to liveness=ttl only "
            f"[{mask_url(url)}]"
        )
    return Config(
        conninfo=conninfo,
        url=mask_url(url),
        statements=Statements(
            Names(ours["schema"], ours["table_prefix"]), session=ours["liveness"] == "session"
        ),
        auto_migrate=bool(ours["auto_migrate"]),
        synchronous_commit=bool(ours["synchronous_commit"]),
        keepalives_idle=int(ours["keepalives_idle"]),
        keepalives_interval=int(ours["keepalives_interval"]),
        keepalives_count=int(ours["keepalives_count"]),
        tcp_user_timeout=int(ours["tcp_user_timeout"]),
        max_waiters=int(ours["max_waiters"]),
        liveness=str(ours["liveness"]),
        ttl=ours["ttl"],
        user_options=user_options,
        has_application_name="application_name" in named,
        has_connect_timeout="connect_timeout" in named,
    )


def _check_ports(url: str, netloc: str) -> None:
    """Refuse a port that is no port number, naming it, rather than fail at the first
    connection (a worker would retry its tasks for ever)."""
    for port in _ports(netloc):
        if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigurationError(
                f"postgres URL {mask_url(url)!r} has the port {port!r}: a number from 1 to 65535"
            )


def _ports(netloc: str) -> list[str]:
    """The ports written in ``netloc``'s hosts (``h1:5432,h2``: ``["5432"]``)."""
    hosts = netloc.rpartition("@")[2]
    ports = []
    for host in hosts.split(","):
        _, colon, port = host.rpartition(":")
        if port and colon and not port.endswith("]"):  # "[::1]": no port
            ports.append(port)
    return ports


def translate(exc: psycopg.Error, what: str, url: str) -> DLockError:
    """The error to raise for driver error ``exc`` (raise it ``from exc``), by SQLSTATE.

    All driver errors are translated here: a missing schema is a ``ConfigurationError``,
    everything else a ``BackendError``.
    """
    state = exc.sqlstate
    if state in _NO_SCHEMA:
        return ConfigurationError(
            f"the celery_dlock tables are missing ({exc.diag.message_primary}): call the "
            f"backend's migrate() (or `celery-dlock migrate`, `celery dlock migrate`), or add "
            f"auto_migrate=1 to the URL [{url}]"
        )
    code = f" (SQLSTATE {state})" if state else ""
    text = str(exc).strip()
    message = text.splitlines()[0] if text else type(exc).__name__
    if state == _NO_RIGHTS:
        message += f"; {_MIGRATE_RIGHTS if what == 'migrate' else _GRANTS}"
    return BackendError(f"postgres {what} failed{code}: {message}", url)
