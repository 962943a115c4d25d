"""The doctor's ``connections`` check for Postgres: room for more sessions under the
server's ``max_connections`` (less its reserved ones) and under the ``CONNECTION LIMIT`` of
the role and of the database, each with :data:`HEADROOM` to spare, and how many sessions
celery-dlock's lock sessions and waiters take."""

from __future__ import annotations

from typing import Any

import psycopg

from celery_dlock.backends.base import Check
from celery_dlock.backends.postgres import rows
from celery_dlock.backends.postgres.config import Config

__all__ = ["HEADROOM", "connections"]

#: Fail when fewer than this share of the usable sessions (or of a limit) are free.
HEADROOM = 0.1


def connections(conn: psycopg.Connection[Any], config: Config, liveness: str) -> Check:
    held = config.statements.keys.held(select="DISTINCT p.pid ")
    limit, reserved, used, locks, waiters, holding = rows.only(
        conn,
        "-- connections: | max_connections, reserved, client sessions, celery_dlock lock "
        "and waiter sessions (any schema), sessions holding leases of this schema\n"
        "SELECT current_setting('max_connections')::int, "
        "current_setting('superuser_reserved_connections')::int "
        "+ coalesce(current_setting('reserved_connections', true)::int, 0), "
        # A role without pg_read_all_stats sees no backend_type of other roles' sessions;
        # every role sees pg_stat_database.
        "(SELECT sum(d.numbackends)::int FROM pg_catalog.pg_stat_database AS d), "
        "count(*) FILTER (WHERE a.application_name = 'celery_dlock lock'), "
        "count(*) FILTER (WHERE a.application_name = 'celery_dlock waiter'), "
        f"(SELECT count(*) FROM ({held}) AS h) FROM pg_catalog.pg_stat_activity AS a",
    )
    usable = limit - reserved
    free = usable - used
    named = "" if not config.has_application_name else " (this URL names its own application_name)"
    schema = config.statements.names.schema
    scarce = _scarce_limits(conn)
    return Check(
        "connections",
        free >= HEADROOM * usable and not scarce,
        "".join(f"{text}; " for text in scarce)
        + f"{used} of {usable} usable sessions in use (max_connections {limit}, {reserved} "
        f"reserved), {free} free; celery_dlock: {locks} lock sessions, {waiters} waiter "
        f"sessions{named}, {holding} sessions holding leases of {schema!r}; "
        + (
            "each worker process needs one lock session, plus one per thread waiting at once"
            if liveness == "session"
            else "through a pooler, its server connections are what count here"
        ),
    )


def _scarce_limits(conn: psycopg.Connection[Any]) -> list[str]:
    """The role's and the database's ``CONNECTION LIMIT`` with less than :data:`HEADROOM`
    of it free: the server refuses this role's next session there, whatever
    ``max_connections`` leaves (a superuser is held to neither)."""
    role, role_used, database, database_used = rows.only(
        conn,
        "-- connection limits: | the role's CONNECTION LIMIT (-1: none) and its sessions, "
        "the database's and its sessions\n"
        "SELECT CASE WHEN r.rolsuper THEN -1 ELSE r.rolconnlimit END, (SELECT count(*)::int "
        "FROM pg_catalog.pg_stat_activity WHERE usename = current_user), "
        "CASE WHEN r.rolsuper THEN -1 ELSE d.datconnlimit END, (SELECT s.numbackends "
        "FROM pg_catalog.pg_stat_database AS s WHERE s.datname = current_database()) "
        "FROM pg_catalog.pg_roles AS r, pg_catalog.pg_database AS d "
        "WHERE r.rolname = current_user AND d.datname = current_database()",
    )
    return [
        f"{who} has {limit - used} of its CONNECTION LIMIT {limit} free (the server refuses "
        "its sessions past it)"
        for who, limit, used in (
            ("this role", role, role_used),
            ("this database", database, database_used),
        )
        if limit >= 0 and limit - used < HEADROOM * limit
    ]
