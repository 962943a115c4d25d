"""What the Postgres backend does when a statement fails: the one place where a lost session
is told apart from other errors, and where what may have landed is read back by token."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from celery_dlock.backends.postgres import rows
from celery_dlock.backends.postgres.calls import Release
from celery_dlock.backends.postgres.config import Config, translate
from celery_dlock.backends.postgres.ended import connection_lost
from celery_dlock.backends.postgres.pooling import pooled
from celery_dlock.backends.postgres.session import Client, Session
from celery_dlock.errors import BackendError, ConfigurationError
from celery_dlock.records import Lease, Outcome

__all__ = ["SessionEnded", "refuse", "resolve_release", "undo_acquire", "using_session"]


class SessionEnded(BackendError):
    """The lock session ended under a statement (restart, ``pg_terminate_backend``, a broken
    socket): its leases are lost, and what the statement did may or may not have landed.
    The driver's error is the ``__cause__``."""


@contextmanager
def using_session(client: Client, url: str, what: str) -> Iterator[Session]:
    """The lock session for the statements of operation ``what``; the caller holds
    ``client.mutex``.

    A driver error is raised translated (``translate``); one that ended the session drops
    it first and is raised as ``SessionEnded``, for callers that resolve what may have
    landed to catch.
    """
    session = client.open()
    try:
        yield session
    except psycopg.Error as exc:
        if not connection_lost(exc, session.conn):
            raise translate(exc, what, url) from exc
        client.drop()
        raise SessionEnded(f"postgres {what}: the lock session ended", url) from exc
    except BaseException:
        # Raised while a statement was under way (a Celery soft time limit comes as one):
        # its result is never read, and every later statement on the session would fail
        # with "another command is already in progress". Dropped, as if it had ended: its
        # leases are lost (the server ends them with the connection), a new one opens.
        if session.conn.pgconn.transaction_status == TransactionStatus.ACTIVE:
            client.drop()
        raise


def _translated(ended: SessionEnded, what: str, url: str) -> Exception:
    """``translate`` for the driver error under ``ended``."""
    cause = ended.__cause__
    return translate(cause, what, url) if isinstance(cause, psycopg.Error) else ended


def undo_acquire(
    client: Client, params: dict[str, Any], ended: SessionEnded, url: str
) -> Exception:
    """The session ended under an acquire: if it landed, its lease died with it. Read it back
    by token on a new session and clear it (recorded ``disconnected``); the error to raise."""
    try:
        _undo(client, client.open(), params, "the lock session was lost while acquiring")
    except (psycopg.Error, BackendError, ConfigurationError):
        client.drop()  # left for the next taker or reap(), which record it disconnected
    return _translated(ended, "acquire (the lock session ended)", url)


def refuse(client: Client, params: dict[str, Any], fence: int, pid: int, ran_on: int) -> Exception:
    """Undo an acquire whose advisory lock went wrong; the error to raise (``refusal``)."""
    session = client.session
    if session is not None:
        with contextlib.suppress(psycopg.Error):
            _undo(client, session, params, "the lease's advisory lock could not be taken")
    client.drop()
    return refusal(client.config, fence, pid, ran_on)


def refusal(config: Config, fence: int, pid: int, ran_on: int) -> Exception:
    """The error for a lease whose advisory lock could not be taken by the lock session
    (backend ``pid``): its statement ran on another server connection (``ran_on``: a
    transaction-mode pooler), or a session outside celery_dlock holds that key."""
    if ran_on != pid:
        return pooled(config, pid, ran_on)
    return BackendError(
        f"the advisory lock of the lease with fence {fence} is held by a session outside "
        "celery_dlock: another application uses the same bigint advisory keys in this "
        "database",
        config.url,
    )


def resolve_release(
    client: Client, lease: Lease, outcome: Outcome, ended: SessionEnded, again: Release
) -> Any:
    """The session ended under a release: read the lease's record back by its token.

    If the release landed, its record is there. If not: with session liveness the lease
    died with the session and stays for the next taker or ``reap()`` to record as
    ``disconnected`` (None); with ``liveness=ttl`` it lives on by its ttl, so the release
    runs ``again`` on a new session (it compares the token): its row, or None when the lease
    is no longer ours. A failure here is a ``BackendError`` (the caller may try again).
    """
    client.lost.discard(lease.fence)
    statements, url = client.config.statements, client.config.url
    try:
        session = client.open()
        row = session.one(statements.record_of, {"key": lease.key, "token": lease.token})
        if row is None and client.config.liveness == "ttl":
            return session.one(again.statement, {**again.params, "unlock": False})
    except psycopg.Error as failed:
        client.drop()
        raise translate(failed, "release (reading back)", url) from ended.__cause__
    if row is None or row[7] != outcome.value:
        return None
    return rows.record(row)


def _undo(client: Client, session: Session, params: dict[str, Any], why: str) -> None:
    """Clear the lease ``params`` tried to acquire, if it is there, as ``disconnected``."""
    undo = {**params, "outcome": "disconnected", "problem": "disconnected", "details": why}
    session.one(client.config.statements.release, undo | {"result": None, "unlock": False})
