"""``celery dlock doctor`` for Postgres: the server, the schema, a pooler in the way, and room
for more sessions.

The checks run on two plain connections of their own (``application_name`` ``celery_dlock
doctor``), closed afterwards, so that a check never disturbs the process's lock session.
What the schema should hold is read from what ``migrate()`` creates (``ddl``, ``functions``)
and from the statements the backend runs, so the checks follow the code without a list of
their own:

- ``schema``: the server takes writes (not a standby, transactions not read-only); the
  role may use the schema; a table of the backend's name that exists is the backend's (its
  primary key: ``migrate()`` passes over any table that exists); the schema version that
  ``migrate()`` recorded is this code's (an older one, or none: run migrate; a newer one:
  upgrade this process, whose ``migrate()`` refuses it); every table, sequence and index of
  ``migrate()`` exists; the role has the rights on them that the backend uses (each missing
  one named as a ``GRANT``: the server checks rights only when a statement runs, so preparing
  checks none); each SQL function has the body this version creates; and every statement the
  backend runs is accepted by the server (prepared, never executed): a column of another
  version is named.
- ``connections``: see :mod:`celery_dlock.backends.postgres.capacity`.
- ``pooler``: a transaction-mode pooler hands a client's transactions to whichever server
  connection is free. Asking a second client to hold a transaction open makes the pooler
  either give it our server connection (the same backend pid on two clients at once) or give
  our next transaction another one (our backend pid changes): both are impossible on a direct
  connection or through session pooling. A pid compared across two transactions of one idle
  client alone misses it, since PgBouncer hands the most recently freed server connection
  back. A pooler in session mode keeps each client on one server connection, so session
  liveness works through it; it shows only as a port that differs from the server's.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import psycopg
from psycopg.pq import DiagnosticField, ExecStatus

from celery_dlock.backends.base import Check
from celery_dlock.backends.postgres import rows
from celery_dlock.backends.postgres.capacity import connections
from celery_dlock.backends.postgres.config import Config, translate
from celery_dlock.backends.postgres.functions import functions
from celery_dlock.backends.postgres.migration import (
    SCHEMA_VERSION,
    foreign_tables,
    recorded_version,
)
from celery_dlock.backends.postgres.sql import Names, ddl
from celery_dlock.backends.postgres.statements import Statements

__all__ = ["SERVER_TIME", "checks"]

SERVER_TIME = (
    "-- server_time: | the server's clock now (the one expiry is judged by), seconds since "
    "the epoch\nSELECT extract(epoch FROM clock_timestamp())::float8"
)
#: ``server_version_num`` of the oldest server we support.
MIN_VERSION = 120000
#: Seconds our second transaction may wait for a pooler's server connection.
POOL_WAIT = 5.0

_MIGRATE = (
    "run `celery-dlock migrate` or `celery dlock migrate` (or the backend's migrate(); idempotent)"
)
#: Through a proxy, the server's keepalives watch the proxy, not the holder's host.
_CUT_OFF = (
    " (a holder cut off from it keeps its leases until it drops that client: its own "
    "keepalives decide, PgBouncer's tcp_keepalive, tcp_keepidle, tcp_keepintvl, tcp_keepcnt "
    "and tcp_user_timeout; the URL's keepalives act between it and the server)"
)
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_RELATION = re.compile(
    r'(?:TABLE|SEQUENCE) IF NOT EXISTS ("[^"]+"\."[^"]+")|INDEX IF NOT EXISTS ("[^"]+")'
    r'|CONSTRAINT ("[^"]+") PRIMARY KEY'
)
_FUNCTION = re.compile(r'FUNCTION "[^"]+"\."([^"]+)"\(.*?\$dlock\$(.*)\$dlock\$\Z', re.DOTALL)


def checks(config: Config, liveness: str) -> list[Check]:
    """The server's version, the schema, a pooler (and whether ``liveness`` works through
    it) and the sessions left under ``max_connections``.

    Raises:
        BackendError: the server cannot be reached or failed.
    """
    with _connect(config) as conn:
        try:
            return [
                _version(conn),
                _schema(conn, config.statements),
                _pooler(conn, config, liveness),
                connections(conn, config, liveness),
            ]
        except psycopg.Error as exc:
            raise translate(exc, "diagnose", config.url) from exc


def _connect(config: Config, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    """A plain connection for the checks: the URL's own (its ``options=`` too), without the
    server settings that the lock session adds to the startup parameter ``options`` (a stock
    PgBouncer refuses them, and the checks should still say what is in the way) and with no
    prepared statement.

    Raises:
        BackendError: the server cannot be reached or refuses us.
    """
    kwargs: dict[str, Any] = {"autocommit": autocommit, "prepare_threshold": None}
    if config.user_options:
        # The URL's own options= reach every session of the store (liveness=ttl too).
        kwargs["options"] = config.user_options
    if not config.has_application_name:
        kwargs["application_name"] = "celery_dlock doctor"
    if not config.has_connect_timeout:
        kwargs["connect_timeout"] = 10
    try:
        return psycopg.Connection.connect(config.conninfo, **kwargs)
    except psycopg.Error as exc:
        raise translate(exc, "connecting (doctor)", config.url) from exc


def _version(conn: psycopg.Connection[Any]) -> Check:
    number, text = rows.only(
        conn,
        "-- version: | server_version_num, server_version\n"
        "SELECT current_setting('server_version_num')::int, current_setting('server_version')",
    )
    return Check("postgres version", number >= MIN_VERSION, f"{text} (needs 12 or newer)")


class _Unfit(Exception):
    """The schema is not fit for the backend; the message says why and what to do."""


def _schema(conn: psycopg.Connection[Any], statements: Statements) -> Check:
    try:
        return Check("schema", True, _fit_schema(conn, statements))
    except _Unfit as unfit:
        return Check("schema", False, str(unfit))


def _fit_schema(conn: psycopg.Connection[Any], statements: Statements) -> str:
    """What the doctor says of a schema the backend can use.

    Raises:
        _Unfit: the first thing found that the backend cannot use.
    """
    names = statements.names
    role = _role_may_write(conn, names)
    foreign = foreign_tables(conn, names)
    if foreign:
        raise _Unfit(
            f"{'; '.join(foreign)}: not as migrate() makes it (another application's table, "
            "or one changed by hand), which migrate() leaves alone: give the store a schema "
            "or table_prefix of its own"
        )
    version = _version_problem(recorded_version(conn, names))
    if version:
        raise _Unfit(version)
    kinds = _relations(conn, names)
    lacking = _lacking(conn, names)
    if lacking:
        raise _Unfit(
            f"role {role!r} lacks rights the backend uses: "
            + "; ".join(_grants(names, role, lacking))
        )
    stale, absent = _stale_functions(conn, statements)
    if stale:
        raise _Unfit(
            f"SQL functions {', '.join(stale)} differ from this version's: {_MIGRATE} (it "
            "replaces them)"
        )
    tried, misfit = _prepare_all(conn, statements)
    if misfit:
        raise _Unfit(
            f"the tables are not this version's: {misfit}; see the CHANGELOG for the migration"
        )
    made = len(functions(statements)) - len(absent)
    # Tables made from schema.metadata() (Alembic) have no SQL functions: only SQL clients
    # (psql, other languages) need them, and migrate() adds them.
    without = (
        f"; no SQL functions {', '.join(absent)} (for SQL clients only, migrate() adds them)"
        if absent
        else ""
    )
    return (
        f"{names.schema!r} is current: schema version {SCHEMA_VERSION}, "
        + ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        + f" and {made} functions as this version makes them; the "
        f"server accepts all {tried} statements the backend runs{without}"
    )


def _role_may_write(conn: psycopg.Connection[Any], names: Names) -> str:
    """The role, once it is known to write leases here: not a standby, not read-only, and
    allowed to use the schema."""
    role, usable, standby, read_only = rows.only(
        conn,
        "-- usage: schema | the role, whether it may use the schema (true when it is "
        "missing), whether the server is a standby, whether transactions are read-only\n"
        "SELECT current_user, n IS NULL OR has_schema_privilege(n, 'USAGE'), "
        "pg_catalog.pg_is_in_recovery(), current_setting('transaction_read_only') = 'on' "
        "FROM to_regnamespace(%s) AS n",
        (f'"{names.schema}"',),
    )
    if standby:
        raise _Unfit(
            "the server is a standby (in recovery): leases are written on the primary; point "
            "the URL at it (or add target_session_attrs=read-write)"
        )
    if read_only:
        raise _Unfit(
            f"transactions of role {role!r} are read-only here "
            "(default_transaction_read_only is on for the role, the database or the URL's "
            "options): every acquire writes"
        )
    if not usable:
        raise _Unfit(
            f"role {role!r} may not use schema {names.schema!r}: "
            + "; ".join(_grants(names, role, {"": ["USAGE"]}))
        )
    return str(role)


def _relations(conn: psycopg.Connection[Any], names: Names) -> dict[str, int]:
    """How many tables and sequences, and indexes, migrate() makes, once all exist."""
    relations, kinds = [], {"tables and sequences": 0, "indexes": 0}
    for statement in ddl(names):
        for table, index, key in _RELATION.findall(statement):
            relations.append(table or f'"{names.schema}".{index or key}')
            kinds["tables and sequences" if table else "indexes"] += 1
    missing = rows.only(
        conn,
        "-- missing: relation names | those that do not exist\n"
        "SELECT array(SELECT name FROM unnest(%s::text[]) AS name "
        "WHERE to_regclass(name) IS NULL)",
        (relations,),
    )[0]
    if len(missing) == len(relations):
        raise _Unfit(
            f"schema {names.schema!r} has none of the celery_dlock tables: {_MIGRATE}, or add "
            "auto_migrate=1 to the URL"
        )
    if missing:
        raise _Unfit(f"missing {', '.join(missing)}: {_MIGRATE}")
    return kinds


#: The rights the backend uses on each relation (``sequence`` for the fence sequence):
#: the janitor deletes history, restore_guard reads and moves the sequence.
_RIGHTS = {
    "locks": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "history": ("SELECT", "INSERT", "DELETE"),
    "successes": ("SELECT", "INSERT", "UPDATE"),
    "fence_guard": ("SELECT", "INSERT"),
    "fence": ("USAGE", "SELECT", "UPDATE"),
}


def _version_problem(recorded: int | None) -> str:
    """What is wrong with the schema version ``recorded`` (None: no locks table), or ""."""
    if recorded is None or recorded == SCHEMA_VERSION:
        return ""
    if recorded > SCHEMA_VERSION:
        return (
            f"schema version {recorded}, newer than this process's {SCHEMA_VERSION}: a newer "
            "celery-dlock migrated it; upgrade this process (its migrate() refuses the schema, "
            "so that it does not put back its own SQL functions)"
        )
    unrecorded = (
        " (none recorded: made, or last migrated, by a release from before schema versions)"
        if recorded == 0
        else ""
    )
    return (
        f"schema version {recorded}{unrecorded}, older than this process's {SCHEMA_VERSION}: "
        f"{_MIGRATE}; tables kept with Alembic take this version's schema.metadata()"
    )


def _lacking(conn: psycopg.Connection[Any], names: Names) -> dict[str, list[str]]:
    """The rights of :data:`_RIGHTS` the connected role lacks, by relation."""
    wanted = [(relation, right) for relation, rights in _RIGHTS.items() for right in rights]
    rows = conn.execute(
        "-- rights: (relation, name, right)... | those the role lacks\n"
        "SELECT w.relation, w.privilege FROM unnest(%s::text[], %s::text[], %s::text[]) "
        "AS w(relation, name, privilege) WHERE NOT CASE WHEN w.relation = 'fence' "
        "THEN has_sequence_privilege(w.name, w.privilege) "
        "ELSE has_table_privilege(w.name, w.privilege) END",
        (
            [relation for relation, _ in wanted],
            [names.table(relation) for relation, _ in wanted],
            [right for _, right in wanted],
        ),
    ).fetchall()
    lacking: dict[str, list[str]] = {}
    for relation, right in rows:
        lacking.setdefault(relation, []).append(right)
    return lacking


def _grants(names: Names, role: str, lacking: dict[str, list[str]]) -> list[str]:
    """The GRANT statements that give ``role`` the rights ``lacking`` (``""``: the schema)."""
    return [
        f"GRANT {', '.join(rights)} ON "
        + (
            f'SCHEMA "{names.schema}"'
            if not relation
            else f"{'SEQUENCE' if relation == 'fence' else 'TABLE'} {names.table(relation)}"
        )
        + f' TO "{role}"'
        for relation, rights in lacking.items()
    ]


def _stale_functions(
    conn: psycopg.Connection[Any], statements: Statements
) -> tuple[list[str], list[str]]:
    """Names of the SQL functions whose body is not this version's, and of those missing."""
    wanted = {}
    for statement in functions(statements):
        found = _FUNCTION.search(statement)
        assert found is not None
        wanted[found.group(1)] = found.group(2)
    rows = conn.execute(
        "-- functions: schema, names | (name, body) of those functions\n"
        "SELECT p.proname, p.prosrc FROM pg_catalog.pg_proc AS p "
        "WHERE p.pronamespace = to_regnamespace(%s) AND p.proname = ANY(%s)",
        (f'"{statements.names.schema}"', list(wanted)),
    ).fetchall()
    present = dict(rows)
    stale = sorted(name for name, body in present.items() if wanted[name] != body)
    return stale, sorted(set(wanted) - set(present))


def _prepare_all(conn: psycopg.Connection[Any], statements: Statements) -> tuple[int, str]:
    """Prepare (never run) every single statement of the backend: how many, and the first
    the server refused, with its error ("" if none)."""
    history, _ = statements.history_of("k", "failed", None, 1)
    candidates = [
        (name, text)
        for name, text in vars(statements).items()
        if isinstance(text, str) and text.startswith("--") and ";\n" not in text
    ]
    candidates.append(("history", history))
    for name, text in candidates:
        result = conn.pgconn.prepare(b"", _numbered(text).encode())
        if result.status != ExecStatus.COMMAND_OK:
            raw = result.error_field(DiagnosticField.MESSAGE_PRIMARY) or b"?"
            state = (result.error_field(DiagnosticField.SQLSTATE) or b"?").decode()
            return len(candidates), f"{name}: {raw.decode()} (SQLSTATE {state})"
    return len(candidates), ""


def _numbered(statement: str) -> str:
    """``statement`` with psycopg's ``%(name)s`` placeholders as the server's ``$1``..."""
    order: dict[str, int] = {}
    return _PLACEHOLDER.sub(
        lambda match: f"${order.setdefault(match.group(1), len(order) + 1)}", statement
    )


def _pid(conn: psycopg.Connection[Any]) -> int | None:
    """The backend pid of ``conn``'s next transaction, or None when a pooler kept it waiting
    :data:`POOL_WAIT` seconds for a server connection (cancelled then)."""
    timer = threading.Timer(POOL_WAIT, conn.cancel_safe)
    timer.start()
    try:
        return int(rows.only(conn, "-- pid: | backend pid\nSELECT pg_backend_pid()")[0])
    except psycopg.errors.QueryCanceled:
        return None
    finally:
        timer.cancel()


def _pooler(conn: psycopg.Connection[Any], config: Config, liveness: str) -> Check:
    first = _pid(conn)
    with _connect(config, autocommit=False) as other:
        other_pid = _pid(other)  # its transaction stays open while we look again
        second = _pid(conn) if other_pid not in (first, None) else first
        other.rollback()
    port = rows.only(
        conn, "-- port: | the server's port (NULL on a socket)\nSELECT inet_server_port()"
    )
    between = port[0] is not None and port[0] != conn.info.port
    ports = f"connected to port {conn.info.port}, the server listens on {port[0]}"
    if first is None or other_pid is None:
        return Check(
            "pooler",
            False,
            f"a client waited {POOL_WAIT:g} s for a server connection: a pooler whose pool is "
            "full (or an overloaded server)",
        )
    if other_pid == first:
        seen = f"two clients were given the same backend pid {first} at once"
    elif second is None:
        seen = f"our second transaction waited {POOL_WAIT:g} s for a server connection"
    elif second != first:
        seen = f"the backend pid changed between two transactions ({first} -> {second})"
    else:
        proxy = f"; {ports}: a proxy or a pooler in session mode, fine{_CUT_OFF}" if between else ""
        return Check(
            "pooler",
            True,
            f"no transaction pooling: one backend pid ({first}) across transactions{proxy}",
        )
    seen += f"; {ports}" if between else ""
    if liveness != "session":
        return Check(
            "pooler",
            True,
            f"transaction pooling ({seen}): liveness=ttl keeps no session state, so it works "
            "through it",
        )
    return Check(
        "pooler",
        False,
        f"transaction pooling ({seen}): session liveness needs its lock session's advisory "
        "locks to last between transactions; connect directly or through session pooling, "
        "or add liveness=ttl&ttl=SECONDS to the URL",
    )
