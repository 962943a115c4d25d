"""How the Postgres backend knows that the server ended a session: the FATAL message it sends
first (``EndNotice``, looked at by ``has_ended`` before a statement), or the error of the
statement that met the end (``connection_lost``)."""

from __future__ import annotations

import select
from typing import Any

import psycopg
from psycopg.pq import ConnStatus

__all__ = ["EndNotice", "connection_lost", "end_notice", "has_ended"]

#: SQLSTATEs after which the server has ended the session (admin/crash shutdown, restarting).
_SESSION_ENDED = frozenset({"57P01", "57P02", "57P03"})


class EndNotice:
    """A lock session's notice handler: whether the server said it ends the session. A
    session the server ends (``pg_terminate_backend``, a shutdown, an idle timeout) sends a
    FATAL message before it leaves ``pg_stat_activity`` and, a moment later, closes its
    socket; libpq passes a message that comes while no statement is under way as a notice.
    An immediate shutdown, or the crash of another session (the server then restarts), says
    it by a WARNING with the SQLSTATE of a shutdown (57P01, 57P02) instead."""

    __slots__ = ("said",)

    def __init__(self) -> None:
        self.said = False

    def __call__(self, diagnostic: psycopg.errors.Diagnostic) -> None:
        if (
            diagnostic.severity_nonlocalized in ("FATAL", "PANIC")
            or diagnostic.sqlstate in _SESSION_ENDED
        ):
            self.said = True


Connection = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]


def has_ended(conn: Connection, notice: EndNotice) -> bool:
    """Whether the server ended the session on ``conn`` (said so to ``notice``, its notice
    handler), or its socket did, as far as what is there to read now tells (no round trip,
    no wait; no statement may be under way)."""
    pgconn = conn.pgconn
    try:
        poller = select.poll()  # not select(): descriptors above 1023 are common
        poller.register(pgconn.socket, select.POLLIN | select.POLLERR | select.POLLHUP)
        if poller.poll(0):
            pgconn.consume_input()  # reads what came; the socket's end breaks the status
            pgconn.is_busy()  # parses it: a FATAL message reaches ``notice``
    except (psycopg.Error, OSError):
        return True
    return notice.said or pgconn.status != ConnStatus.OK


def end_notice(conn: Connection) -> EndNotice:
    """A new ``EndNotice``, handling the notices of ``conn``."""
    notice = EndNotice()
    conn.add_notice_handler(notice)
    return notice


def connection_lost(exc: psycopg.Error, conn: Connection) -> bool:
    """Whether ``exc`` ended the session on ``conn`` (so a statement may or may not have run)."""
    state = exc.sqlstate
    if conn.closed or conn.broken:
        return True
    return state is not None and (state.startswith("08") or state in _SESSION_ENDED)
